"""Preemption thrash benchmark (issue 17): generated traces in the target's shape (1,024 GPUs in
nodes of 8, eight teams with equal shares, 3,000 jobs of mostly 8-64-GPU gangs with a few of a
quarter and half of the cluster, 10 % high and 20 % low priority, log-normal durations around
2 h, Poisson arrivals) at 80 %, 115 % and 150 % load, replayed through `lockstep` and EASY
`backfill` side by side, and through the policy as it was before issue 17 (`before`, the code of
BEFORE_COMMIT extracted from git) as the baseline it must beat.

    .venv/bin/python bench/thrash.py                # 2 seeds x 3 loads (about 20 min, 2 cores)
    .venv/bin/python bench/thrash.py --seeds 1 --loads 1.15
    .venv/bin/python bench/thrash.py --policies lockstep-save --out thrash-save.json

Writes bench/results/thrash.json and docs/figures/thrash.png; docs/thrash.md summarises.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "bench" / "results"
FIGURES = ROOT / "docs" / "figures"
BEFORE_COMMIT = "d45316b"  # the last commit before issue 17's policy changes
BEFORE_DIR = ROOT / "var" / "bench" / "thrash-before"
# lockstep again with checkpoint-first stops, as the live platform preempts (the reference
# trainer saves when told to stop): what a preemption costs then is its grace and restart.
SAVING = "lockstep-save"
KEYS = (
    "utilization",
    "work_utilization",
    "makespan_s",
    "idle_gpu_hours_while_fit_queued",
    "idle_gpu_hours_while_fit_queued_by_reason",
    "preempted_gpu_hours_by_kind",
    "utilization_when_fit_queued",
    "jct_mean_s",
    "wait_mean_s",
    "starved",
    "reclaims_over_bound",
    "reclaims_over_their_bound",
    "reclaims_gang_bounded",
    "reclaims_total",
    "reclaim_max_s",
    "preempted_gpu_hours",
    "safety_stops",
    "preemptions_per_job",
)


def _extract_before() -> Path:
    """The policy's code at BEFORE_COMMIT, importable on its own (the scheduling package is
    pure: no Django)."""
    if not (BEFORE_DIR / "jobs").exists():
        BEFORE_DIR.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(
            ["git", "archive", BEFORE_COMMIT, "jobs"], cwd=ROOT, capture_output=True, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(BEFORE_DIR)], input=archive, check=True)
    return BEFORE_DIR


def _shape(seed: int, load: float):
    from jobs.scheduling.generate import TraceShape

    return TraceShape(gpus=1024, teams=8, jobs=3000, load=load, seed=seed)


def run_one(args: tuple[str, int, float]) -> dict:
    policy, seed, load = args
    from jobs.scheduling.generate import generate, to_csv

    shape = _shape(seed, load)
    if policy == SAVING:
        return _simulate("lockstep", seed, load, generate(shape), shape.quotas(), save=True)
    if policy != "before":
        return _simulate(policy, seed, load, generate(shape), shape.quotas())
    # The old policy in a fresh interpreter, the old jobs package first on its path (two
    # versions of jobs.scheduling cannot share one process), on the same trace as CSV.
    old = _extract_before()
    trace_csv = old / f"trace-{seed}-{load}.csv"
    trace_csv.write_text(to_csv(generate(shape)))
    quotas = {name: [q.quota, q.borrow_limit, q.weight] for name, q in shape.quotas().items()}
    code = (
        "import json, sys\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from bench.thrash import _simulate\n"
        f"sys.path.insert(0, {str(old)!r})\n"
        "import jobs.scheduling.policy as policy\n"
        f"assert policy.__file__.startswith({str(old)!r}), policy.__file__\n"
        "from jobs.scheduling.trace import TeamQuota, load_trace\n"
        f"quotas = {{k: TeamQuota(*v) for k, v in {quotas!r}.items()}}\n"
        f"trace = load_trace({str(trace_csv)!r})\n"
        f"print(json.dumps(_simulate('lockstep', {seed}, {load}, trace, quotas)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["policy"] = "before"
    return result


def _simulate(
    policy: str, seed: int, load: float, trace, quotas, save: bool = False, aged_first=True
) -> dict:
    from jobs.scheduling.simulate import SimConfig, SimulationError, run

    began = time.perf_counter()
    label = SAVING if save else policy
    config = SimConfig(gpus=1024, quotas=quotas)
    if save:  # only this run: the old simulator in "before" has no such field
        config = SimConfig(gpus=1024, quotas=quotas, checkpoint_on_stop=True)
    if not aged_first:  # bench/aging_trial.py
        config = SimConfig(
            gpus=1024, quotas=quotas, checkpoint_on_stop=save, aged_borrowed_first=False
        )
    try:
        result = run(trace, policy, config)
    except SimulationError as exc:  # the preemption loop the issue found
        return {"policy": label, "seed": seed, "load": load, "loop": str(exc)}
    metrics = {k: result.metrics.get(k) for k in KEYS}
    counts = sorted(r[5] for r in result.records)
    if metrics["preemptions_per_job"] is None:  # the old simulator did not report it
        metrics["preemptions_per_job"] = {"max": counts[-1] if counts else 0}
    return {
        "policy": label,
        "seed": seed,
        "load": load,
        "metrics": metrics,
        "preemption_counts": counts,
        "wall_s": round(time.perf_counter() - began, 1),
    }


def figure(runs: list[dict]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = sorted({r["load"] for r in runs})
    colors = {
        "before": "#dc2626",
        "backfill": "#f59e0b",
        "lockstep": "#2563eb",
        SAVING: "#16a34a",
    }
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    for r in runs:
        if r["policy"] == "lockstep" and r.get("preemption_counts"):
            counts = r["preemption_counts"]
            ax.plot(
                sorted(counts, reverse=True)[:300],
                label=f"load {r['load']:.2f} seed {r['seed']}",
                linewidth=1,
            )
    ax.set_title("lockstep: preemptions per job (300 most preempted)", fontsize=10)
    ax.set_xlabel("jobs, most preempted first")
    ax.legend(fontsize=7)
    for col, (key, title) in enumerate(
        (
            ("work_utilization", "work utilization (the trace's work / GPU time)"),
            ("jct_mean_s", "mean JCT (h)"),
        ),
        start=1,
    ):
        ax = axes[col]
        width = 0.2
        for k, policy in enumerate(("before", "backfill", "lockstep", SAVING)):
            values = []
            for load in loads:
                done = [
                    r["metrics"].get(key) or 0.0
                    for r in runs
                    if r["policy"] == policy and r["load"] == load and "metrics" in r
                ]
                mean = sum(done) / len(done) if done else 0.0
                values.append(mean / 3600 if key == "jct_mean_s" else mean)
            ax.bar(
                [i + (k - 1.5) * width for i in range(len(loads))],
                values,
                width,
                color=colors[policy],
                label=policy + (" (0 = preemption loop)" if policy == "before" else ""),
            )
        ax.set_xticks(range(len(loads)), [f"load {x:.2f}" for x in loads])
        ax.set_title(title + ", mean over seeds", fontsize=10)
        ax.legend(fontsize=7)
    fig.tight_layout()
    FIGURES.mkdir(parents=True, exist_ok=True)
    path = FIGURES / "thrash.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def table(runs: list[dict]) -> str:
    """The markdown table docs/thrash.md shows: per load and seed, lockstep (no save at
    stop), lockstep with checkpoint-first stops (save) and EASY backfill."""
    by = {(r["policy"], r["load"], r["seed"]): r for r in runs}
    rows = [
        "| load, seed | `before` | work utilization L / save / B | utilization while a job "
        "fits L / save / B | mean JCT (s) L / save / B | starved L / save / B | reclaims over "
        "60 s, save (of) / B | preemptions of one job (save): max, most in a day | GPU-h thrown "
        "away L / save |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for load, seed in sorted({(r["load"], r["seed"]) for r in runs}):
        old = by.get(("before", load, seed), {})
        before = f"loop ({old['loop'].split()[1]})" if "loop" in old else "ran"
        m = {p: by[(p, load, seed)].get("metrics") for p in ("lockstep", SAVING, "backfill")}
        if not all(m.values()):
            continue
        lk, sv, bf = m["lockstep"], m[SAVING], m["backfill"]

        def three(key, fmt="{:.3f}", a=lk, b=sv, c=bf):
            return " / ".join(fmt.format(x.get(key) or 0) for x in (a, b, c))

        per = sv["preemptions_per_job"]
        rows.append(
            f"| {load:.2f}, {seed} | {before} | {three('work_utilization')} | "
            f"{three('utilization_when_fit_queued')} | {three('jct_mean_s', '{:,.0f}')} | "
            f"{three('starved', '{}')} | {sv['reclaims_over_bound']} ({sv['reclaims_total']}) / "
            f"{bf['reclaims_over_bound']} | {per['max']}, {per['max_in_a_day']} | "
            f"{lk['preempted_gpu_hours']:,.0f} / {sv['preempted_gpu_hours']:,.0f} |"
        )
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--loads", default="0.8,1.15,1.5")
    parser.add_argument("--jobs", type=int, default=2, help="runs in parallel")
    parser.add_argument(
        "--table", action="store_true", help="print the docs' table of the last results only"
    )
    parser.add_argument(
        "--policies",
        default=f"lockstep,{SAVING},before,backfill",
        help="a subset to rerun (the table and figure need all four)",
    )
    parser.add_argument("--out", default="thrash.json", help="file name under bench/results")
    args = parser.parse_args()
    if args.table:
        print(table(json.loads((RESULTS / "thrash.json").read_text())["runs"]))
        return 0
    loads = [float(x) for x in args.loads.split(",")]
    work = [
        (policy, seed, load)
        for load in loads
        for seed in range(args.seeds)
        for policy in args.policies.split(",")
    ]
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    runs = []
    with ProcessPoolExecutor(args.jobs) as pool:
        for result in pool.map(run_one, work):
            print(
                json.dumps({k: v for k, v in result.items() if k != "preemption_counts"}),
                flush=True,
            )
            runs.append(result)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / args.out
    out.write_text(
        json.dumps({"commit": commit, "before": BEFORE_COMMIT, "runs": runs}, indent=1) + "\n"
    )
    if {r["policy"] for r in runs} >= {"lockstep", SAVING, "before", "backfill"}:
        print(f"wrote {out} and {figure(runs)}")
        print(table(runs))
    else:
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
