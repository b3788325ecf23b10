"""Draw the hollow-node runs (bench/hollow.py results) for docs/production.md: heartbeat and
metric-lag percentiles against the heartbeats per second the portal answered, with the goals,
and where the cores went.

    .venv/bin/python bench/hollow_plot.py bench/results/hollow-sweep-*.json \\
        --out docs/figures/hollow.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.hollow_report import GOALS  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+")
    parser.add_argument("--out", default="docs/figures/hollow.png")
    args = parser.parse_args(argv)
    runs = sorted(
        (json.loads(Path(p).read_text()) for p in args.results),
        key=lambda r: r["heartbeats_per_s"],
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    rate = [r["heartbeats_per_s"] for r in runs]
    for key, label in (
        ("heartbeat_p99_s", "heartbeat p99"),
        ("heartbeat_p50_s", "heartbeat p50"),
        ("portal_lag_p99_s", "metric lag p99 (from the heartbeat)"),
        ("lag_p99_s", "metric lag p99 (from the step)"),
    ):
        left.plot(rate, [r[key] for r in runs], marker="o", label=label)
    left.axhline(GOALS["heartbeat_p99_s"], color="grey", ls="--", lw=0.8)
    left.axhline(GOALS["lag_at_production_beat_p99_s"], color="grey", ls=":", lw=0.8)
    left.set_yscale("log")
    left.set_xlabel("heartbeats answered per second")
    left.set_ylabel("seconds")
    left.set_title("Latency (goals dashed: heartbeat 1 s, lag 2 s)")
    left.legend(fontsize=8)
    kinds = ["portal", "postgres", "harness", "scheduler", "redis"]
    bottom = [0.0] * len(runs)
    labels = [f"{r['args']['nodes']}n\n{r['heartbeats_per_s']:.0f}/s" for r in runs]
    for kind in kinds:
        cores = [r["processes"].get(kind, {}).get("cores", 0.0) for r in runs]
        right.bar(labels, cores, bottom=bottom, label=kind)
        bottom = [b + c for b, c in zip(bottom, cores, strict=True)]
    right.axhline(runs[0]["cores"], color="grey", ls="--", lw=0.8)
    right.set_ylabel("cores (CPU s per s)")
    right.set_title(f"Where the machine's {runs[0]['cores']} cores went")
    right.legend(fontsize=8)
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
