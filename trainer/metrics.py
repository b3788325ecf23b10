"""Metric records: one JSON object per line in $LOCKSTEP_METRICS_PATH, which the agent tails.

Kinds and fields (docs/agent-protocol.md):
  start      rank, world_size, resumed_from_step, total_steps (if known), time
  total_steps rank (0), total_steps, time     (the run's length, when a script learns it later)
  step       rank, step, loss, tokens_per_s, step_time_s, compute_s, time
  checkpoint rank (0), step, path, bytes, save_s, time    (only after the commit)
  end        rank, step, reason ("finished" or "preempted"), time
Every record also carries "kind". Each line is flushed as soon as it is written, so a reader
never waits on our buffer and a killed process loses at most the line in flight.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, TextIO


class MetricsWriter:
    def __init__(self, path: str | Path, rank: int) -> None:
        self.path = Path(path)
        self.rank = rank
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Append: a reader tailing the file must never see it shrink.
        self._file: TextIO = open(self.path, "a", encoding="utf-8")  # noqa: SIM115

    def write(self, kind: str, **fields: Any) -> dict[str, Any]:
        record = {"kind": kind, "rank": self.rank, **fields, "time": time.time()}
        # One write call per complete line, so a tailing reader sees whole lines only.
        self._file.write(json.dumps(record, allow_nan=False, default=_json_default) + "\n")
        self._file.flush()
        return record

    def start(
        self,
        *,
        world_size: int,
        resumed_from_step: int,
        device: str = "",
        total_steps: int | None = None,
    ) -> None:
        # total_steps: the step the run ends at; the portal projects the run's end from it.
        extra = {} if total_steps is None else {"total_steps": total_steps}
        self.write(
            "start",
            world_size=world_size,
            resumed_from_step=resumed_from_step,
            device=device,
            **extra,
        )

    def step(
        self,
        *,
        step: int,
        loss: float,
        tokens_per_s: float,
        step_time_s: float,
        compute_s: float,
    ) -> None:
        # JSON has no NaN/inf; a diverged loss is reported as null rather than a broken line.
        self.write(
            "step",
            step=step,
            loss=loss if math.isfinite(loss) else None,
            tokens_per_s=tokens_per_s,
            step_time_s=step_time_s,
            compute_s=compute_s,
        )

    def checkpoint(self, *, step: int, path: str, bytes: int, save_s: float) -> None:
        self.write("checkpoint", step=step, path=path, bytes=bytes, save_s=save_s)

    def end(self, *, step: int, reason: str) -> None:
        self.write("end", step=step, reason=reason)

    def close(self) -> None:
        self._file.close()


def _json_default(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {value!r}")
