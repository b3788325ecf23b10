"""The one owner of saved state: model, optimizer and train state, saved with
torch.distributed.checkpoint (DCP) under constant keys, with a commit marker.

Layout: ``<checkpoint_dir>/step-000050/`` holds DCP's files (``.metadata`` and one
``__<rank>_0.distcp`` per writing rank) plus ``COMMITTED``, a JSON marker
(``{"step", "world_size", "time", ...}``) written last. Step S means S optimizer steps are done;
a run resumed from it starts with step S + 1 (and, since batches are a function of the step,
with step S + 1's batch).

Commit protocol (DESIGN.md invariant 5): every rank returns from ``dcp.save``; a barrier; only
then rank 0 writes the marker atomically (temporary file, fsync, ``os.replace``, fsync of the
directory) and then appends the ``checkpoint`` metric record. A directory without the marker is
a save that may have been killed half-way and is never used: not by ``latest_committed`` and not
for resume. DCP reshards on load, so a checkpoint written by N ranks resumes on M ranks.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import time
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from trainer.distributed import DistInfo
from trainer.metrics import MetricsWriter

MARKER = "COMMITTED"
STEP_DIR = re.compile(r"^step-(\d+)$")

# Constant top-level keys of the saved state.
MODEL_KEY = "model"
OPTIM_KEY = "optimizer"
TRAIN_KEY = "train_state"


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def read_marker(step_dir: str | Path) -> dict[str, Any] | None:
    """The parsed COMMITTED marker of step_dir, or None if it is absent or unreadable."""
    try:
        marker = json.loads((Path(step_dir) / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) and isinstance(marker.get("step"), int) else None


def is_committed(step_dir: str | Path) -> bool:
    return read_marker(step_dir) is not None


def latest_committed(checkpoint_dir: str | Path) -> Path | None:
    """The committed step directory with the highest step under checkpoint_dir, or None."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return None
    best: tuple[int, Path] | None = None
    for child in root.iterdir():
        match = STEP_DIR.match(child.name)
        if match and child.is_dir() and is_committed(child):
            step = int(match.group(1))
            if best is None or step > best[0]:
                best = (step, child)
    return best[1] if best else None


def dir_bytes(path: str | Path) -> int:
    """Total size of the regular files under path."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def resolve_resume(resume_from: str | Path | None) -> Path | None:
    """The committed step directory to resume from, or None for a fresh start.

    resume_from should be a committed step directory. If it is not committed (a save killed
    half-way, or a missing directory), fall back to the newest committed sibling and warn;
    with none, start fresh and say so. A checkpoint root (a directory of step-* directories)
    is also accepted and means its newest committed step.
    """
    if not resume_from or not str(resume_from).strip():
        return None
    path = Path(resume_from).expanduser().resolve()
    if is_committed(path):
        return path
    if path.is_dir() and any(STEP_DIR.match(c.name) for c in path.iterdir()):
        found = latest_committed(path)
        if found is None:
            _warn(f"no committed checkpoint under {path}; starting fresh")
        return found
    found = latest_committed(path.parent)
    if found is None:
        _warn(f"{path} is not a committed checkpoint and {path.parent} has none; starting fresh")
    else:
        _warn(f"{path} is not a committed checkpoint; resuming from {found} instead")
    return found


def _warn(message: str) -> None:
    print(f"trainer: warning: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _single_process_ok() -> Iterator[None]:
    """Silence DCP's warning that it runs without a process group: that is what we ask for."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_marker(step_dir: Path, marker: Mapping[str, Any]) -> None:
    tmp = step_dir / f".{MARKER}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(marker, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, step_dir / MARKER)
    _fsync_dir(step_dir)


class CheckpointManager:
    """Saves and loads {model, optimizer, train_state} with DCP; see the module docstring."""

    def __init__(
        self,
        checkpoint_dir: str | Path,
        *,
        every: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        dist_info: DistInfo,
        metrics: MetricsWriter,
        marker_extra: Mapping[str, Any] | None = None,
        commit_delay_s: float = 0.0,
    ) -> None:
        self.root = Path(checkpoint_dir).expanduser().resolve()
        self.every = every
        self.model = model
        self.optimizer = optimizer
        self.dist = dist_info
        self.metrics = metrics
        self.marker_extra = dict(marker_extra or {})
        # Fault injection only: widens the window between "data written" and "committed" so a
        # test can kill a save half-way and check it never becomes the resume point.
        self.commit_delay_s = commit_delay_s

    def step_dir(self, step: int) -> Path:
        return self.root / step_dir_name(step)

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def has_committed(self, step: int) -> bool:
        return is_committed(self.step_dir(step))

    def _state(self, step: int) -> dict[str, Any]:
        # get_state_dict strips DDP's "module." prefix and gives the optimizer state FQN keys,
        # so the saved layout is the same for 1 or N ranks. On a fresh optimizer it also
        # creates the (zero) state, which dcp.load then fills in place.
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        train_sd = {"step": torch.tensor(step, dtype=torch.int64)}
        return {MODEL_KEY: model_sd, OPTIM_KEY: optim_sd, TRAIN_KEY: train_sd}

    def save(self, step: int) -> Path:
        """Save and commit step `step` (a collective: every rank must call it)."""
        started = time.perf_counter()
        path = self.step_dir(step)
        if self.dist.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            if path.exists():
                # Left by an earlier attempt (a half-written save, or a step redone after
                # resuming from an older checkpoint). Drop the marker first so that a crash
                # while overwriting can never leave a marked but mixed directory.
                (path / MARKER).unlink(missing_ok=True)
                _fsync_dir(path)
                shutil.rmtree(path)
        self.dist.barrier()
        with _single_process_ok():
            dcp.save(self._state(step), checkpoint_id=str(path), no_dist=not self.dist.distributed)
        # Every rank's part is written (DCP fsyncs its files) before anyone commits.
        self.dist.barrier()
        if self.commit_delay_s:
            time.sleep(self.commit_delay_s)
        if self.dist.is_main:
            marker = {
                "step": step,
                "world_size": self.dist.world_size,
                "time": time.time(),
                **self.marker_extra,
            }
            _write_marker(path, marker)
            self.metrics.checkpoint(
                step=step,
                path=str(path),
                bytes=dir_bytes(path),
                save_s=time.perf_counter() - started,
            )
        # No rank runs ahead (or exits) before the commit, so "all ranks exited after a
        # preemption save" implies "the checkpoint is committed".
        self.dist.barrier()
        return path

    def resolve_resume(self, resume_from: str | Path | None) -> Path | None:
        """resolve_resume() decided on rank 0 and shared, so every rank loads the same step."""
        choice = resolve_resume(resume_from) if self.dist.is_main else None
        choice = self.dist.broadcast_object(str(choice) if choice else "")
        return Path(choice) if choice else None

    def load(self, step_dir: str | Path) -> int:
        """Load model, optimizer and train state from a committed step dir; return its step."""
        path = Path(step_dir)
        marker = read_marker(path)
        if marker is None:
            raise RuntimeError(f"refusing to load {path}: it has no {MARKER} marker")
        state = self._state(0)
        with _single_process_ok():
            dcp.load(state, checkpoint_id=str(path), no_dist=not self.dist.distributed)
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state[MODEL_KEY],
            optim_state_dict=state[OPTIM_KEY],
        )
        step = int(state[TRAIN_KEY]["step"].item())
        if step != marker["step"]:
            raise RuntimeError(f"{path}: saved step {step} but the marker says {marker['step']}")
        return step
