"""One entry point for 1 or N processes: the torchrun variables decide (as in nanoGPT).

With WORLD_SIZE > 1 the process joins a process group (NCCL on CUDA, gloo on CPU) through
MASTER_ADDR/MASTER_PORT; otherwise nothing distributed is set up. How the model is spread over
the ranks (DDP, ZeRO-1, FSDP2, tensor parallelism) is trainer/parallel.py's business.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

DEFAULT_PG_TIMEOUT_S = 120.0
# How long leaving the process group may take once the work is done and committed.
TEARDOWN_GRACE_S = 60.0


@dataclass(frozen=True)
class DistInfo:
    """Who this process is among the ranks of the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if not self.distributed:
            return
        if self.device.type == "cuda":
            dist.barrier(device_ids=[self.device.index])
        else:
            dist.barrier()

    def any_rank(self, flag: bool) -> bool:
        """True on every rank if flag is True on any rank (a collective: all ranks must call)."""
        return self.any_rank_each(flag)[0]

    def any_rank_each(self, *flags: bool) -> tuple[bool, ...]:
        """Several any_rank votes in one collective (one all-reduce per step, not one per flag)."""
        if not self.distributed:
            return tuple(flags)
        t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return tuple(bool(v) for v in t.tolist())

    def broadcast_object(self, obj: object) -> object:
        """Rank 0's obj, on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, device=self.device)
        return box[0]


def _pick_device(local_rank: int) -> torch.device:
    wanted = os.environ.get("LOCKSTEP_DEVICE", "").strip().lower()
    if wanted == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    # torchrun shows every GPU to every rank (use cuda:LOCAL_RANK); the Lockstep agent sets
    # CUDA_VISIBLE_DEVICES to the rank's own GPU, so there is only cuda:0 to use.
    count = torch.cuda.device_count()
    return torch.device("cuda", local_rank if local_rank < count else local_rank % count)


def init_distributed() -> DistInfo:
    """Read the torchrun variables, pick the device, and join the process group if N > 1."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    device = _pick_device(local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size > 1:
        timeout_s = float(os.environ.get("LOCKSTEP_PG_TIMEOUT_S") or DEFAULT_PG_TIMEOUT_S)
        # An explicit timeout: the defaults (10 min NCCL, 30 min gloo) hide a lost peer for
        # far longer than the platform's hang detection is meant to take.
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            init_method="env://",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    return DistInfo(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world_size,
        device=device,
    )


def close_distributed(
    info: DistInfo, *, grace_s: float = TEARDOWN_GRACE_S, destroy: bool = True
) -> None:
    """Leave the process group: a barrier first, then (unless `destroy` is False) destroy it,
    under a watchdog.

    Without the barrier a rank that is done early tears down its side while another is still
    busy (rank 0 hosts the rendezvous store and computes the final accuracy). A process that
    exits right after (`python -m trainer` does, with os._exit) should pass destroy=False:
    destroy_process_group on gloo sometimes never returns, holding the GIL (seen twice in CI,
    with every rank finished and committed), and an exiting process needs no teardown: the
    kernel closes its sockets. Teardown happens after the last checkpoint is committed, so one
    that still sticks must not turn a finished run into a "hung" one: past `grace_s` the
    watchdog writes every thread's stack to stderr and ends the process with exit status 0."""
    if not (info.distributed and dist.is_initialized()):
        return
    watchdog = threading.Timer(grace_s, _teardown_stuck, args=(info.rank, grace_s))
    watchdog.daemon = True
    watchdog.start()
    try:
        try:
            info.barrier()
        except Exception as exc:  # a peer already gone: nothing left to agree on
            print(f"[rank {info.rank}] teardown barrier failed: {exc}", file=sys.stderr, flush=True)
        if destroy:
            dist.destroy_process_group()
    finally:
        watchdog.cancel()


def _teardown_stuck(rank: int, grace_s: float) -> None:
    print(
        f"[rank {rank}] leaving the process group took over {grace_s:.0f} s; "
        "stacks follow, exiting 0 (the run's work is committed)",
        file=sys.stderr,
        flush=True,
    )
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stdout.flush()
    os._exit(0)
