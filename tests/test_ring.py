"""trainer.ring's all-reduce, run by real gloo process groups: it sums like dist.all_reduce on
every rank, and each rank sends exactly the bytes the ring algorithm says, no more.

Five processes are spawned once (importing torch is most of the cost on a small machine); the
ring runs on the world group (N = 5) and on subgroups of 3, 2 and 1 ranks, which also checks
that a subgroup's ranks are mapped to global ranks for the sends. Each child writes what it saw
to a JSON file; the tests below judge it, deriving the expected byte counts on their own.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainer.ring import RingStats, ring_all_reduce

WORLD = 5
# Group ranks (global) by name; gloo subgroups need every process to call new_group for each.
GROUPS = {"world": None, "three": [1, 3, 4], "two": [0, 2], "one": [3]}
# Lengths not divisible by 2, 3 or 5 (uneven chunks), ones smaller than N (empty chunks), one
# divisible by every N here, and an empty tensor.
SHAPES = [(7, 13), (4096,), (1,), (2,), (3,), (60,), (0,)]
DTYPES = ["float32", "float64", "int64", "int32", "float16", "bfloat16"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _contribution(case: int, global_rank: int, shape, dtype: torch.dtype) -> torch.Tensor:
    """The tensor a rank contributes, reproducible anywhere from (case, rank)."""
    g = torch.Generator().manual_seed(1000 * case + global_rank)
    if dtype.is_floating_point and torch.finfo(dtype).bits >= 32:
        return torch.randn(shape, generator=g, dtype=dtype) * 10
    # Small integers, so sums in float16/bfloat16 are exact whatever the order of the adds.
    return torch.randint(-50, 50, shape, generator=g).to(dtype)


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        # A hang fails the test in a minute instead of gloo's default half hour.
        timeout=timedelta(seconds=60),
    )
    groups = {
        name: (ranks, dist.new_group(ranks) if ranks else None) for name, ranks in GROUPS.items()
    }
    report: dict[str, list[dict]] = {}
    case = 0
    for name, (ranks, group) in groups.items():
        members = ranks if ranks is not None else list(range(WORLD))
        for shape in SHAPES:
            for dtype_name in DTYPES:
                case += 1
                if rank not in members:
                    continue
                dtype = getattr(torch, dtype_name)
                mine = _contribution(case, rank, shape, dtype)
                # A transposed view for 2-D shapes: the ring must sum non-contiguous tensors
                # in place too.
                ring_input = mine.t().contiguous().t() if len(shape) == 2 else mine.clone()
                backend = mine.clone()
                dist.all_reduce(backend, group=group)
                stats = RingStats()
                returned = ring_all_reduce(ring_input, group=group, stats=stats)
                expected = sum(_contribution(case, r, shape, dtype).double() for r in members)
                # Float32/64 sums differ in the last bits with the order of the adds; the
                # small-integer cases must match exactly.
                exact = not (dtype.is_floating_point and dtype.itemsize >= 4)
                failure = None
                try:
                    assert returned is ring_input, "not reduced in place"
                    torch.testing.assert_close(ring_input, backend, msg=lambda m: f"vs dist: {m}")
                    torch.testing.assert_close(
                        ring_input.double(),
                        expected,
                        rtol=0 if exact else 1e-5,
                        atol=0 if exact else 1e-4,
                        msg=lambda m: f"vs the sum of contributions: {m}",
                    )
                except AssertionError:
                    failure = traceback.format_exc(limit=1)
                report.setdefault(name, []).append(
                    {
                        "group_rank": members.index(rank),
                        "n": len(members),
                        "numel": mine.numel(),
                        "itemsize": mine.element_size(),
                        "dtype": dtype_name,
                        "bytes_sent": stats.bytes_sent,
                        "bytes_received": stats.bytes_received,
                        "steps": stats.steps,
                        "failure": failure,
                    }
                )
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
    # Leave together, then exit without tearing gloo down (as `python -m trainer` does): a
    # gloo group destroyed or finalized at exit sometimes aborts the process with SIGABRT after
    # its work is done (trainer/planner_check.py's sharded workers did, in a fresh-clone CI).
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("ring")
    with pytest.MonkeyPatch.context() as mp_env:
        # As torchrun does for several processes on one host: one thread each, or five ranks
        # fight over the cores.
        mp_env.setenv("OMP_NUM_THREADS", "1")
        mp.spawn(_worker, args=(_free_port(), str(out)), nprocs=WORLD, join=True)
    merged: dict[str, list[dict]] = {}
    for rank in range(WORLD):
        for name, rows in json.loads((out / f"rank{rank}.json").read_text()).items():
            merged.setdefault(name, []).extend(rows)
    return merged


def expected_bytes_sent(numel: int, n: int, group_rank: int, itemsize: int) -> int:
    """Bytes rank r sends: in the reduce-scatter every chunk but the one it ends up owning
    ((r+1) mod N), in the all-gather every chunk but the one it receives last ((r+2) mod N).

    Chunk sizes come from torch.tensor_split, not from trainer.ring's own arithmetic."""
    if n == 1 or numel == 0:
        return 0
    sizes = [len(c) for c in torch.tensor_split(torch.arange(numel), n)]
    return itemsize * (2 * numel - sizes[(group_rank + 1) % n] - sizes[(group_rank + 2) % n])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("group", ["world", "three", "two", "one"])
def test_ring_sums_like_dist_all_reduce_on_every_rank(runs, group):
    rows = runs[group]
    n = len(GROUPS[group] or range(WORLD))
    assert len(rows) == n * len(SHAPES) * len(DTYPES)
    failures = [r for r in rows if r["failure"]]
    assert not failures, "\n".join(
        f"rank {r['group_rank']} numel {r['numel']} {r['dtype']}: {r['failure']}" for r in failures
    )


@pytest.mark.timeout(180)
@pytest.mark.parametrize("group", ["world", "three", "two", "one"])
def test_each_rank_sends_exactly_its_ring_share_of_the_buffer(runs, group):
    for r in runs[group]:
        n, numel, size = r["n"], r["numel"], r["itemsize"]
        assert r["bytes_sent"] == expected_bytes_sent(numel, n, r["group_rank"], size), r
        assert r["steps"] == (2 * (n - 1) if n > 1 and numel else 0), r
        if numel % n == 0:
            # Even chunks: exactly 2(N-1)/N of the buffer.
            assert r["bytes_sent"] * n == 2 * (n - 1) * numel * size, r


@pytest.mark.timeout(180)
@pytest.mark.parametrize("group", ["world", "three", "two"])
def test_all_ranks_together_send_each_chunk_twice_round_the_ring(runs, group):
    cases: dict[tuple, list[dict]] = {}
    for r in runs[group]:
        cases.setdefault((r["numel"], r["dtype"]), []).append(r)
    for rows in cases.values():
        n, numel, size = rows[0]["n"], rows[0]["numel"], rows[0]["itemsize"]
        assert len(rows) == n
        # N-1 hops in the reduce-scatter and N-1 in the all-gather, whatever the chunking.
        assert sum(r["bytes_sent"] for r in rows) == 2 * (n - 1) * numel * size
        assert sum(r["bytes_received"] for r in rows) == sum(r["bytes_sent"] for r in rows)


def test_ring_refuses_bool_tensors():
    with pytest.raises(TypeError):
        ring_all_reduce(torch.zeros(3, dtype=torch.bool))
