"""Ablation of rule 1's aging against the reclaim bound (issue 17): an aged borrowed job ordered
*after* the guaranteed work of its priority (still before other borrowed work) instead of among
it, on bench/thrash.py's six generated traces with checkpoint-first stops, beside the policy as
it is (bench/results/thrash-their-bound.json, which must be from the same commit's policy).

    .venv/bin/python bench/aging_trial.py     # about 4 min on 2 cores

Writes bench/results/aging-trial.json; docs/thrash.md ("Each clock against its own bound")
summarises. The variant is the AGED_BORROWED_FIRST setting turned off
(`SimConfig.aged_borrowed_first`); the shipped default keeps aged borrowed work first.
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "bench" / "results"
KEYS = (
    "work_utilization",
    "jct_mean_s",
    "starved",
    "reclaims_over_bound",
    "reclaims_over_their_bound",
    "preempted_gpu_hours",
)


def one(args: tuple[int, float]) -> dict:
    seed, load = args
    from bench.thrash import _shape, _simulate
    from jobs.scheduling.generate import generate

    shape = _shape(seed, load)
    result = _simulate(
        "lockstep", seed, load, generate(shape), shape.quotas(), save=True, aged_first=False
    )
    result.pop("preemption_counts", None)
    result["variant"] = "aged-after-guaranteed"
    return result


def main() -> int:
    work = [(seed, load) for load in (0.8, 1.15, 1.5) for seed in (0, 1)]
    with ProcessPoolExecutor(2) as pool:
        runs = list(pool.map(one, work))
    base = json.loads((RESULTS / "thrash-their-bound.json").read_text())["runs"]
    by = {(r["policy"], r["load"], r["seed"]): r["metrics"] for r in base}
    rows = []
    for r in runs:
        now, easy = (
            by[("lockstep-save", r["load"], r["seed"])],
            by[("backfill", r["load"], r["seed"])],
        )
        rows.append(
            {
                "load": r["load"],
                "seed": r["seed"],
                **{k: [now[k], r["metrics"][k], easy[k]] for k in KEYS},
            }
        )
        print(r["load"], r["seed"], {k: rows[-1][k] for k in KEYS})
    out = RESULTS / "aging-trial.json"
    out.write_text(
        json.dumps({"columns": ["policy", "aged after guaranteed", "EASY"], "rows": rows}, indent=1)
        + "\n"
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
