"""Start-estimate benchmark (issue 17, item 6): how far the start time a queued job is shown
can be trusted. The `lockstep` policy runs with SimConfig.track_promises on generated traces in
the target's shape and on slices of the real traces; each job that waited was promised the
live scheduler's estimate at submit and again an hour on (jobs.scheduling.promises), and the
error is its actual first start minus the promise.

    .venv/bin/python bench/estimates.py                 # every scenario (about 7 min, 2 cores)
    .venv/bin/python bench/estimates.py --only gen-0.9-s0 --jobs 1
    .venv/bin/python bench/estimates.py --figure        # redraw from the JSON (matplotlib)

Writes bench/results/estimates.json (per scenario and per group: count, median and p90 |error|,
bias and coverage by size class, at submit and after 1 h; the cost of tracking), the figure
docs/figures/estimates.png, and jobs/reports/estimate_bands.json: the p90 |error| at submit
per size class pooled over every scenario, the band the portal shows until a cluster has a
history of its own. docs/simulator.md ("Start estimates: how far to trust them") sums it up.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from jobs.scheduling.trace import SIZE_CLASSES, size_class, traces_dir  # noqa: E402

TRACES = traces_dir()
RESULTS = ROOT / "bench" / "results"
FIGURES = ROOT / "docs" / "figures"
BANDS = ROOT / "jobs" / "reports" / "estimate_bands.json"
MOMENTS = ("at_submit", "after_1h")

# The target's shape, scaled to fit the bench: 256 GPUs in nodes of 8, eight equal teams,
# generate.py's size mix (8-64-GPU gangs, a few quarter- and half-cluster jobs), 10 % high and
# 20 % low priority, log-normal durations around 2 h.
GEN_GPUS, GEN_TEAMS, GEN_JOBS = 256, 8, 600
LOADS = (0.9, 1.15, 1.4)
SEEDS = (0, 1)

# name -> (group, source, options). Real traces: msft's `cluster03` (139 GPUs offered on
# average; its first 800 jobs) on 128 GPUs, and the Alibaba trace (peak 70 GPUs) on 64 GPUs as
# in bench/traces.py, where few jobs wait, and its first 2,500 jobs with arrivals compressed 3x.
SCENARIOS: dict[str, tuple[str, str, dict]] = {
    **{
        f"gen-{load}-s{seed}": (
            f"generated, load {load}",
            "generated",
            {"load": load, "seed": seed},
        )
        for load in LOADS
        for seed in SEEDS
    },
    "msft-cluster03-128": (
        "msft cluster03, 128 GPUs",
        "msft_itp_2021.csv",
        {"gpus": 128, "team": "cluster03", "limit": 800},
    ),
    "alibaba-64": ("alibaba, 64 GPUs", "alibaba_openb_2023.csv", {"gpus": 64}),
    "alibaba-64-load3": (
        "alibaba 2,500, 64 GPUs, load x3",
        "alibaba_openb_2023.csv",
        {"gpus": 64, "load_scale": 3.0, "limit": 2500},
    ),
}


def trace_and_config(name: str):
    from jobs.scheduling.generate import TraceShape, generate
    from jobs.scheduling.simulate import SimConfig
    from jobs.scheduling.trace import load_trace

    _, source, options = SCENARIOS[name]
    options = dict(options)
    if source == "generated":
        shape = TraceShape(gpus=GEN_GPUS, teams=GEN_TEAMS, jobs=GEN_JOBS, **options)
        return generate(shape), SimConfig(gpus=GEN_GPUS, quotas=shape.quotas())
    gpus = options.pop("gpus")
    return load_trace(str(TRACES / source), **options), SimConfig(gpus=gpus)


def run_scenario(name: str) -> dict:
    """One scenario, untracked (the reference run) and tracked; per job errors for pooling."""
    from dataclasses import replace

    from jobs.scheduling.simulate import run

    trace, config = trace_and_config(name)
    plain = run(trace, "lockstep", config).metrics
    began = time.perf_counter()
    result = run(trace, "lockstep", replace(config, track_promises=True))
    m = result.metrics
    keys = ("jobs", "utilization", "wait_mean_s", "jct_mean_s", "queue_max_jobs", "wall_s")
    return {
        "scenario": name,
        "group": SCENARIOS[name][0],
        "gpus": config.gpus,
        "wall_s": round(time.perf_counter() - began, 1),
        "estimates": m["estimates"],
        "metrics": {k: m[k] for k in keys},
        # What tracking costs, and whether its extra passes (at submit + 1 h) moved the schedule.
        "untracked": {k: plain[k] for k in keys},
        # (GPUs, error at submit, error after 1 h): None where there was no promise or start.
        "errors": [
            (
                gpus,
                None if at is None or start is None else start - at,
                None if later is None or start is None else start - later,
            )
            for _, gpus, at, later, start in result.promises
        ],
    }


def pooled(runs: list[dict]) -> dict:
    """Error statistics over several runs' jobs, per moment and size class."""
    from jobs.scheduling.promises import error_stats

    out = {}
    for k, moment in enumerate(MOMENTS):
        by_class: dict[str, list[float]] = {c: [] for c in SIZE_CLASSES}
        waited = dict.fromkeys(SIZE_CLASSES, 0)
        for r in runs:
            for c in SIZE_CLASSES:
                waited[c] += r["estimates"][moment]["by_size"][c]["waited"]
            for gpus, *errors in r["errors"]:
                if errors[k] is not None:
                    by_class[size_class(gpus)].append(errors[k])
        every = [e for c in SIZE_CLASSES for e in by_class[c]]
        out[moment] = {
            **error_stats(every, sum(waited.values())),
            "by_size": {c: error_stats(by_class[c], waited[c]) for c in SIZE_CLASSES},
        }
    return out


def figure(groups: dict[str, dict]) -> Path:
    """Per scenario group: median and p90 |error| (hours) by size class, at submit and 1 h on."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = (
        ("at_submit", "median_abs_s", "median, at submit", "#93c5fd"),
        ("at_submit", "p90_abs_s", "p90, at submit", "#2563eb"),
        ("after_1h", "median_abs_s", "median, 1 h on", "#fcd34d"),
        ("after_1h", "p90_abs_s", "p90, 1 h on", "#d97706"),
    )
    fig, axes = plt.subplots(1, len(groups), figsize=(3.6 * len(groups), 4.2), squeeze=False)
    width = 0.2
    for col, (group, stats) in enumerate(groups.items()):
        ax = axes[0][col]
        for k, (moment, key, label, color) in enumerate(bars):
            values = [stats[moment]["by_size"][c][key] for c in SIZE_CLASSES]
            ax.bar(
                [i + (k - 1.5) * width for i in range(len(SIZE_CLASSES))],
                [0 if v is None else v / 3600 for v in values],
                width,
                label=label,
                color=color,
            )
        counts = [stats["at_submit"]["by_size"][c]["count"] for c in SIZE_CLASSES]
        ax.set_xticks(
            range(len(SIZE_CLASSES)),
            [f"{c} GPUs\nn={n}" for c, n in zip(SIZE_CLASSES, counts, strict=True)],
            fontsize=8,
        )
        ax.set_title(group, fontsize=9)
        if col == 0:
            ax.set_ylabel("|start - promised start| (h)")
            ax.legend(fontsize=7)
    fig.suptitle("Start estimates: error by job size (lockstep policy)", fontsize=10)
    fig.tight_layout()
    FIGURES.mkdir(parents=True, exist_ok=True)
    path = FIGURES / "estimates.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _span(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds / 3600:.1f} h" if abs(seconds) >= 3600 else f"{round(seconds / 60)} min"


def tables(document: dict) -> str:
    """The error table (per group and pooled, by size class) and the cost table, as
    docs/simulator.md shows them."""
    lines = [
        "| scenarios | size | at submit: n | median | p90 | bias "
        "| 1 h on: n | median | p90 | bias |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = [(g, stats) for g, stats in document["groups"].items()]
    rows.append(("**all pooled**", document["pooled"]))
    for group, stats in rows:
        for size in ("all", *SIZE_CLASSES):
            cells = []
            for moment in MOMENTS:
                s = stats[moment] if size == "all" else stats[moment]["by_size"][size]
                cells.append((s["count"], s["median_abs_s"], s["p90_abs_s"], s["bias_s"]))
            if size != "all" and cells[0][0] == 0 and cells[1][0] == 0:
                continue
            row = [group, size]
            for n, median, p90, bias in cells:
                row += [str(n), _span(median), _span(p90), _span(bias)]
            lines.append("| " + " | ".join(row) + " |")
    lines += [
        "",
        "| scenario | jobs | placed at once | waited | coverage submit / 1h | estimates "
        "| estimate s | wall s | JCT tracked / untracked | wait mean |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in document["scenarios"].items():
        e, m, u = r["estimates"], r["metrics"], r["untracked"]
        at, later = e["at_submit"], e["after_1h"]
        lines.append(
            f"| {name} | {m['jobs']} | {e['placed_at_once']} | {at['waited']} "
            f"| {at['coverage'] or 0:.0%} / {later['coverage'] or 0:.0%} | {e['estimate_calls']} "
            f"| {e['estimate_time_s']:.0f} (mean {e['estimate_mean_ms']:.0f} ms) | {r['wall_s']} "
            f"| {m['jct_mean_s']:,.0f} / {u['jct_mean_s']:,.0f} "
            f"| {m['wait_mean_s']:,.0f} / {u['wait_mean_s']:,.0f} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma list of scenarios: " + ", ".join(SCENARIOS))
    parser.add_argument("--jobs", type=int, default=2, help="scenarios run in parallel")
    parser.add_argument(
        "--figure", action="store_true", help="only redraw the figure from the results JSON"
    )
    parser.add_argument(
        "--table", action="store_true", help="only print docs/simulator.md's tables from it"
    )
    args = parser.parse_args()
    if args.figure:
        print(figure(json.loads((RESULTS / "estimates.json").read_text())["groups"]))
        return 0
    if args.table:
        print(tables(json.loads((RESULTS / "estimates.json").read_text())))
        return 0
    names = [n.strip() for n in (args.only or ",".join(SCENARIOS)).split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        print(f"estimates: unknown scenario(s) {', '.join(unknown)}", file=sys.stderr)
        return 2
    began = time.perf_counter()
    runs: dict[str, dict] = {}
    # The most expensive first, so the two workers finish together.
    order = sorted(names, key=lambda n: -SCENARIOS[n][2].get("load", 0))
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for result in pool.map(run_scenario, order):
            runs[result["scenario"]] = result
            at = result["estimates"]["at_submit"]
            print(
                f"{result['scenario']}: {result['wall_s']} s, at submit n={at['count']} "
                f"median {at['median_abs_s']} p90 {at['p90_abs_s']} s",
                flush=True,
            )
    runs = {n: runs[n] for n in SCENARIOS if n in runs}
    groups: dict[str, list[dict]] = {}
    for r in runs.values():
        groups.setdefault(r["group"], []).append(r)
    group_stats = {g: pooled(rs) for g, rs in groups.items()}
    every = pooled(list(runs.values()))
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    today = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    document = {
        "commit": commit,
        "date": today,
        "wall_s": round(time.perf_counter() - began, 1),
        "pooled": every,
        "groups": group_stats,
        "scenarios": {n: {k: v for k, v in r.items() if k != "errors"} for n, r in runs.items()},
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "estimates.json"
    out.write_text(json.dumps(document, indent=1) + "\n")
    bands = {
        "source": f"bench/estimates.py, {today}, commit {commit}",
        "by_size": {c: every["at_submit"]["by_size"][c]["p90_abs_s"] for c in SIZE_CLASSES},
    }
    BANDS.parent.mkdir(parents=True, exist_ok=True)
    BANDS.write_text(json.dumps(bands, indent=1) + "\n")
    print(f"wrote {out}, {BANDS} and {figure(group_stats)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
