"""The quota promise's settings against the policy's defaults (issue 17): AGED_BORROWED_FIRST=false
with QUOTA_BEFORE_DRAIN=true (a team's quota before an aged or borrowing gang's drain), on
bench/thrash.py's six generated traces (checkpoint-first) and on the msft trace at 1,280 GPUs
(plain and checkpoint-on-stop), beside the defaults on the same traces in the same run (EASY
backfill, which neither setting touches, from bench/results/thrash-protection-passes.json).

    .venv/bin/python bench/quota_promise.py            # about 20 min on 2 idle cores

Writes bench/results/quota-promise.json; docs/thrash.md ("The quota promise as an admin's
choice") summarises. The real trace is where the first version of QUOTA_BEFORE_DRAIN broke the
bound (one reclaim of 84 s, 2026-12-06): its reclaims over the 60 s bound are the check.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "bench" / "results"
KEYS = (
    "work_utilization",
    "utilization_when_fit_queued",
    "jct_mean_s",
    "starved",
    "reclaims_over_bound",
    "reclaims_over_their_bound",
    "reclaims_total",
    "reclaim_max_s",
    "preempted_gpu_hours",
    "preemptions_per_job",
)
GENERATED = [(load, seed) for load in (0.8, 1.15, 1.5) for seed in (0, 1)]
REAL = {"msft-1280": False, "msft-1280-ckpt-on-stop": True}


SIDES = {
    "defaults": {},
    "quota-promise": {"aged_borrowed_first": False, "quota_before_drain": True},
}


def one(work: tuple) -> dict:
    from jobs.scheduling.simulate import SimConfig, run

    began = time.perf_counter()
    side, *work = work
    mode = SIDES[side]
    if work[0] == "generated":
        from bench.thrash import _shape
        from jobs.scheduling.generate import generate

        _, load, seed = work
        shape = _shape(seed, load)
        config = SimConfig(gpus=1024, quotas=shape.quotas(), checkpoint_on_stop=True, **mode)
        metrics = run(generate(shape), "lockstep", config).metrics
        label = {"load": load, "seed": seed}
    else:
        from jobs.scheduling.trace import load_trace, traces_dir

        _, name = work
        trace = load_trace(str(traces_dir() / "msft_itp_2021.csv"))
        config = SimConfig(gpus=1280, checkpoint_on_stop=REAL[name], **mode)
        metrics = run(trace, "lockstep", config).metrics
        label = {"scenario": name}
    return {
        "side": side,
        **label,
        "metrics": {k: metrics.get(k) for k in KEYS},
        "wall_s": round(time.perf_counter() - began, 1),
    }


def backfill() -> dict:
    """EASY backfill's runs of the generated traces: (load, seed) -> metrics."""
    runs = json.loads((RESULTS / "thrash-protection-passes.json").read_text())["runs"]
    return {(r["load"], r["seed"]): r["metrics"] for r in runs if r["policy"] == "backfill"}


def table(document: dict) -> str:
    """docs/thrash.md's table: defaults -> the quota promise's settings (EASY backfill)."""
    easy = backfill()
    defaults = {(r["load"], r["seed"]): r["metrics"] for r in document["defaults"]["generated"]}
    lines = [
        "| load, seed | work utilization | mean JCT (s) | starved | clocks over 60 s "
        "| over their own bound | GPU-h thrown away |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in document["generated"]:
        key = (r["load"], r["seed"])
        d, m, e = defaults[key], r["metrics"], easy[key]

        def pair(key: str, fmt: str, d=d, m=m) -> str:
            return f"{fmt.format(d[key])} -> {fmt.format(m[key])}"

        lines.append(
            f"| {r['load']:.2f}, {r['seed']} "
            f"| {pair('work_utilization', '{:.3f}')} ({e['work_utilization']:.3f}) "
            f"| {pair('jct_mean_s', '{:,.0f}')} | {pair('starved', '{}')} "
            f"| {pair('reclaims_over_bound', '{:,}')} | {pair('reclaims_over_their_bound', '{}')} "
            f"| {pair('preempted_gpu_hours', '{:,.0f}')} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=2, help="runs in parallel")
    parser.add_argument("--table", action="store_true", help="only print the docs' table")
    args = parser.parse_args()
    out = RESULTS / "quota-promise.json"
    if args.table:
        print(table(json.loads(out.read_text())))
        return 0
    work = [
        (side, *w)
        for w in [("real", name) for name in REAL] + [("generated", *g) for g in GENERATED]
        for side in SIDES
    ]
    with ProcessPoolExecutor(max(1, args.jobs)) as pool:
        runs = list(pool.map(one, work))
    for r in runs:
        m = r["metrics"]
        print(
            r["side"],
            r.get("scenario") or f"{r['load']},{r['seed']}",
            {k: m[k] for k in ("work_utilization", "reclaims_over_bound", "reclaim_max_s")},
            flush=True,
        )

    def of(side: str) -> dict:
        mine = [r for r in runs if r["side"] == side]
        return {
            "generated": [r for r in mine if "load" in r],
            "real": [r for r in mine if "scenario" in r],
        }

    document = {
        "settings": {"AGED_BORROWED_FIRST": False, "QUOTA_BEFORE_DRAIN": True},
        **of("quota-promise"),
        "defaults": of("defaults"),
    }
    out.write_text(json.dumps(document, indent=1) + "\n")
    print(table(document))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
