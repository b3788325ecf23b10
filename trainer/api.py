"""A few calls that let any torchrun-style script join Lockstep: metrics on the job's
dashboard, checkpoint-first preemption, and resume after a restart.

    import trainer

    start = 0
    if (path := trainer.resume_from()) is not None:  # a restart: load the latest save
        state = torch.load(path / "state.pt")
        model.load_state_dict(state["model"]); start = state["step"]
    for step in range(start + 1, steps + 1):
        loss = train_one_step()
        trainer.report(step, loss=loss.item(), tokens_per_s=tokens / elapsed)
        if step % 100 == 0 or trainer.should_stop():
            with trainer.save_checkpoint(step) as path:  # committed when the block ends
                if rank == 0:
                    torch.save({"model": model.state_dict(), "step": step}, path / "state.pt")
            if trainer.should_stop():
                break

Under Lockstep the node agent sets the variables these read (docs/agent-protocol.md); run
alone or under plain torchrun they fall back to harmless defaults: no metrics file, no stop
unless SIGTERM, checkpoints under ./checkpoints. Importing this module changes nothing; the
first should_stop() call installs the SIGTERM handler (before it, and in a script that never
asks, SIGTERM terminates as usual: a stop that nobody polls for must not be swallowed).
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from trainer.checkpoint_layout import dir_bytes, latest_committed, step_dir_name, write_marker
from trainer.stop import StopFlag

# Fields of every record (trainer.metrics.MetricsWriter): a metric by one of these names
# would overwrite them and turn the record into something else.
RESERVED = frozenset({"kind", "rank", "step", "time"})

# The first SIGTERM (the agent's checkpoint-and-stop) becomes should_stop(); installed by the
# first should_stop() call only.
_stop = StopFlag((signal.SIGTERM,))
_writer = None
_lock = threading.Lock()


def _rank() -> int:
    return int(os.environ.get("RANK", "0") or 0)


def _metrics():
    global _writer
    path = os.environ.get("LOCKSTEP_METRICS_PATH")
    if not path:
        return None
    with _lock:
        if _writer is None:
            from trainer.metrics import MetricsWriter

            _writer = MetricsWriter(path, _rank())
        return _writer


def report(step: int, **metrics: float) -> None:
    """Record this rank's metrics for a step: `loss`, `tokens_per_s`, `step_time_s` and
    `compute_s` reach the job's live charts. A value that is not a finite number (a diverged
    loss) is written as null, never as a line the agent cannot send."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, not {step!r}")
    if clash := sorted(RESERVED & metrics.keys()):
        raise ValueError(f"metric names {clash} are reserved for the record's own fields")
    writer = _metrics()
    if writer is None:
        return
    values: dict[str, Any] = {name: _finite(value) for name, value in metrics.items()}
    writer.write("step", step=step, **values)


def set_total_steps(total: int) -> None:
    """Say how many steps the whole run takes (the step it ends at): the job's page, the API
    and `lockstep status` then show its progress and when it should end at its pace, and
    start estimates of the jobs waiting for its GPUs use that end. Rank 0's word counts; call
    it again if the length changes."""
    if isinstance(total, bool) or not isinstance(total, int) or total <= 0:
        raise ValueError(f"total must be a positive int, not {total!r}")
    writer = _metrics()
    if writer is not None and writer.rank == 0:
        writer.write("total_steps", total_steps=total)


def _finite(value: Any) -> float | None:
    """A float for a number (a one-element tensor or numpy scalar too), None for anything
    else or a NaN / infinity."""
    if isinstance(value, bool | str):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError, RuntimeError):  # RuntimeError: a tensor of many elements
        return None
    return number if math.isfinite(number) else None


def should_stop() -> bool:
    """True once the agent asked this job to checkpoint and stop (SIGTERM: a preemption, a
    cancel, a time limit). With a process group up it is a collective, true on every rank
    as soon as any rank was asked, so that all ranks save and stop after the same step:
    call it at the same point of every step on every rank."""
    _stop.install()
    local = _stop.requested
    try:
        import torch.distributed as dist
    except ImportError:
        return local
    if not (dist.is_available() and dist.is_initialized()):
        return local
    import torch

    device = "cpu"
    if dist.get_backend() == "nccl":
        device = f"cuda:{torch.cuda.current_device()}"
    flag = torch.tensor([1 if local else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def checkpoint_dir() -> Path:
    """Where this job keeps its checkpoints ($LOCKSTEP_CHECKPOINT_DIR, shared by every
    attempt of the job; ./checkpoints when run alone)."""
    return Path(os.environ.get("LOCKSTEP_CHECKPOINT_DIR") or "checkpoints")


def resume_from() -> Path | None:
    """The checkpoint to resume from: the one the portal chose for this attempt
    ($LOCKSTEP_RESUME_FROM), else, run alone, the latest committed one in checkpoint_dir();
    None for a fresh start."""
    chosen = os.environ.get("LOCKSTEP_RESUME_FROM")
    if chosen:
        return Path(chosen)
    if "LOCKSTEP_JOB_ID" in os.environ:  # under Lockstep: an empty value means start fresh
        return None
    return latest_committed(checkpoint_dir())


@contextmanager
def save_checkpoint(step: int) -> Iterator[Path]:
    """A directory for the save of `step` (checkpoint_dir()/step-NNNNNN). When the block
    ends without an exception, every rank waits for the others (a barrier, with a process
    group up); rank 0 commits the save: it writes the COMMITTED marker and tells the portal,
    which then offers it to later attempts and for model registration; then all ranks leave
    together (a second barrier). A save that raised, or a process killed mid-save, is never
    committed and never resumed from."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, not {step!r}")
    path = checkpoint_dir() / step_dir_name(step)
    path.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    yield path
    import torch.distributed as dist

    grouped = dist.is_available() and dist.is_initialized()
    if grouped:
        dist.barrier()  # every rank's part of the save is written
    try:
        if _rank() == 0:
            _commit(path, step, dist.get_world_size() if grouped else 1, began)
    finally:
        if grouped:
            # Every rank leaves with the save committed, and none runs ahead to tear down
            # the process group while rank 0 still commits (gloo then aborted rank 0 in CI).
            dist.barrier()


def _commit(path: Path, step: int, world_size: int, began: float) -> None:
    write_marker(path, {"step": step, "world_size": world_size})
    writer = _metrics()
    if writer is not None:
        writer.write(
            "checkpoint",
            step=step,
            path=str(path.resolve()),
            bytes=dir_bytes(path),
            save_s=time.perf_counter() - began,
        )
