"""Scheduler speed: one plan() pass over 10,000 queued jobs and 512 nodes (goal < 1 s), beside
the first version's policy as the baseline in the same run; and gangs applied per second on the
database, sustained over consecutive passes (goal >= 200/s on PostgreSQL).

    .venv/bin/python bench/scheduler_speed.py                # plan() only (pure, no database)
    DATABASE_URL=postgres://postgres@127.0.0.1:5432/test REDIS_URL=redis://127.0.0.1:6379/0 \\
        .venv/bin/python bench/scheduler_speed.py --apply    # + apply_plan on that server
        [--apply-only] [--no-baseline] [--compare-ref HEAD~1]
    .venv/bin/python bench/scheduler_speed.py --plan-ref HEAD   # plan(): this tree vs HEAD
    .venv/bin/python bench/scheduler_speed.py --pass-estimates  # plan + start estimates per pass

The apply benchmark runs on a fresh test database (LOCKSTEP_TEST_DB_NAME names it). Each pass
queues a batch of jobs (1-16 GPUs) on an idle cluster, takes the snapshot and plans (not timed),
then times `apply_plan` on that plan: claims, attempts, allocations, events, wait reasons, the
commit and the on-commit websocket pushes. Between passes the leftovers are cancelled and the
GPUs released (not timed). Modes, interleaved pass by pass on the same workload: `batched` (the
applier as it is) and `per_gang` (chunk=1: a savepoint and a claim per gang, the structure of
the applier before batching). `--compare-ref REF` also runs this benchmark on the code at git
REF (extracted with `git archive` to a temporary directory) and stores its result beside.
`reasons` times writing 9,000 changed wait reasons: the former one-UPDATE-per-job loop, then
the bulk write, on the same rows.
"""

from __future__ import annotations

import argparse
import contextlib
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
                    expected_end=(end := NOW + timedelta(seconds=rng.randrange(60, 86400))),
                    **_frees_by(end),
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
        "times_s": [round(t, 4) for t in times],
        "median_s": round(statistics.median(times), 4),
        "max_s": round(max(times), 4),
        "placed": len(result.placements),
        "preemptions": len(result.preemptions),
        "reasons": len(result.reasons),
    }


def gangs(snapshot: Snapshot, seed: int) -> Snapshot:
    """The snapshot's nodes refilled with the target's mix: 8-64-GPU gangs of whole nodes (a
    few of 256), 480 of the 512 nodes busy; the same queue."""
    from dataclasses import replace

    rng = random.Random(seed)
    nodes, running, used, job_id, n = list(snapshot.nodes), [], {}, 5 * 10**6, 0
    busy = len(nodes) * 15 // 16
    while n < busy:
        width = min(rng.choice([1, 1, 1, 2, 2, 4, 8, 8, 32]), busy - n)
        team = rng.randrange(len(snapshot.teams)) + 1
        running.append(
            RunningView(
                id=job_id,
                team_id=team,
                gpus=8 * width,
                priority=rng.randrange(4),
                slots=tuple((nodes[i].id, g) for i in range(n, n + width) for g in range(8)),
                started_at=NOW - timedelta(hours=1),
                expected_end=(end := NOW + timedelta(seconds=rng.randrange(600, 86400))),
                **_frees_by(end),
            )
        )
        used[team] = used.get(team, 0) + 8 * width
        job_id, n = job_id + 1, n + width
    nodes = [replace(v, free=frozenset() if i < busy else v.free) for i, v in enumerate(nodes)]
    teams = tuple(replace(t, used=used.get(t.id, 0)) for t in snapshot.teams)
    return replace(snapshot, nodes=tuple(nodes), running=tuple(running), teams=teams)


def bench_pass_estimates(args) -> dict:
    """The pass's own computing, plan() and then the start estimates: worked out in the pass
    (as every pass did before jobs/scheduling/estimator.py) against the leader's Estimator
    (beside the pass once they are slow, every ESTIMATE_EVERY_S), `--passes` passes in a row,
    each ~1 s apart as a busy leader's; on the small-jobs snapshot and on the gang mix."""
    from jobs.scheduling.estimate import estimate_starts, head_of_queue
    from jobs.scheduling.estimator import Estimator
    from jobs.settings_table import DEFAULTS

    busy = build(args.nodes, args.gpus_per_node, args.queued, args.teams, 0.9, seed=1)
    shapes = {"small jobs (1-8 GPUs)": busy, "gangs (8-256 GPUs)": gangs(busy, seed=3)}
    out = {}
    for name, snap in shapes.items():
        row = {"running": len(snap.running)}
        for mode in ("in the pass", "estimator"):
            estimator = Estimator(
                inline_s=DEFAULTS["ESTIMATE_INLINE_S"], every_s=DEFAULTS["ESTIMATE_EVERY_S"]
            )
            times, estimate_times = [], []
            try:
                for _ in range(args.passes):
                    started = time.perf_counter()
                    plan(snap)
                    planned = time.perf_counter()
                    if mode == "in the pass":
                        estimate_starts(head_of_queue(snap), stop_grace_s=60, approval_delay_s=0)
                    else:
                        estimator.estimates(
                            snap, stop_grace_s=60, approval_delay_s=0, plan_s=planned - started
                        )
                    done = time.perf_counter()
                    times.append(done - started)
                    estimate_times.append(done - planned)
                    time.sleep(max(0.0, 1.0 - (done - started)))
                row[mode] = {
                    "pass_p50_s": round(statistics.median(times), 3),
                    "pass_max_s": round(max(times), 3),
                    "estimate_in_pass_p50_s": round(statistics.median(estimate_times), 3),
                }
                if mode == "estimator":
                    row[mode]["background_estimates"] = estimator.background
                    row[mode]["estimate_cost_s"] = round(estimator.cost_s or 0.0, 3)
            finally:
                estimator.close()
            print(f"{name}, {mode}: {row[mode]}")
        out[name] = row
    return {"passes": args.passes, "shapes": out}


def _frees_by(end):
    """RunningView.frees_by as the simulator sets it (the live reader adds the stop grace);
    nothing at a --plan-ref from before the field."""
    return {"frees_by": end} if "frees_by" in RunningView.__dataclass_fields__ else {}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=512)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--queued", type=int, default=10_000)
    parser.add_argument("--teams", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--apply", action="store_true", help="also measure apply_plan")
    parser.add_argument("--apply-only", action="store_true", help="measure apply_plan only")
    parser.add_argument("--apply-nodes", type=int, default=128)
    parser.add_argument("--apply-jobs", type=int, default=600, help="jobs queued per pass")
    parser.add_argument("--apply-passes", type=int, default=12)
    parser.add_argument("--reasons", type=int, default=9000, help="wait reasons to write")
    parser.add_argument(
        "--big-pass", type=int, default=10_000, help="queued jobs of the one big pass (0: none)"
    )
    parser.add_argument("--no-baseline", action="store_true", help="skip the per-gang mode")
    parser.add_argument("--compare-ref", help="also run the apply benchmark on this git ref")
    parser.add_argument("--plan-ref", help="also time plan() at this git ref, rounds alternating")
    parser.add_argument("--plan-rounds", type=int, default=4)
    parser.add_argument("--busy-only", action="store_true", help="plan() on the busy cluster only")
    parser.add_argument(
        "--pass-estimates", action="store_true", help="plan + estimates per pass: inline vs beside"
    )
    parser.add_argument("--passes", type=int, default=30)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "scheduler-speed.json"))
    args = parser.parse_args()
    results = {
        "nodes": args.nodes,
        "gpus_per_node": args.gpus_per_node,
        "queued": args.queued,
        "teams": args.teams,
        "python": sys.version.split()[0],
    }
    out = Path(args.out)
    if args.pass_estimates:
        results = {**(json.loads(out.read_text()) if out.exists() else {}), **results}
        results["pass_estimates"] = bench_pass_estimates(args)
        out.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {out}")
        return 0
    if args.plan_ref:
        # The plan figures again, beside the ref's; the apply figures stay from their own run.
        results = {**(json.loads(out.read_text()) if out.exists() else {}), **results}
        results["plan_vs_ref"] = bench_plan_ref(args)
        print(f"plan() this tree / {args.plan_ref}: {results['plan_vs_ref']['median_s']}")
    if args.apply_only:
        results = json.loads(out.read_text()) if out.exists() else results
    else:
        cases = (("cluster_90pct_busy", 0.9),) if args.busy_only else (
            ("cluster_90pct_busy", 0.9), ("cluster_empty", 0.0))  # fmt: skip
        for label, busy in cases:
            snap = build(args.nodes, args.gpus_per_node, args.queued, args.teams, busy, seed=1)
            results[label] = time_plan(snap, args.repeats)
            print(f"plan() {label}: {results[label]}")
    if args.apply or args.apply_only:
        results["apply"] = bench_apply(args)
        print(f"apply_plan: {json.dumps(results['apply'], indent=1)}")
        if args.compare_ref:
            results["apply_at_ref"] = bench_ref(args)
            print(f"apply_plan at {args.compare_ref}: {results['apply_at_ref']}")
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


def _setup_django():
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
    import django

    django.setup()


def register_nodes(count: int, *, prefix: str, per_rack: int, first: int = 0) -> None:
    """Nodes `first`..`count`-1 of 8 GPUs, registered as agents do (bench/snapshot_read.py
    too)."""
    from django.utils import timezone

    from jobs import actions

    for n in range(first, count):
        actions.do_register_node(
            name=f"{prefix}-{n:03d}",
            gpus=8,
            address=f"10.0.{n // 250}.{n % 250}",
            rack=f"rack-{n // per_rack}",
            boot_id="b",
            now=timezone.now(),
        )


def _queue_jobs(team, user, sizes: list[int], now) -> None:
    """Queued jobs as a submit leaves them (bulk: submitting is not what is measured)."""
    from jobs.models import Job

    Job.objects.bulk_create(
        [
            Job(
                name=f"b{i}",
                team=team,
                owner=user,
                image="x",
                command=["true"],
                gpus=gpus,
                submitted_at=now,
                state=Job.State.QUEUED,
                reason="queued; waiting for the scheduler's next pass",
            )
            for i, gpus in enumerate(sizes)
        ],
        batch_size=1000,
    )


def bench_apply(args) -> dict:
    """Gangs per second committed by apply_plan, sustained over consecutive passes, on the
    configured database (a fresh test database)."""
    import inspect

    _setup_django()
    from django.contrib.auth import get_user_model
    from django.db import connection
    from django.utils import timezone

    from jobs.models import Allocation, Attempt, Job
    from jobs.scheduling import apply as applier
    from jobs.scheduling.reader import take_snapshot
    from teams.actions import do_create_team

    batched = "chunk" in inspect.signature(applier.apply_plan).parameters
    modes = {"batched": {}} if batched else {"apply_plan": {}}
    if batched and not args.no_baseline:
        modes["per_gang"] = {"chunk": 1}
    queries = [0]

    def count(execute, sql, params, many, context):
        queries[0] += 1
        return execute(sql, params, many, context)

    creation = connection.creation
    test_db = creation.create_test_db(verbosity=0, autoclobber=True, keepdb=False)
    try:
        team = do_create_team("bench", quota=1_000_000)
        user = get_user_model().objects.create(username="bench")
        register_nodes(args.apply_nodes, prefix="bench", per_rack=16)
        passes = {mode: [] for mode in modes}
        for number in range(args.apply_passes):
            for mode, kwargs in modes.items():
                rng = random.Random(1000 + number)  # the same workload for every mode
                sizes = [rng.choice([1, 1, 2, 4, 8, 8, 16]) for _ in range(args.apply_jobs)]
                _queue_jobs(team, user, sizes, timezone.now())
                decided = plan(take_snapshot(timezone.now()))
                queries[0] = 0
                with connection.execute_wrapper(count):
                    started = time.perf_counter()
                    result = applier.apply_plan(decided, now=timezone.now(), **kwargs)
                    seconds = time.perf_counter() - started
                passes[mode].append(
                    {
                        "gangs": len(result.applied),
                        "rejected": len(result.rejected),
                        "reasons": len(decided.reasons),
                        "seconds": round(seconds, 4),
                        "queries": queries[0],
                    }
                )
                print(f"  pass {number} {mode}: {passes[mode][-1]}", flush=True)
                now = timezone.now()
                Job.objects.filter(state=Job.State.QUEUED).update(state=Job.State.CANCELLED)
                Job.objects.filter(state=Job.State.STARTING).update(state=Job.State.SUCCEEDED)
                Allocation.objects.filter(released_at__isnull=True).update(released_at=now)
                Attempt.objects.filter(ended_at__isnull=True).update(
                    ended_at=now, state=Attempt.State.SUCCEEDED
                )
        out = {
            "database": connection.vendor,
            "nodes": args.apply_nodes,
            "gpus_per_node": 8,
            "jobs_per_pass": args.apply_jobs,
            "passes": args.apply_passes,
        }
        for mode, rows in passes.items():
            gangs = sum(r["gangs"] for r in rows)
            seconds = sum(r["seconds"] for r in rows)
            rates = [r["gangs"] / r["seconds"] for r in rows if r["seconds"]]
            out[mode] = {
                "gangs": gangs,
                "seconds": round(seconds, 3),
                "gangs_per_s": round(gangs / seconds, 1),
                "pass_gangs_per_s_min": round(min(rates), 1),
                "pass_gangs_per_s_median": round(statistics.median(rates), 1),
                "gangs_per_pass_median": statistics.median(r["gangs"] for r in rows),
                "queries_per_pass_median": statistics.median(r["queries"] for r in rows),
                "queries_per_gang": round(sum(r["queries"] for r in rows) / max(gangs, 1), 2),
            }
        if args.big_pass:
            out["big_pass"] = big_pass(args, modes, team, user, count, queries)
        if batched and args.reasons:
            out["reasons"] = bench_reasons(args.reasons, team, user)
        return out
    finally:
        creation.destroy_test_db(test_db, verbosity=0)


def big_pass(args, modes: dict, team, user, count, queries) -> dict:
    """One pass as large as the plan() benchmark's: `--big-pass` jobs queued (its sizes, 1 to 64
    GPUs) on 512 idle nodes, planned and estimated as the loop does; then apply_plan timed,
    with its ~800 gangs and ~9,000 wait reasons. Once per mode, from the same state."""
    from django.db import connection
    from django.utils import timezone

    from jobs.models import Allocation, Attempt, Job, Node
    from jobs.scheduling import apply as applier
    from jobs.scheduling.estimate import estimate_starts
    from jobs.scheduling.loop import head_of_queue
    from jobs.scheduling.reader import take_snapshot

    register_nodes(512, prefix="bench", per_rack=16, first=Node.objects.count())
    out = {"nodes": 512, "queued": args.big_pass}
    sizes_pool = [1] * 50 + [2] * 6 + [4] * 6 + [8] * 25 + [16] * 6 + [32] * 4 + [64] * 3
    for mode, kwargs in modes.items():
        rng = random.Random(7)
        _queue_jobs(
            team, user, [rng.choice(sizes_pool) for _ in range(args.big_pass)], timezone.now()
        )
        snapshot = take_snapshot(timezone.now())
        decided = plan(snapshot)
        estimates = estimate_starts(head_of_queue(snapshot))
        queries[0] = 0
        with connection.execute_wrapper(count):
            started = time.perf_counter()
            result = applier.apply_plan(decided, now=timezone.now(), estimates=estimates, **kwargs)
            seconds = time.perf_counter() - started
        out[mode] = {
            "gangs": len(result.applied),
            "rejected": len(result.rejected),
            "reasons": len(decided.reasons),
            "seconds": round(seconds, 3),
            "gangs_per_s": round(len(result.applied) / seconds, 1),
            "queries": queries[0],
        }
        print(f"  big pass {mode}: {out[mode]}", flush=True)
        now = timezone.now()
        Job.objects.filter(state=Job.State.QUEUED).update(state=Job.State.CANCELLED)
        Job.objects.filter(state=Job.State.STARTING).update(state=Job.State.SUCCEEDED)
        Allocation.objects.filter(released_at__isnull=True).update(released_at=now)
        Attempt.objects.filter(ended_at__isnull=True).update(
            ended_at=now, state=Attempt.State.SUCCEEDED
        )
    return out


def bench_reasons(count: int, team, user) -> dict:
    """Wait reasons of `count` queued jobs, all changed: the former loop (one UPDATE per job)
    beside the bulk write, then the bulk write again with nothing changed."""
    from django.db import connection, transaction
    from django.utils import timezone

    from jobs.models import Job
    from jobs.scheduling.apply import ApplyResult, _write_reasons
    from jobs.scheduling.vocab import Plan

    _queue_jobs(team, user, [10_000] * count, timezone.now())
    ids = list(Job.objects.filter(state=Job.State.QUEUED).values_list("id", flat=True))

    def per_row(plan: Plan) -> int:  # the applier's reason writing before it was batched
        current = dict(
            Job.objects.filter(id__in=plan.reasons, state=Job.State.QUEUED).values_list(
                "id", "reason"
            )
        )
        written = 0
        for job_id, why in plan.reasons.items():
            if job_id in current and current[job_id] != why:
                written += Job.objects.filter(id=job_id, state=Job.State.QUEUED).update(
                    reason=why, estimated_start_at=None
                )
        return written

    out = {"jobs": count, "database": connection.vendor}
    for label, version, write in (
        ("per_row", "a", per_row),
        ("bulk", "b", lambda p: _write_reasons(p, ApplyResult(), {})),
        ("bulk_unchanged", "b", lambda p: _write_reasons(p, ApplyResult(), {})),
    ):
        reasons = Plan(placements=(), reasons={i: f"waits ({version}) for {i % 97}" for i in ids})
        started = time.perf_counter()
        with transaction.atomic():
            written = write(reasons)
        out[label] = {"seconds": round(time.perf_counter() - started, 3), "written": written}
        print(f"  reasons {label}: {out[label]}", flush=True)
    Job.objects.filter(id__in=ids).update(state=Job.State.CANCELLED)
    return out


@contextlib.contextmanager
def _checkout(ref: str):
    """(sha, directory) of the code at git `ref`, with this benchmark copied in, extracted to
    a temporary directory for the duration."""
    import io
    import shutil
    import subprocess
    import tarfile
    import tempfile

    sha = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", ref], capture_output=True, text=True, check=True
    ).stdout.strip()
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", sha], capture_output=True, check=True
    ).stdout
    tmp = Path(tempfile.mkdtemp(prefix="lockstep-ref-"))
    try:
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(tmp, filter="data")
        shutil.copy(Path(__file__), tmp / "bench" / "scheduler_speed.py")
        yield sha, tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def bench_plan_ref(args) -> dict:
    """plan() on the 90 %-busy snapshot, this tree against git `args.plan_ref`, in alternating
    rounds (each in a process of its own, the same seeded snapshot), so that the machine's
    noise falls on both alike."""
    import subprocess

    times: dict[str, list[float]] = {"this": [], "ref": []}
    with _checkout(args.plan_ref) as (sha, tmp):
        for _ in range(args.plan_rounds):
            for label, root in (("ref", tmp), ("this", ROOT)):
                out = tmp / f"{label}.json"
                subprocess.run(
                    [
                        sys.executable,
                        str(root / "bench" / "scheduler_speed.py"),
                        f"--nodes={args.nodes}",
                        f"--queued={args.queued}",
                        f"--teams={args.teams}",
                        f"--repeats={args.repeats}",
                        "--busy-only",
                        f"--out={out}",
                    ],
                    cwd=root,
                    check=True,
                    capture_output=True,
                )
                times[label].extend(json.loads(out.read_text())["cluster_90pct_busy"]["times_s"])
    this, ref = statistics.median(times["this"]), statistics.median(times["ref"])
    return {
        "ref": f"{args.plan_ref} ({sha[:10]})",
        "rounds": args.plan_rounds,
        "median_s": {"this": round(this, 4), "ref": round(ref, 4)},
        "ratio": round(this / ref, 3),
        "times_s": times,
    }


def bench_ref(args) -> dict:
    """This benchmark (apply part) run on the code at git `args.compare_ref`."""
    import subprocess

    with _checkout(args.compare_ref) as (sha, tmp):
        out = tmp / "ref.json"
        env = {
            **os.environ,
            "LOCKSTEP_TEST_DB_NAME": os.environ.get("LOCKSTEP_TEST_DB_NAME", "bench") + "_ref",
        }
        subprocess.run(
            [
                sys.executable,
                str(tmp / "bench" / "scheduler_speed.py"),
                "--apply-only",
                "--no-baseline",
                "--reasons=0",
                f"--apply-nodes={args.apply_nodes}",
                f"--apply-jobs={args.apply_jobs}",
                f"--apply-passes={args.apply_passes}",
                f"--big-pass={args.big_pass}",
                f"--out={out}",
            ],
            cwd=tmp,
            env=env,
            check=True,
        )
        result = json.loads(out.read_text())["apply"]
        result["ref"] = f"{args.compare_ref} ({sha[:10]})"
        return result


if __name__ == "__main__":
    sys.exit(main())
