"""The one owner of saved state: model, optimizer and train state, saved with
torch.distributed.checkpoint (DCP) under constant keys, with a commit marker.

Layout (trainer/checkpoint_layout.py): ``<checkpoint_dir>/step-000050/`` holds DCP's files
(``.metadata`` and one ``__<rank>_0.distcp`` per writing rank) plus ``COMMITTED``, a JSON marker
(``{"step", "world_size", "time", "train_state", ...}``) written last. Step S means S optimizer
steps are done; a run resumed from it starts with step S + 1 and with the sample at the saved
data position (``TrainState.sample_position``).

Commit protocol (DESIGN.md invariant 5): every rank returns from ``dcp.save``; a barrier; only
then rank 0 writes the marker atomically (temporary file, fsync, ``os.replace``, fsync of the
directory) and then appends the ``checkpoint`` metric record. A directory without the marker is
a save that may have been killed half-way and is never used: not by ``latest_committed`` and not
for resume. DCP reshards on load, so a checkpoint written by N ranks resumes on M ranks, and
the model and optimizer state dicts have the same FQN keys under every parallel mode
(trainer/parallel.py), so one saved under FSDP loads under DDP or ZeRO-1 and back.

Asynchronous saves (``async_save=True``): ``save`` stages the state (a copy to host memory)
and hands the write to DCP's background process (or thread). The commit protocol is the same,
only later: the loop calls ``poll`` at each step boundary with a vote of every rank; once no
rank's write is still running, rank 0 writes the marker. ``wait`` blocks until the in-flight
save is written and committed; it runs before the next save and before the process exits
(finish or preemption), so a SIGTERM never leaves a save behind. A save killed half-way has no
marker and is never resumed from.

Staging (``async_staging``): ``fresh`` lets DCP allocate a new host copy for every save;
``reuse`` (the default) keeps one set of host buffers (pinned on CUDA, shared memory for the
process writer) and copies into it at every save, so only the first save pays for allocating
and faulting in the memory; ``overlap`` does the same copy in a background thread that runs
during the next step's forward and backward, and an optimizer step pre-hook makes
``optimizer.step()`` wait for it, so no parameter or optimizer state changes before its copy
is taken. Either way the copy holds exactly the state of the saved step. Buffers are reused
only after the write that reads them has finished (one save in flight at a time).

The stall of a save (``save_stall_s`` in the ``checkpoint`` record, also ``save_s``) is all the
time the loop thread waited on it: staging in ``save`` (``save_staging_s``), the pre-step wait
for an overlapped copy (``save_staging_wait_s``), and the wait for its write and its commit in
``poll``, in the next ``save`` or at exit (``save_write_wait_s``). A synchronous save's stall is
the whole save up to its record.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from trainer.checkpoint_layout import (
    MARKER,
    STEP_DIR,
    dir_bytes,
    is_committed,
    latest_committed,
    read_marker,
    remove_step_dir,
    step_dir_name,
    write_marker,
)
from trainer.distributed import DistInfo
from trainer.metrics import MetricsWriter

STAGING_MODES = ("fresh", "reuse", "overlap")

# Constant top-level keys of the saved state.
MODEL_KEY = "model"
OPTIM_KEY = "optimizer"
TRAIN_KEY = "train_state"


@dataclasses.dataclass
class TrainState:
    """The loop's own state, saved with the model (as 0-d tensors) and echoed in the marker."""

    step: int = 0
    """Optimizer steps done."""
    sample_position: int = 0
    """Global sample positions consumed (trainer/data.py): the next step starts here."""
    epoch: int = 0
    """sample_position // samples per epoch, for people reading the marker."""
    global_batch: int = 0
    """Sequences per optimizer step when saved."""
    reference_global_batch: int = 0
    """The global batch of the first start, which the learning rate was set for."""
    lr_scale_from: float = 1.0
    lr_scale_to: float = 1.0
    lr_ramp_start: int = 0
    """The lr multiplier moves linearly from lr_scale_from to lr_scale_to over the warm-up
    steps after step lr_ramp_start (the linear scaling rule after a batch change)."""

    def to_tensors(self) -> dict[str, torch.Tensor]:
        return {
            k: torch.tensor(v, dtype=torch.float64 if isinstance(v, float) else torch.int64)
            for k, v in dataclasses.asdict(self).items()
        }

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor]) -> TrainState:
        kinds = {f.name: f.type for f in dataclasses.fields(cls)}
        return cls(
            **{
                k: (float(t.item()) if kinds[k] == "float" else int(t.item()))
                for k, t in tensors.items()
                if k in kinds
            }
        )


class _SlowWriter(FileSystemWriter):
    """Fault injection only: a storage writer that sleeps before writing (to widen the window
    in which a background save can be killed)."""

    def __init__(self, path: str, delay_s: float) -> None:
        super().__init__(path)
        self.delay_s = delay_s

    def write_data(self, plan: Any, planner: Any) -> Any:
        time.sleep(self.delay_s)
        return super().write_data(plan, planner)


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
        async_save: bool = False,
        async_type: str = "process",
        async_staging: str = "reuse",
        save_delay_s: float = 0.0,
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
        self.save_delay_s = save_delay_s
        self.async_save = async_save
        self.async_type = async_type
        if async_staging not in STAGING_MODES:
            raise ValueError(f"async_staging must be one of {STAGING_MODES}")
        self.async_staging = async_staging
        self._stager: Any = None  # DCP DefaultStager, made at the first async save
        self._pg: dist.ProcessGroup | None = None
        if async_save and dist_info.distributed and dist_info.device.type == "cuda":
            # async_save needs a CPU-capable group for its background collectives; NCCL is not.
            self._pg = dist.new_group(backend="gloo")
        self._pending: _Pending | None = None
        self._step_hook: Any = None
        if async_save and async_staging == "overlap":
            # The overlapped copy must be complete before the state it copies changes.
            self._step_hook = optimizer.register_step_pre_hook(self._before_optimizer_step)
        if async_save and not dist_info.distributed:
            # The background thread saves outside _single_process_ok's (thread-unsafe) scope.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")

    def step_dir(self, step: int) -> Path:
        return self.root / step_dir_name(step)

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def has_committed(self, step: int) -> bool:
        return is_committed(self.step_dir(step))

    @property
    def in_flight(self) -> bool:
        """An async save has been started and not committed yet (same on every rank)."""
        return self._pending is not None

    def writing(self) -> bool:
        """This rank's part of the in-flight save is still being written."""
        return self._pending is not None and not self._pending.future.done()

    def _state(self, train_state: TrainState, *, for_load: bool = False) -> dict[str, Any]:
        # FQN keys and full (unsharded-looking) shapes in every mode, so the saved layout is the
        # same for 1 or N ranks and any parallelism. On a fresh optimizer this also creates the
        # (zero) state, which dcp.load then fills in place.
        from trainer.parallel import load_templates, state_dicts

        dicts = load_templates if for_load else state_dicts
        model_sd, optim_sd = dicts(self.model, self.optimizer)
        return {MODEL_KEY: model_sd, OPTIM_KEY: optim_sd, TRAIN_KEY: train_state.to_tensors()}

    def _writer(self, path: Path) -> FileSystemWriter | None:
        return _SlowWriter(str(path), self.save_delay_s) if self.save_delay_s else None

    def _prepare_dir(self, path: Path) -> None:
        if self.dist.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            if path.exists():
                # Left by an earlier attempt (a half-written save, or a step redone after
                # resuming from an older checkpoint): its marker goes first, so a crash while
                # overwriting can never leave a marked but mixed directory.
                remove_step_dir(path)
        self.dist.barrier()

    def save(self, train_state: TrainState) -> Path:
        """Save (and, unless async, commit) train_state.step: a collective, all ranks call it.

        Async: wait for any earlier save first (one in flight at a time), stage, return; the
        commit comes from a later `poll` or `wait`."""
        self.wait()  # the time this blocks is counted in the earlier save's stall
        step = train_state.step
        started = time.perf_counter()
        path = self.step_dir(step)
        self._prepare_dir(path)
        state = self._state(train_state)
        if not self.async_save:
            with _single_process_ok():
                dcp.save(
                    state,
                    checkpoint_id=str(path),
                    storage_writer=self._writer(path),
                    no_dist=not self.dist.distributed,
                )
            self._commit(path, train_state, _Stall(), background_s=0.0, blocked_since=started)
            return path
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        # DCP's process-based writer needs a process group to copy into its child; a
        # single-process run uses the thread-based one.
        process = self.async_type == "process" and self.dist.distributed
        kind = AsyncCheckpointerType.PROCESS if process else AsyncCheckpointerType.THREAD
        with _single_process_ok():
            response = dcp.async_save(
                state,
                checkpoint_id=str(path),
                storage_writer=self._writer(path),
                process_group=self._pg,
                async_checkpointer_type=kind,
                async_stager=self._get_stager(shared_memory=process),
                no_dist=not self.dist.distributed,
            )
        staging = None
        if hasattr(response, "upload_completion"):  # overlap: the copy may still be running
            staging, future = response.staging_completion, response.upload_completion
        else:
            future = response
        stall = _Stall(staging_s=time.perf_counter() - started)
        pending = _Pending(path, train_state, future, stall, staging=staging)
        future.add_done_callback(pending.mark_done)
        self._pending = pending
        return path

    def _get_stager(self, *, shared_memory: bool) -> Any:
        """The stager that async_save copies the state with: None (DCP makes a fresh one, with
        fresh buffers, per save) for ``fresh``; else one kept for the whole run, whose cached
        host buffers (keyed by the source storages) every later save copies into."""
        if self.async_staging == "fresh":
            return None
        if self._stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            cuda = self.dist.device.type == "cuda"
            overlap = self.async_staging == "overlap"
            self._stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=cuda,
                    use_shared_memory=shared_memory,
                    use_async_staging=overlap,
                    use_non_blocking_copy=cuda and overlap,
                )
            )
        return self._stager

    def _before_optimizer_step(self, *_: Any) -> None:
        """Optimizer step pre-hook (``overlap``): wait until the in-flight save's copy of the
        state is taken, and count the wait as that save's stall."""
        pending = self._pending
        if pending is None or pending.staging is None:
            return
        started = time.perf_counter()
        try:
            pending.staging.result()  # re-raises a failed copy: the step must not run
        finally:
            pending.staging = None
            pending.stall.staging_wait_s += time.perf_counter() - started

    def close(self) -> None:
        """Wait for (and commit) the save in flight, then free the staging buffers."""
        self.wait()
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def poll(self, any_rank_writing: bool) -> Path | None:
        """Commit the in-flight save if no rank is still writing it (every rank calls this with
        the same vote); returns the committed path, if any."""
        if self._pending is None or any_rank_writing:
            return None
        return self.wait()

    def wait(self) -> Path | None:
        """Block until the in-flight save (if any) is written, then commit it (a collective)."""
        pending = self._pending
        if pending is None:
            return None
        started = time.perf_counter()
        self._pending = None
        if pending.staging is not None:  # no optimizer step since the save: nothing changed
            pending.staging.result()
            pending.staging = None
        pending.future.result()  # re-raises a failed write: no commit, the job restarts
        background = (pending.done_at or time.perf_counter()) - pending.staged_at
        self._commit(pending.path, pending.train_state, pending.stall, background, started)
        return pending.path

    def _commit(
        self,
        path: Path,
        train_state: TrainState,
        stall: _Stall,
        background_s: float,
        blocked_since: float,
    ) -> None:
        """Barrier, marker, record. The record's stall is ``stall`` plus the time since
        ``blocked_since`` (when the loop began to wait in this call) up to the record."""
        # Every rank's part is written (DCP fsyncs its files) before anyone commits.
        self.dist.barrier()
        if self.commit_delay_s:
            time.sleep(self.commit_delay_s)
        if self.dist.is_main:
            marker = {
                "step": train_state.step,
                "world_size": self.dist.world_size,
                "time": time.time(),
                "train_state": dataclasses.asdict(train_state),
                **self.marker_extra,
            }
            write_marker(path, marker)
            size = dir_bytes(path)
            stall.write_wait_s += time.perf_counter() - blocked_since
            # Fields beyond MetricsWriter.checkpoint's (save_stall_s, ...): written directly.
            self.metrics.write(
                "checkpoint",
                step=train_state.step,
                path=str(path),
                bytes=size,
                # save_s is what the portal's interval policy takes for the save stall.
                save_s=stall.total,
                save_stall_s=stall.total,
                save_staging_s=stall.staging_s,
                save_staging_wait_s=stall.staging_wait_s,
                save_write_wait_s=stall.write_wait_s,
                save_background_s=background_s,
                save_bytes=size,
                save_staging=self.async_staging if self.async_save else "sync",
            )
        # No rank runs ahead (or exits) before the commit, so "all ranks exited after a
        # preemption save" implies "the checkpoint is committed".
        self.dist.barrier()

    def resolve_resume(self, resume_from: str | Path | None) -> Path | None:
        """resolve_resume() decided on rank 0 and shared, so every rank loads the same step."""
        choice = resolve_resume(resume_from) if self.dist.is_main else None
        choice = self.dist.broadcast_object(str(choice) if choice else "")
        return Path(choice) if choice else None

    def load(self, step_dir: str | Path) -> TrainState:
        """Load model, optimizer and train state from a committed step dir."""
        path = Path(step_dir)
        marker = read_marker(path)
        if marker is None:
            raise RuntimeError(f"refusing to load {path}: it has no {MARKER} marker")
        # -1 marks train-state fields an older checkpoint did not have.
        template = TrainState(**{f.name: -1 for f in dataclasses.fields(TrainState)})
        state = self._state(template, for_load=True)
        train_sd = state.pop(TRAIN_KEY)
        with _single_process_ok():
            dcp.load(state, checkpoint_id=str(path), no_dist=not self.dist.distributed)
            dcp.load(
                {TRAIN_KEY: train_sd},
                checkpoint_id=str(path),
                planner=DefaultLoadPlanner(allow_partial_load=True),
                no_dist=not self.dist.distributed,
            )
        from trainer.parallel import load_state_dicts

        load_state_dicts(self.model, self.optimizer, state[MODEL_KEY], state[OPTIM_KEY])
        train_state = TrainState.from_tensors(train_sd)
        if train_state.step != marker["step"]:
            raise RuntimeError(
                f"{path}: saved step {train_state.step} but the marker says {marker['step']}"
            )
        return train_state


@dataclasses.dataclass
class _Stall:
    """Where the loop thread waited on one save (seconds)."""

    staging_s: float = 0.0
    """In ``save``: directory, state dicts and (unless overlapped) the copy; for a synchronous
    save everything up to the commit is counted in write_wait_s instead."""
    staging_wait_s: float = 0.0
    """In the optimizer step pre-hook: the rest of an overlapped copy."""
    write_wait_s: float = 0.0
    """For the write to finish, the barrier and the marker (``poll``, ``wait``)."""

    @property
    def total(self) -> float:
        return self.staging_s + self.staging_wait_s + self.write_wait_s


@dataclasses.dataclass
class _Pending:
    """An async save between staging and commit."""

    path: Path
    train_state: TrainState
    future: Any
    stall: _Stall
    staging: Any = None
    """The overlapped copy's future until the loop has waited for it."""
    staged_at: float = dataclasses.field(default_factory=time.perf_counter)
    done_at: float | None = None

    def mark_done(self, _future: Any) -> None:
        self.done_at = time.perf_counter()
