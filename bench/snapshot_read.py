"""The scheduler's snapshot read (jobs/scheduling/reader.py) at the target's size: 512 nodes x 8
GPUs filled by the real plan/apply with gangs of the mix, and 10,000 jobs queued behind them.
bench/hollow.py found it the largest phase of the live pass (0.57 s p50 of 1.03 s, 2026-12-05).

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/test REDIS_URL=redis://127.0.0.1:6379/0 \\
        .venv/bin/python bench/snapshot_read.py [--ref HEAD] [--rounds 8]

Times take_snapshot() of this tree and, with --ref, of the reader at that git ref (its
reader.py loaded beside this one; the rest of the code is this tree's), alternating round by
round on the same database, and checks that both read the same snapshot. A fresh test database
(LOCKSTEP_TEST_DB_NAME names it); results in bench/results/snapshot-read.json.

`--history-days D` first writes D days of finished work before now, as the full cluster runs
it (every GPU busy, gangs of the mix, about 2 h each: ~49,000 allocations a day at 512 nodes),
so the reads that grow with history show; a live cluster keeps all of it.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import io
import json
import os
import pstats
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MIX = [8, 8, 8, 16, 16, 32, 64]  # GPUs: mostly 8-64-GPU gangs, as the target runs


def _ref_reader(ref: str):
    """jobs/scheduling/reader.py as it was at git `ref`, as a module of its own."""
    source = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{ref}:jobs/scheduling/reader.py"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    path = Path(tempfile.mkdtemp(prefix="lockstep-reader-")) / "reader_ref.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("reader_ref", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["reader_ref"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _fill(args) -> dict:
    """512 nodes, a full cluster of gangs, 10,000 queued: the database the passes read."""
    from django.contrib.auth import get_user_model
    from django.utils import timezone

    from bench.scheduler_speed import register_nodes
    from jobs.models import Job
    from jobs.scheduling.apply import apply_plan
    from jobs.scheduling.policy import plan
    from jobs.scheduling.reader import take_snapshot
    from teams.actions import do_create_team

    rng = random.Random(5)
    share = args.nodes * 8 // args.teams
    teams = [do_create_team(f"team-{t}", quota=share) for t in range(args.teams)]
    user = get_user_model().objects.create(username="bench")
    register_nodes(args.nodes, prefix="node", per_rack=32)

    def queue(count: int) -> None:
        Job.objects.bulk_create(
            [
                Job(
                    name=f"j{i}",
                    team=rng.choice(teams),
                    owner=user,
                    image="x",
                    command=["true"],
                    gpus=rng.choice(MIX),
                    priority=rng.choice(["low", "normal", "normal", "high"]),
                    time_limit_s=rng.choice([None, 3600, 7200, 86400]),
                    submitted_at=timezone.now(),
                    state=Job.State.QUEUED,
                    reason="queued; waiting for the scheduler's next pass",
                )
                for i in range(count)
            ],
            batch_size=1000,
        )

    history = _history(args.history_days, teams, user, rng) if args.history_days else {}
    queue(args.nodes * 8 // 16)  # enough to fill the cluster
    applied = apply_plan(plan(take_snapshot(timezone.now())), now=timezone.now())
    queue(args.queued)
    return {"running_jobs": len(applied.applied), "queued": args.queued, **history}


def _history(days: float, teams, user, rng: random.Random) -> dict:
    """`days` of finished gangs before now on every GPU, back to back: one job, one succeeded
    attempt and one allocation per rank each."""
    from datetime import timedelta

    from django.utils import timezone

    from jobs.models import GPU, Allocation, Attempt, Job

    now = timezone.now()
    gpus_by_node: dict[int, list[int]] = {}
    for gpu_id, node_id in GPU.objects.order_by("node_id", "index").values_list("id", "node_id"):
        gpus_by_node.setdefault(node_id, []).append(gpu_id)
    slots = [(node, gpu) for node, ids in gpus_by_node.items() for gpu in ids]
    runs = []  # (team, first slot, size, start, end)
    first = 0
    while first < len(slots):  # the cluster cut into gangs; each lane runs gangs back to back
        size = min(rng.choice(MIX), len(slots) - first)
        t = now - timedelta(days=days)
        while True:
            seconds = min(rng.lognormvariate(8.5, 0.8), 86400)  # median ~1.4 h, mean ~2 h
            end = t + timedelta(seconds=seconds)
            if end >= now - timedelta(minutes=5):
                break
            runs.append((rng.choice(teams), first, size, t, end))
            t = end
        first += size
    jobs = Job.objects.bulk_create(
        [
            Job(
                name=f"h{i}",
                team=team,
                owner=user,
                image="x",
                command=["true"],
                gpus=size,
                submitted_at=start,
                first_started_at=start,
                state=Job.State.SUCCEEDED,
            )
            for i, (team, _, size, start, _) in enumerate(runs)
        ],
        batch_size=2000,
    )
    attempts = Attempt.objects.bulk_create(
        [
            Attempt(
                job=job,
                number=1,
                world_size=size,
                state=Attempt.State.SUCCEEDED,
                master_addr="x",
                master_port=29500,
                created_at=start,
                running_at=start,
                ended_at=end,
            )
            for job, (_, _, size, start, end) in zip(jobs, runs, strict=True)
        ],
        batch_size=2000,
    )
    rows = 0
    batch = []
    for attempt, (_, lo, size, start, end) in zip(attempts, runs, strict=True):
        for rank, (node_id, gpu_id) in enumerate(slots[lo : lo + size]):
            batch.append(
                Allocation(
                    attempt=attempt,
                    gpu_id=gpu_id,
                    node_id=node_id,
                    rank=rank,
                    local_rank=rank % 8,
                    group_rank=rank // 8,
                    claimed_at=start,
                    started_at=start,
                    exited_at=end,
                    exit_code=0,
                    released_at=end,
                )
            )
        if len(batch) >= 5000:
            rows += len(Allocation.objects.bulk_create(batch))
            batch = []
    rows += len(Allocation.objects.bulk_create(batch))
    return {"history_days": days, "history_jobs": len(jobs), "history_allocations": rows}


def _churn(count: int) -> None:
    """Change `count` queued jobs' rows (a new version of each, as a priority change or an
    edit makes) so a round's reads are not all of an unchanged queue: what a pass between
    passes sees on a busy cluster."""
    from django.db.models import F

    from jobs.models import Job

    ids = list(
        Job.objects.filter(state=Job.State.QUEUED)
        .order_by("?")
        .values_list("id", flat=True)[:count]
    )
    Job.objects.filter(id__in=ids).update(min_gpus=F("min_gpus"))


def _canonical(snapshot) -> str:
    """The snapshot as text, its teams in id order (the policy looks them up by id), each
    team's decayed usage to 9 significant digits: summing the same GPU-seconds in another
    order (per GPU, or per gang) differs in the last bits."""
    from dataclasses import replace

    teams = tuple(
        replace(t, usage_history=float(f"{t.usage_history:.9g}"))
        for t in sorted(snapshot.teams, key=lambda t: t.id)
    )
    return repr(replace(snapshot, teams=teams))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=512)
    parser.add_argument("--queued", type=int, default=10_000)
    parser.add_argument("--teams", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--history-days", type=float, default=0.0, help="finished work first")
    parser.add_argument("--ref", help="also time the reader at this git ref, alternating")
    parser.add_argument("--profile", action="store_true", help="print a profile of one read")
    parser.add_argument(
        "--churn", type=int, default=50, help="queued jobs updated before each round"
    )
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "snapshot-read.json"))
    args = parser.parse_args()

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
    import django

    django.setup()
    from django.db import connection
    from django.utils import timezone

    from jobs.scheduling import reader

    memo = reader.UsageMemo()  # the leader's, as run_forever keeps it over its term
    usage, queue = reader.UsageMemo(), reader.QueueMemo()
    readers = {
        "this tree": reader.take_snapshot,
        "this tree, leader's memo": lambda now: reader.take_snapshot(now, memo),
        "this tree, leader's memos": lambda now: reader.take_snapshot(now, usage, queue),
    }
    if args.ref:
        readers[f"at {args.ref}"] = _ref_reader(args.ref).take_snapshot
    test_db = connection.creation.create_test_db(verbosity=0, autoclobber=True, keepdb=False)
    try:
        filled = _fill(args)
        print(f"filled: {filled}", flush=True)
        now = timezone.now()
        snaps = {name: read(now) for name, read in readers.items()}
        same = len({_canonical(s) for s in snaps.values()}) == 1
        times: dict[str, list[float]] = {name: [] for name in readers}
        for round_ in range(args.rounds):
            _churn(args.churn)
            order = list(readers.items())
            for name, read in order if round_ % 2 else order[::-1]:
                started = time.perf_counter()
                read(timezone.now())
                times[name].append(round(time.perf_counter() - started, 4))
        # And after a last churn, as the memos have seen every round's: still one snapshot.
        _churn(args.churn)
        now = timezone.now()
        same_after = len({_canonical(read(now)) for read in readers.values()}) == 1
        if args.profile:
            profile = cProfile.Profile()
            profile.runcall(reader.take_snapshot, timezone.now())
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(25)
            print(text.getvalue())
        result = {
            "database": connection.vendor,
            "nodes": args.nodes,
            **filled,
            "rounds": args.rounds,
            "churn": args.churn,
            "same_snapshot": same,
            "same_snapshot_after_churn": same_after,
            "median_s": {name: statistics.median(t) for name, t in times.items()},
            "times_s": times,
            "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        }
    finally:
        connection.creation.destroy_test_db(test_db, verbosity=0)
    print(
        json.dumps(
            {k: result[k] for k in ("same_snapshot", "same_snapshot_after_churn", "median_s")}
        )
    )
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
