"""How far the start estimates can be trusted: the band each has earned.

A queued job's first estimate is kept (Job.promised_start_at); once it starts, the error of
that promise is known. The band of a size class is the 90th percentile of those errors over
the jobs that started in the last REPORT_DAYS: "14:20, usually within 25 min" means nine
promises in ten of that size came true within 25 minutes. Until a cluster has MIN_SAMPLES of
its own in a class, the band is the simulator's, measured on generated and real traces
(bench/estimates.py writes estimate_bands.json; docs/simulator.md publishes it)."""

from __future__ import annotations

import json
import math
from datetime import datetime, timedelta
from pathlib import Path

from jobs.models import Job
from jobs.reports import REPORT_DAYS
from jobs.scheduling.trace import SIZE_CLASSES, size_class

MIN_SAMPLES = 20
SIMULATED_BANDS = Path(__file__).with_name("estimate_bands.json")


def simulated_bands() -> dict[str, float | None]:
    """Size class -> p90 error (s) the simulator measured; {} where no bench has run."""
    try:
        by_size = json.loads(SIMULATED_BANDS.read_text())["by_size"]
    except (OSError, ValueError, KeyError):
        return {}
    return {c: by_size.get(c) for c in SIZE_CLASSES}


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]


def estimate_bands(now: datetime, days: int = REPORT_DAYS) -> dict[str, dict]:
    """Size class -> {band_s, samples, source}: this cluster's p90 error where it has
    MIN_SAMPLES, else the simulator's (band_s None where neither has a number)."""
    errors: dict[str, list[float]] = {c: [] for c in SIZE_CLASSES}
    rows = Job.objects.filter(
        promised_start_at__isnull=False, first_started_at__gte=now - timedelta(days=days)
    ).values_list("gpus", "promised_start_at", "first_started_at")
    for gpus, promised, started in rows:
        errors[size_class(gpus)].append(abs((started - promised).total_seconds()))
    simulated = simulated_bands()
    bands = {}
    for cls in SIZE_CLASSES:
        own = errors[cls]
        if len(own) >= MIN_SAMPLES:
            bands[cls] = {"band_s": _p90(own), "samples": len(own), "source": "this cluster"}
        else:
            bands[cls] = {
                "band_s": simulated.get(cls),
                "samples": len(own),
                "source": "simulator",
            }
    return bands


MEMO_S = 60.0
_memo: dict[Path, tuple[datetime, dict[str, dict]]] = {}


def recent_estimate_bands(now: datetime) -> dict[str, dict]:
    """estimate_bands, computed at most once a MEMO_S per process (and simulator file): every
    job's API detail asks, and `lockstep wait` polls it each second while a job waits, but the
    bands move with the jobs that start over a week, not by the second."""
    kept = _memo.get(SIMULATED_BANDS)
    if kept is None or not timedelta(0) <= now - kept[0] < timedelta(seconds=MEMO_S):
        kept = (now, estimate_bands(now))
        _memo[SIMULATED_BANDS] = kept
    return kept[1]


def band_text(gpus: int, bands: dict[str, dict]) -> str:
    """'usually within 25 min' for a job of `gpus`, '' where no band is known. Jobs above 64
    GPUs get no band: they wait for whole nodes to drain and every job ordered ahead of them
    pushes that back, so in the simulator they always started late (docs/simulator.md)."""
    if size_class(gpus) == ">64":
        return "at the earliest (jobs this large usually start later)"
    band = bands.get(size_class(gpus), {}).get("band_s")
    if band is None:
        return ""
    minutes = max(1, round(band / 60))
    if minutes >= 120:
        return f"usually within {minutes / 60:.0f} h"
    return f"usually within {minutes} min"
