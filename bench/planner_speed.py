"""The memory planner's layout search, timed: `plan()` for the 70B model at 8 to 32,768 GPUs
(median of repeated calls), beside the size of the search (layouts evaluated). The search walks
divisors of the node size and the layer count, so its size, and its time, should stay flat as
the cluster grows; 8 GPUs, the smallest, is the baseline in the same run. The suite checks the
search's size (tests/test_planner_layouts.py), never its seconds.

    .venv/bin/python bench/planner_speed.py   # bench/results/planner-speed.json, a few seconds

Results: docs/planner.md ("Which layouts, and which one").
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trainer.planner import ClusterShape, ModelShape, plan  # noqa: E402

# A 70B model's shape, as tests/planner_helpers.py (Llama 3 70B).
LLAMA_70B = {
    "params": 70 * 10**9,
    "layers": 80,
    "hidden": 8192,
    "heads": 64,
    "vocab": 128256,
    "seq": 4096,
}
SIZES = (8, 64, 512, 4096, 32768)


def timed(gpus: int, repeats: int) -> dict:
    model, cluster = ModelShape(**LLAMA_70B), ClusterShape(gpus=gpus)
    seconds, layouts = [], 0
    for _ in range(repeats):
        started = time.perf_counter()
        layouts = len(plan(model, cluster).layouts)
        seconds.append(time.perf_counter() - started)
    return {
        "gpus": gpus,
        "layouts": layouts,
        "median_s": statistics.median(seconds),
        "max_s": max(seconds),
        "repeats": repeats,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=str(ROOT / "bench/results/planner-speed.json"))
    args = parser.parse_args(argv)
    rows = [timed(gpus, args.repeats) for gpus in SIZES]
    base = rows[0]["median_s"]
    for row in rows:
        row["vs_8_gpus"] = row["median_s"] / base
        print(
            f"{row['gpus']:>6} GPUs: {row['layouts']:>3} layouts, median "
            f"{row['median_s'] * 1000:7.2f} ms (max {row['max_s'] * 1000:.2f}), "
            f"{row['vs_8_gpus']:.2f}x the 8-GPU search"
        )
    Path(args.out).write_text(
        json.dumps(
            {
                "when": datetime.now(UTC).isoformat(timespec="seconds"),
                "machine": platform.platform(),
                "model": "llama-70b",
                "rows": rows,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
