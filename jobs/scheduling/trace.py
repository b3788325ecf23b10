"""The simulator's inputs: job traces (CSV, with priority names mapped to the policy's ranks),
team quotas, and the size classes results are reported by. Pure: no Django, no clock."""

from __future__ import annotations

import csv
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

# Trace priority strings -> the policy's ranks (jobs.models.PRIORITY_RANK: low..urgent = 0..3).
# Alibaba QoS classes map by how much the class is promised: best effort lowest, latency
# sensitive high.
PRIORITY_NAMES = {
    "low": 0,
    "normal": 1,
    "high": 2,
    "urgent": 3,
    "be": 0,
    "besteffort": 0,
    "best-effort": 0,
    "burstable": 1,
    "ls": 2,
    "guaranteed": 2,
}
DEFAULT_PRIORITY = 1
SIZE_CLASSES = ("1", "2-8", "16-64", ">64")
# The real cluster traces (../shared/data/traces/README.md) lie beside every checkout's root,
# wherever it was cloned; LOCKSTEP_TRACES points elsewhere.
PROJECT_ROOT = Path(__file__).resolve().parents[2]


def traces_dir() -> Path:
    """Where the real traces are: $LOCKSTEP_TRACES, else ../shared/data/traces beside the
    project root."""
    env = os.environ.get("LOCKSTEP_TRACES")
    return Path(env) if env else PROJECT_ROOT.parent / "shared" / "data" / "traces"


def size_class(gpus: int) -> str:
    """1 GPU; 2-8 (one node); 9-64 (labelled "16-64": traces hold powers of two); >64."""
    if gpus <= 1:
        return "1"
    if gpus <= 8:
        return "2-8"
    if gpus <= 64:
        return "16-64"
    return ">64"


@dataclass(frozen=True)
class TraceJob:
    job_id: str
    submit_s: float
    gpus: int
    duration_s: float
    team: str = "unknown"
    priority: int = DEFAULT_PRIORITY


@dataclass(frozen=True)
class TeamQuota:
    quota: int
    borrow_limit: int
    weight: float = 1.0


def _priority_mapper(raw: list[str]) -> Callable[[str], int]:
    """Strings by name; integers as-is when all lie in 0..3, else by rank into four bands."""
    ints = sorted({int(v) for v in raw if v.strip().lstrip("-").isdigit()})
    if ints and (ints[0] < 0 or ints[-1] > 3):
        bands = {v: min(3, 4 * i // len(ints)) for i, v in enumerate(ints)}
    else:
        bands = {v: v for v in ints}

    def rank(value: str) -> int:
        value = value.strip()
        if not value:
            return DEFAULT_PRIORITY
        if value.lstrip("-").isdigit():
            return bands[int(value)]
        if value.lower() not in PRIORITY_NAMES:
            raise ValueError(f"unknown priority {value!r} (use {', '.join(PRIORITY_NAMES)})")
        return PRIORITY_NAMES[value.lower()]

    return rank


def load_trace(
    path: str | Path,
    *,
    team: str | None = None,
    start_s: float | None = None,
    end_s: float | None = None,
    limit: int | None = None,
    load_scale: float = 1.0,
) -> list[TraceJob]:
    """Read a trace CSV (job_id,submit_s,gpus,duration_s,team,status[,extra]).

    Filters apply in this order: `team`, the submit window [start_s, end_s), the first `limit`
    jobs. `load_scale` X divides inter-arrival times by X (X = 2: the same jobs arrive twice as
    fast). Priority comes from a `priority` column, else from a `qos` column, else normal.
    """
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    prio_col = next((c for c in ("priority", "qos") if rows and c in rows[0]), None)
    rank = _priority_mapper([r[prio_col] for r in rows]) if prio_col else None
    jobs: list[TraceJob] = []
    for r in rows:
        if team is not None and r.get("team", "unknown") != team:
            continue
        submit = float(r["submit_s"])
        if start_s is not None and submit < start_s:
            continue
        if end_s is not None and submit >= end_s:
            continue
        jobs.append(
            TraceJob(
                job_id=r["job_id"],
                submit_s=submit,
                gpus=int(r["gpus"]),
                duration_s=max(0.0, float(r["duration_s"])),
                team=r.get("team") or "unknown",
                priority=rank(r[prio_col]) if rank else DEFAULT_PRIORITY,
            )
        )
        if limit is not None and len(jobs) >= limit:
            break
    if load_scale != 1.0 and jobs:
        if load_scale <= 0:
            raise ValueError("load_scale must be positive")
        first = min(j.submit_s for j in jobs)
        jobs = [replace(j, submit_s=first + (j.submit_s - first) / load_scale) for j in jobs]
    return jobs


def load_quotas(path: str | Path) -> dict[str, TeamQuota]:
    """team,quota,borrow_limit,weight (borrow_limit and weight optional)."""
    quotas = {}
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            quotas[r["team"]] = TeamQuota(
                quota=int(r["quota"]),
                borrow_limit=int(r.get("borrow_limit") or 0),
                weight=float(r.get("weight") or 1.0),
            )
    return quotas


def equal_quotas(teams: Iterable[str], gpus: int) -> dict[str, TeamQuota]:
    """An equal share per team (the remainder to the first teams); borrow up to the rest."""
    names = sorted(set(teams))
    out = {}
    for i, name in enumerate(names):
        quota = gpus // len(names) + (1 if i < gpus % len(names) else 0)
        out[name] = TeamQuota(quota=quota, borrow_limit=gpus - quota, weight=1.0)
    return out
