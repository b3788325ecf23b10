"""Where lockstep's utilization goes against EASY backfill (issue 17), by ablation.

The property test (tests/test_thrash_properties.py) runs 150-job traces at 128 GPUs: there the
last few jobs decide a trace's makespan, so work utilization moves by up to 10 points from one
seed to the next and whether lockstep comes out above or below EASY backfill on one trace is
mostly which job happened to finish last. This benchmark runs the same shape with 1,200 jobs
per trace (about 400 simulated hours each), where the tail weighs an eighth as much, and
switches off one part of the policy at a time to see what each costs and buys:

- `policy`: lockstep as shipped, checkpoint-first stops (the live platform's rule 6).
- `free-stops`: a stop costs nothing (no grace, no restart): what preemptions cost.
- `no-stops`: the policy never stops a running job (no reclaims, priority preemptions,
  starvation claims or fillers): what the guarantees that stops keep are worth, and cost.
- `no-quotas`: every team may borrow the whole cluster and has no quota: no reclaims, no
  guaranteed-before-borrowed order.
- `one-priority`: every job at the normal priority: no priority order or preemption.
- `submit-order`: the queue in priority, then submit order (no fair share, no
  guaranteed-first, no aging): EASY's order with the rest of the policy.
- `no-starvation-rules`: no reservations for starving jobs beside the head's and no
  starvation claims.
- `aging-cap-12h`: a borrowed job ages (goes first among guaranteed work) after at most 12 h.
- `short-borrowed-first`: borrowed work that has not aged goes shortest runtime estimate first
  (before fair share): GPUs lent to short jobs come back by themselves more often.
- `reclaim-backoff-1h`: a team whose GPUs were reclaimed may not borrow for 1 h (300 s).
- `no-reclaim-backoff`: a team whose GPUs were reclaimed may borrow again at once.
- `wait-for-ending`: the setting WAIT_FOR_ENDING_JOBS (off by default): a claim waits for
  jobs ending within the stop's grace anyway (time limits, here exact estimates) instead of
  stopping one.
- `restart-60s`, `restart-30s`, `restart-10s`: each stop's restart charged 60, 30 or 10 s
  instead of 120 s (the grace stays 60 s): how the gap moves with what a restart costs.
- `no-grace`: a stop's victim is gone at once (restart still 120 s): what the grace costs.
- `quota-promise`: the settings AGED_BORROWED_FIRST=false and QUOTA_BEFORE_DRAIN=true (aged
  borrowed work after guaranteed work; a job within its quota may start on a borrowing head's
  draining nodes).

Each variant patches one module constant or function in its own worker process (the
simulator and policy are pure; nothing is shared). EASY backfill runs once per trace.

    .venv/bin/python bench/utilization_gap.py             # 24 seeds, 5-13 min on 2 cores
    .venv/bin/python bench/utilization_gap.py --seeds 6 --variants policy,free-stops

Writes bench/results/utilization-gap.json and docs/figures/utilization-gap.png;
docs/thrash.md ("Where the utilization goes, by ablation") summarises.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "bench" / "results"
FIGURES = ROOT / "docs" / "figures"
LOADS = (0.8, 1.0, 1.15, 1.3, 1.5)  # the property test's loads, by seed
VARIANTS = (
    "policy",
    "free-stops",
    "no-stops",
    "no-quotas",
    "one-priority",
    "submit-order",
    "no-starvation-rules",
    "aging-cap-12h",
    "short-borrowed-first",
    "reclaim-backoff-1h",
    "no-reclaim-backoff",
    "quota-promise",
    "wait-for-ending",
    "restart-60s",
    "restart-30s",
    "restart-10s",
    "no-grace",
)
KEYS = (
    "work_utilization",
    "makespan_s",
    "busy_gpu_hours",
    "idle_gpu_hours_while_fit_queued",
    "preempted_gpu_hours",
    "jct_mean_s",
    "starved",
    "reclaims_over_bound",
)


def _shape(seed: int, jobs: int):
    from jobs.scheduling.generate import TraceShape

    return TraceShape(
        gpus=128,
        teams=4,
        jobs=jobs,
        load=LOADS[seed % len(LOADS)],
        seed=seed,
        duration_median_s=3600,
    )


def _ablate(variant: str):
    """Patch this process's policy for `variant`; returns a function that adjusts one
    (trace, config) pair."""
    from jobs.scheduling import order, policy, reservations, victims
    from jobs.scheduling.trace import TeamQuota

    def same(trace, config):
        return trace, config

    if variant == "policy":
        return same
    if variant == "free-stops":
        return lambda trace, config: (trace, replace(config, restart_s=0.0, grace_s=0.0))
    if variant == "no-stops":
        victims.Victims.claim = lambda self, *args, **kwargs: None
        victims.Victims.starvation = lambda self, *args, **kwargs: None
        reservations.Reservations.fill = lambda self, *args, **kwargs: None
        return same
    if variant == "no-quotas":
        return lambda trace, config: (
            trace,
            replace(
                config,
                quotas={
                    name: TeamQuota(quota=0, borrow_limit=config.gpus) for name in config.quotas
                },
            ),
        )
    if variant == "one-priority":
        return lambda trace, config: ([replace(j, priority=1) for j in trace], config)
    if variant == "submit-order":
        policy.job_order_key = lambda job, teams=None, now=None, aged_first=True: (
            -job.priority,
            job.submitted_at,
            job.id,
        )
        return same
    if variant == "no-starvation-rules":
        reservations.MAX_STARVING_HOLDS = 0
        policy.STARVING_CLAIM_STRETCH = float("inf")
        return same
    if variant == "aging-cap-12h":
        aged = order.aged

        def capped(job, now):
            if now is not None and (now - job.submitted_at).total_seconds() > 12 * 3600:
                return True
            return aged(job, now)

        order.aged = capped
        return same
    if variant == "short-borrowed-first":
        base = order.job_order_key

        def shortest_borrowed(job, teams=None, now=None, aged_first=True):
            key = base(job, teams, now, aged_first)
            if key[1] == 1:  # borrowed and not aged
                return (key[0], 1, job.runtime_estimate_s or float("inf"), *key[2:])
            return key

        policy.job_order_key = shortest_borrowed
        return same
    if variant == "reclaim-backoff-1h":
        return lambda trace, config: (trace, replace(config, reclaim_backoff_s=3600.0))
    if variant == "no-reclaim-backoff":
        return lambda trace, config: (trace, replace(config, reclaim_backoff_s=0.0))
    if variant == "quota-promise":  # the settings AGED_BORROWED_FIRST=false, QUOTA_BEFORE_DRAIN
        return lambda trace, config: (
            trace,
            replace(config, aged_borrowed_first=False, quota_before_drain=True),
        )
    if variant.startswith("restart-") and variant.endswith("s"):
        restart_s = float(variant.removeprefix("restart-").removesuffix("s"))
        return lambda trace, config: (trace, replace(config, restart_s=restart_s))
    if variant == "no-grace":
        return lambda trace, config: (trace, replace(config, grace_s=0.0))
    if variant == "wait-for-ending":  # the setting WAIT_FOR_ENDING_JOBS
        return lambda trace, config: (trace, replace(config, wait_for_ending=True))
    raise ValueError(f"unknown variant {variant!r}")


def _run_variant(variant: str, seeds: list[int], jobs: int) -> dict:
    """One variant on every seed (lockstep, checkpoint-first), or EASY backfill ("easy")."""
    from jobs.scheduling.generate import generate
    from jobs.scheduling.simulate import SimConfig, run
    from jobs.scheduling.trace import DEFAULT_PRIORITY

    adjust = None if variant == "easy" else _ablate(variant)
    t0 = time.perf_counter()
    per_seed = {}
    for seed in seeds:
        shape = _shape(seed, jobs)
        trace = generate(shape)
        # The trace's own high-priority jobs (one-priority flattens the copy it runs).
        high = {j.job_id for j in trace if j.priority > DEFAULT_PRIORITY}
        config = SimConfig(gpus=shape.gpus, quotas=shape.quotas())
        if adjust is None:
            result = run(trace, "backfill", config)
        else:
            trace, config = adjust(trace, replace(config, checkpoint_on_stop=True))
            result = run(trace, "lockstep", config)
        metrics = result.metrics
        work = sum(j.gpus * j.duration_s for j in trace) / 3600.0
        row = {k: metrics[k] for k in KEYS}
        row["redone_gpu_hours"] = round(metrics["busy_gpu_hours"] - work, 1)
        high_waits = [r[3] - r[1] for r in result.records if r[0] in high and r[3] is not None]
        row["high_priority_wait_mean_s"] = round(statistics.fmean(high_waits or [0.0]), 1)
        per_seed[seed] = row
    return {"variant": variant, "jobs": jobs, "wall_s": time.perf_counter() - t0, "seeds": per_seed}


def _mean_of(variant_run: dict, key: str) -> float:
    return round(statistics.fmean(r[key] for r in variant_run["seeds"].values()), 1)


def summarise(variant_run: dict, easy_run: dict) -> dict:
    """Per-seed gaps to EASY backfill on the same traces: work utilization in points (+ is
    better than EASY), mean JCT as a ratio (below 1 is better)."""
    gaps, ratios, starved_worse = [], [], 0
    for seed, row in variant_run["seeds"].items():
        easy = easy_run["seeds"][seed]
        gaps.append(100.0 * (row["work_utilization"] - easy["work_utilization"]))
        ratios.append(row["jct_mean_s"] / easy["jct_mean_s"])
        starved_worse += row["starved"] > easy["starved"]
    return {
        "variant": variant_run["variant"],
        "jobs": variant_run["jobs"],
        "seeds": len(gaps),
        "below_easy": sum(g < 0 for g in gaps),
        "gap_points_mean": round(statistics.fmean(gaps), 2),
        "gap_points_min": round(min(gaps), 2),
        "gap_points_max": round(max(gaps), 2),
        "jct_ratio_mean": round(statistics.fmean(ratios), 3),
        "jct_ratio_max": round(max(ratios), 3),
        "jct_worse": sum(r > 1 for r in ratios),
        "starved_worse": starved_worse,
        "redone_gpu_hours_mean": _mean_of(variant_run, "redone_gpu_hours"),
        "reclaims_over_bound_mean": _mean_of(variant_run, "reclaims_over_bound"),
        "starved_mean": _mean_of(variant_run, "starved"),
        "high_priority_wait_mean_s": _mean_of(variant_run, "high_priority_wait_mean_s"),
        "easy_high_priority_wait_mean_s": _mean_of(easy_run, "high_priority_wait_mean_s"),
        "easy_starved_mean": _mean_of(easy_run, "starved"),
        "gaps": [round(g, 2) for g in gaps],
    }


def plot(summaries: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5), sharey=True)
    labels = [f"{s['variant']}\n({s['jobs']} jobs)" for s in summaries]
    ys = range(len(summaries))
    for y, s in zip(ys, summaries, strict=True):
        left.scatter(s["gaps"], [y] * len(s["gaps"]), s=14, alpha=0.6, color="tab:blue")
        left.scatter([s["gap_points_mean"]], [y], marker="|", s=300, color="black")
        right.barh(y, s["jct_ratio_mean"], color="tab:green", alpha=0.7)
    left.axvline(0, color="grey", lw=1)
    left.set_yticks(list(ys), labels, fontsize=8)
    left.invert_yaxis()
    left.set_xlabel("work utilization minus EASY backfill's, points (dots: seeds; bar: mean)")
    right.axvline(1, color="grey", lw=1)
    right.set_xlabel("mean JCT / EASY backfill's (mean over seeds)")
    fig.suptitle("lockstep against EASY backfill on the same traces, by ablation")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=24)
    parser.add_argument("--jobs", type=int, default=1200, help="jobs per trace (default 1200)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "utilization-gap.json")
    parser.add_argument("--figure", type=Path, default=FIGURES / "utilization-gap.png")
    args = parser.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    seeds = list(range(args.seeds))
    # The policy at the property test's 150 jobs too, to show the short traces' spread.
    tasks = list(
        dict.fromkeys([("easy", 150), ("policy", 150), ("easy", args.jobs)])
        | dict.fromkeys((v, args.jobs) for v in variants)
    )
    t0 = time.perf_counter()
    # One task per process: a variant's patches must not reach the next task.
    with ProcessPoolExecutor(max_workers=args.workers, max_tasks_per_child=1) as pool:
        futures = {task: pool.submit(_run_variant, task[0], seeds, task[1]) for task in tasks}
        runs = {task: future.result() for task, future in futures.items()}
    summaries = [
        summarise(runs[(v, jobs)], runs[("easy", jobs)]) for v, jobs in tasks if v != "easy"
    ]
    for s in summaries:
        print(
            f"{s['variant']:>20} {s['jobs']:>5} jobs: below EASY on {s['below_easy']:>2}/"
            f"{s['seeds']}, gap {s['gap_points_mean']:+.2f} points "
            f"[{s['gap_points_min']:+.2f}, {s['gap_points_max']:+.2f}]; mean JCT x"
            f"{s['jct_ratio_mean']:.3f} (worst x{s['jct_ratio_max']:.3f}); starved worse on "
            f"{s['starved_worse']}; redone {s['redone_gpu_hours_mean']:.0f} GPU-h; reclaims "
            f"over 60 s {s['reclaims_over_bound_mean']:.0f}; starved {s['starved_mean']:.0f} "
            f"({s['easy_starved_mean']:.0f}); high-priority wait "
            f"{s['high_priority_wait_mean_s']:.0f} s ({s['easy_high_priority_wait_mean_s']:.0f})"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "shape": "128 GPUs in nodes of 8, 4 equal teams, loads 0.8-1.5 by seed, "
                "log-normal durations around 1 h (the property test's)",
                "wall_s": round(time.perf_counter() - t0, 1),
                "summaries": summaries,
                "runs": {f"{v}-{jobs}": runs[(v, jobs)] for v, jobs in tasks},
            },
            indent=1,
        )
    )
    plot(summaries, args.figure)
    print(f"wrote {args.out} and {args.figure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
