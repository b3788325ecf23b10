"""Effective training time at cluster scale, from the recovery costs measured by bench/chaos.py.

    .venv/bin/python bench/cluster_estimate.py                       # newest chaos results
    .venv/bin/python bench/cluster_estimate.py --chaos bench/results/chaos-2026-11-29.json
    .venv/bin/python bench/cluster_estimate.py --write-doc           # refresh docs/reliability.md

Failure rate: Llama 3's (Dubey et al. 2024, section 3.3.4: 419 unexpected interruptions in 54
days on 16,384 H100s), i.e. about 50,700 GPU-hours between unexpected interruptions per GPU, so
a job on N GPUs sees one every MTBF = 50,700 h / N.

Model (first order in tau/MTBF and loss/MTBF, the Young/Daly setting):
  tau       = sqrt(2 x save_stall x MTBF)          the checkpoint interval (Young/Daly)
  loss      = detect + recover + tau / 2           per failure: downtime, then on average half
                                                   an interval of steps recomputed
  waste     = save_stall / tau + loss / MTBF       share of wall time not spent on kept steps
  effective = 1 - waste

`detect + recover` comes from the chaos run: per incident, injection -> the next attempt's first
step, averaged with each failure kind weighted equally. A toy cluster restarts far faster than a
1,000-GPU job (no container pull, no NCCL init across 128 nodes, a 5 MB checkpoint instead of
~1 TB), so the tables also show 2, 5, 10 and 30 minutes.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GPU_HOURS_BETWEEN_FAILURES = 50_700.0  # per GPU, Llama 3
DOC = ROOT / "docs" / "reliability.md"
BEGIN, END = "<!-- cluster-estimate:begin -->", "<!-- cluster-estimate:end -->"

# Save stall = how long training is blocked per checkpoint. With async DCP
# (torch.distributed.checkpoint.async_save) that is the staging of each rank's shard into pinned
# host memory plus the save planning; the write to storage overlaps training. PyTorch/IBM report
# 148.8 s -> 6.3 s of downtime per checkpoint for a 7B model going from sync to async DCP. A 70B
# model's training state (bf16 weights + fp32 master + Adam moments, ~14-16 B/param, ~1 TB) is
# ~10x larger but spread over 1,024 GPUs (~1 GB per GPU to stage, well under a second of
# device-to-host copy), so 10 s is a deliberately pessimistic base; the sync row is a blocking
# save of ~1 TB at ~4 GB/s effective.
SCENARIOS = [
    {
        "name": "(i) 4,096 GPUs, 7-day job",
        "gpus": 4096,
        "days": 7.0,
        "save_stall_s": 10.0,
        "model": "70B-class state (~1 TB), async DCP",
    },
    {
        "name": "(ii) 1,024 GPUs, 70B",
        "gpus": 1024,
        "days": None,
        "save_stall_s": 10.0,
        "model": "70B (~1 TB of training state), async DCP",
    },
]
STALLS = [2.0, 5.0, 10.0, 30.0, 250.0]  # s; the last is a synchronous ~1 TB save
RECOVERIES = [120.0, 300.0, 600.0, 1800.0]  # s, beside the measured one
REFERENCES = [
    ("Llama 3 405B (16,384 H100, 54 days)", "> 90 % effective training time (reported)"),
    ("ByteRobust (ByteDance, 9,600+ GPUs)", "97 % ETTR (reported)"),
]


def mtbf_s(gpus: int) -> float:
    return GPU_HOURS_BETWEEN_FAILURES * 3600.0 / gpus


def estimate(gpus: int, save_stall_s: float, downtime_s: float) -> dict:
    mtbf = mtbf_s(gpus)
    tau = math.sqrt(2.0 * save_stall_s * mtbf)
    loss = downtime_s + tau / 2.0
    save_waste = save_stall_s / tau
    failure_waste = loss / mtbf
    return {
        "gpus": gpus,
        "mtbf_h": mtbf / 3600.0,
        "tau_s": tau,
        "loss_per_failure_s": loss,
        "save_waste": save_waste,
        "failure_waste": failure_waste,
        "effective": 1.0 - save_waste - failure_waste,
    }


def newest_chaos() -> Path:
    found = sorted(
        p for p in (ROOT / "bench" / "results").glob("chaos-*.json") if "quick" not in p.name
    )
    if not found:
        sys.exit("no bench/results/chaos-*.json; run bench/chaos.py first (or pass --chaos)")
    return found[-1]


def measured_costs(path: Path) -> dict:
    data = json.loads(path.read_text())
    rows = [r for r in data["analysis"]["incidents"] if r.get("downtime_s") is not None]
    by_kind: dict[str, list[float]] = {}
    for r in rows:
        by_kind.setdefault(r["kind"], []).append(r["downtime_s"])
    balanced = statistics.mean(statistics.mean(v) for v in by_kind.values())
    return {
        "source": str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path),
        "incidents": len(rows),
        "downtime_by_kind_s": {k: round(statistics.mean(v), 1) for k, v in by_kind.items()},
        "downtime_kind_balanced_s": balanced,
        "downtime_median_s": statistics.median(r["downtime_s"] for r in rows),
        "downtime_max_s": max(r["downtime_s"] for r in rows),
    }


def fmt_pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def render(measured: dict) -> str:
    d = measured["downtime_kind_balanced_s"]
    out = [
        f"Measured detect + recover (injection -> next attempt's first step) from "
        f"`{measured['source']}`: {d:.1f} s per failure, each kind weighted equally "
        f"(by kind: "
        + ", ".join(f"{k} {v} s" for k, v in measured["downtime_by_kind_s"].items())
        + f"; median {measured['downtime_median_s']:.1f} s, max {measured['downtime_max_s']:.1f} s"
        f" over {measured['incidents']} incidents).",
        "",
        "| job | GPUs | job MTBF | save stall | Young/Daly interval | loss per failure "
        "| save overhead | failure overhead | effective training time |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for sc in SCENARIOS:
        e = estimate(sc["gpus"], sc["save_stall_s"], d)
        extra = ""
        if sc["days"]:
            failures = sc["days"] * 24 / e["mtbf_h"]
            extra = f" (~{failures:.1f} failures in {sc['days']:.0f} days)"
        out.append(
            f"| {sc['name']}{extra} | {sc['gpus']:,} | {e['mtbf_h']:.1f} h "
            f"| {sc['save_stall_s']:.0f} s | {e['tau_s'] / 60:.1f} min "
            f"| {e['loss_per_failure_s'] / 60:.1f} min | {fmt_pct(e['save_waste'])} "
            f"| {fmt_pct(e['failure_waste'])} | **{fmt_pct(e['effective'])}** |"
        )
    for name, value in REFERENCES:
        out.append(f"| {name} | | | | | | | | {value} |")
    for sc in SCENARIOS:
        out += [
            "",
            f"Sensitivity, {sc['name']}: effective training time by save stall (rows) and "
            "detect + recover per failure (columns); the interval is re-chosen by Young/Daly "
            "for each row.",
            "",
            "| save stall \\ detect+recover | "
            + f"{d:.0f} s (measured) | "
            + " | ".join(f"{r / 60:.0f} min" for r in RECOVERIES)
            + " |",
            "|---|" + "---|" * (1 + len(RECOVERIES)),
        ]
        for stall in STALLS:
            cells = [estimate(sc["gpus"], stall, rec) for rec in [d, *RECOVERIES]]
            label = f"{stall:.0f} s" + (" (sync save)" if stall == STALLS[-1] else "")
            out.append(
                f"| {label} (tau {cells[0]['tau_s'] / 60:.0f} min) | "
                + " | ".join(fmt_pct(c["effective"]) for c in cells)
                + " |"
            )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--chaos", type=Path, default=None, help="chaos results JSON (newest)")
    p.add_argument("--write-doc", action="store_true", help=f"replace the block in {DOC}")
    args = p.parse_args(argv)
    measured = measured_costs(args.chaos or newest_chaos())
    text = render(measured)
    print(text)
    if args.write_doc:
        doc = DOC.read_text()
        if BEGIN not in doc or END not in doc:
            sys.exit(f"{DOC} has no {BEGIN} ... {END} block")
        pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
        DOC.write_text(pattern.sub(lambda _m: f"{BEGIN}\n{text}\n{END}", doc))
        print(f"\nwrote the tables into {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
