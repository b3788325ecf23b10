"""Scheduler speed: one plan() pass over 10,000 queued jobs and 512 nodes (goal < 1 s), beside
the first version's policy as the baseline in the same run; and gangs applied per second on the
database (goal >= 200/s on PostgreSQL).

    .venv/bin/python bench/scheduler_speed.py                # plan() only (pure, no database)
    DATABASE_URL=postgres://postgres@127.0.0.1:5432/test \\
        .venv/bin/python bench/scheduler_speed.py --apply    # + apply_plan on that server
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from jobs.scheduling.policy import plan  # noqa: E402
from jobs.scheduling.snapshot import JobView, NodeView, RunningView, Snapshot, TeamView  # noqa: E402

NOW = datetime(2026, 11, 29, tzinfo=UTC)


def build(nodes: int, gpn: int, queued: int, teams: int, busy: float, seed: int) -> Snapshot:
    rng = random.Random(seed)
    views, running, used = [], [], [0] * teams
    job_id = 10**6
    for n in range(nodes):
        taken = set()
        while len(taken) < gpn * busy and rng.random() < 0.9:
            size = rng.choice([1, 2, 4, 8])
            free = [i for i in range(gpn) if i not in taken][:size]
            if len(free) < size:
                break
            team = rng.randrange(teams)
            used[team] += size
            taken.update(free)
            running.append(
                RunningView(
                    id=job_id,
                    team_id=team + 1,
                    gpus=size,
                    priority=rng.randrange(4),
                    slots=tuple((n + 1, i) for i in free),
                    started_at=NOW - timedelta(hours=1),
                    expected_end=NOW + timedelta(seconds=rng.randrange(60, 86400)),
                )
            )
            job_id += 1
        views.append(
            NodeView(
                id=n + 1,
                name=f"node-{n:04d}",
                rack=f"rack-{n // 32}",
                gpu_ids=tuple((n + 1) * 100 + i for i in range(gpn)),
                free=frozenset(set(range(gpn)) - taken),
            )
        )
    sizes = [1] * 50 + [2] * 6 + [4] * 6 + [8] * 25 + [16] * 6 + [32] * 4 + [64] * 3
    jobs = tuple(
        JobView(
            id=j + 1,
            team_id=rng.randrange(teams) + 1,
            gpus=rng.choice(sizes),
            priority=rng.randrange(4),
            submitted_at=NOW - timedelta(seconds=rng.randrange(86400)),
            runtime_estimate_s=rng.choice([None, 3600, 7200, 86400]),
        )
        for j in range(queued)
    )
    share = nodes * gpn // teams
    team_views = tuple(
        TeamView(
            id=t + 1,
            name=f"team-{t}",
            quota=share,
            borrow_limit=nodes * gpn,
            used=used[t],
            weight=1.0,
            usage_history=rng.random() * 1e7,
        )
        for t in range(teams)
    )
    return Snapshot(
        now=NOW, nodes=tuple(views), queued=jobs, teams=team_views, running=tuple(running)
    )


def time_plan(snapshot: Snapshot, repeats: int) -> dict:
    times, result = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        result = plan(snapshot)
        times.append(time.perf_counter() - started)
    return {
        "median_s": round(statistics.median(times), 4),
        "max_s": round(max(times), 4),
        "placed": len(result.placements),
        "preemptions": len(result.preemptions),
        "reasons": len(result.reasons),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=512)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--queued", type=int, default=10_000)
    parser.add_argument("--teams", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--apply", action="store_true", help="also measure apply_plan")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "scheduler-speed.json"))
    args = parser.parse_args()
    results = {
        "nodes": args.nodes,
        "gpus_per_node": args.gpus_per_node,
        "queued": args.queued,
        "teams": args.teams,
        "python": sys.version.split()[0],
    }
    for label, busy in (("cluster_90pct_busy", 0.9), ("cluster_empty", 0.0)):
        snap = build(args.nodes, args.gpus_per_node, args.queued, args.teams, busy, seed=1)
        results[label] = time_plan(snap, args.repeats)
        print(f"plan() {label}: {results[label]}")
    if args.apply:
        results["apply"] = bench_apply(args)
        print(f"apply_plan: {results['apply']}")
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


def bench_apply(args) -> dict:
    """Gangs per second committed by apply_plan on the configured database (a fresh one)."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
    import django

    django.setup()
    from django.contrib.auth import get_user_model
    from django.db import connection
    from django.utils import timezone

    from jobs import actions
    from jobs.models import Allocation, Attempt, Job
    from jobs.scheduling.apply import apply_plan
    from jobs.scheduling.snapshot import take_snapshot
    from teams.actions import do_create_team

    creation = connection.creation
    test_db = creation.create_test_db(verbosity=0, autoclobber=True, keepdb=False)
    try:
        team = do_create_team("bench", quota=100_000)
        user = get_user_model().objects.create(username="bench")
        for n in range(64):
            actions.do_register_node(
                name=f"bench-{n:03d}", gpus=8, address="127.0.0.1", boot_id="b", now=timezone.now()
            )
        rng = random.Random(2)
        total, seconds = 0, 0.0
        for _ in range(5):
            for j in range(300):
                actions.do_submit_job(
                    owner=user,
                    team=team,
                    now=timezone.now(),
                    name=f"b{j}",
                    image="x",
                    command=["true"],
                    gpus=rng.choice([1, 2, 4, 8]),
                )
            snap = take_snapshot(timezone.now())
            decided = plan(snap)
            started = time.perf_counter()
            result = apply_plan(decided, now=timezone.now())
            seconds += time.perf_counter() - started
            total += len(result.applied)
            Job.objects.filter(state=Job.State.QUEUED).update(state=Job.State.CANCELLED)
            Allocation.objects.filter(released_at__isnull=True).update(released_at=timezone.now())
            Attempt.objects.filter(ended_at__isnull=True).update(ended_at=timezone.now())
        return {
            "database": connection.vendor,
            "gangs": total,
            "seconds": round(seconds, 3),
            "gangs_per_s": round(total / seconds, 1),
        }
    finally:
        creation.destroy_test_db(test_db, verbosity=0)


if __name__ == "__main__":
    sys.exit(main())
