"""Synthetic traces in the target cluster's shape, for the simulator and the policy's property
tests: gang sizes of 8-64 GPUs with a few of a quarter and half of the cluster, teams with
shares, three priority classes, log-normal durations and Poisson arrivals at a chosen load.

The real traces (../shared/data/traces) have no job above 64 GPUs and no priorities worth the
name, so they never exercise what breaks a policy at the target: whole-cluster fractions that
must preempt, and high-priority work that borrows. Pure: no Django, no clock; one seed, one
trace.
"""

from __future__ import annotations

import csv
import io
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass, field

from jobs.scheduling.trace import TeamQuota, TraceJob

PRIORITY_LABELS = {0: "low", 1: "normal", 2: "high", 3: "urgent"}


def _default_sizes() -> dict[str, float]:
    # Mostly 8-64-GPU gangs; "quarter" and "half" are fractions of the cluster.
    return {"8": 0.34, "16": 0.26, "32": 0.2, "64": 0.15, "quarter": 0.03, "half": 0.02}


@dataclass(frozen=True)
class TraceShape:
    """The parameters of a generated trace. `sizes` maps a GPU count, or "quarter"/"half" of
    the cluster, to its weight; `shares` gives each team's relative quota (equal if None)."""

    gpus: int = 1024
    gpus_per_node: int = 8
    teams: int = 8
    shares: tuple[float, ...] | None = None
    jobs: int = 3000
    sizes: dict[str, float] = field(default_factory=_default_sizes)
    high: float = 0.10  # fraction of jobs of high priority
    low: float = 0.20  # and of low; the rest are normal
    duration_median_s: float = 7200.0
    duration_sigma: float = 1.0  # of the log-normal: 1.0 puts the 90th percentile near 3.6x
    duration_min_s: float = 300.0
    duration_max_s: float = 48 * 3600.0
    load: float = 1.15  # offered GPU-seconds per second, over the cluster's GPUs
    seed: int = 0

    def __post_init__(self) -> None:
        if self.gpus <= 0 or self.gpus_per_node <= 0 or self.teams <= 0 or self.jobs <= 0:
            raise ValueError("gpus, gpus_per_node, teams and jobs must be positive")
        if self.shares is not None and (
            len(self.shares) != self.teams or any(s <= 0 for s in self.shares)
        ):
            raise ValueError(f"shares: {self.teams} positive numbers, one per team")
        if not self.sizes or any(w < 0 for w in self.sizes.values()):
            raise ValueError("sizes: at least one size, no negative weights")
        for key in self.sizes:
            self.size_of(key)
        if not 0 <= self.high + self.low <= 1:
            raise ValueError("high + low must lie in [0, 1]")
        if self.load <= 0 or self.duration_median_s <= 0:
            raise ValueError("load and duration_median_s must be positive")

    def size_of(self, key: str) -> int:
        """GPUs of one size class: a count, or a fraction of the cluster in whole nodes."""
        fractions = {"quarter": 4, "half": 2, "whole": 1}
        if key in fractions:
            nodes = max(1, self.gpus // self.gpus_per_node // fractions[key])
            return nodes * self.gpus_per_node
        if not str(key).isdigit() or int(key) <= 0:
            raise ValueError(f"sizes: {key!r} is not a GPU count nor quarter/half/whole")
        return min(int(key), self.gpus)

    def team_names(self) -> list[str]:
        return [f"team{i + 1:02d}" for i in range(self.teams)]

    def quotas(self) -> dict[str, TeamQuota]:
        """Each team's quota in proportion to its share (whole GPUs, the remainder to the
        first teams); each may borrow up to the rest of the cluster."""
        shares = self.shares or (1.0,) * self.teams
        total = sum(shares)
        quotas = [math.floor(self.gpus * s / total) for s in shares]
        for i in range(self.gpus - sum(quotas)):
            quotas[i % self.teams] += 1
        return {
            name: TeamQuota(quota=q, borrow_limit=self.gpus - q, weight=1.0)
            for name, q in zip(self.team_names(), quotas, strict=True)
        }


def generate(shape: TraceShape) -> list[TraceJob]:
    """A trace of `shape.jobs` jobs. Teams submit in proportion to their shares; arrivals are
    Poisson at the rate that offers `load` times the cluster's GPU-seconds (measured on the
    sizes and durations drawn, so the load is exact for this trace, not only on average)."""
    rng = random.Random(shape.seed)
    keys = list(shape.sizes)
    weights = [shape.sizes[k] for k in keys]
    names = shape.team_names()
    shares = shape.shares or (1.0,) * shape.teams
    mu = math.log(shape.duration_median_s)
    drawn = []
    for _ in range(shape.jobs):
        gpus = shape.size_of(rng.choices(keys, weights)[0])
        duration = rng.lognormvariate(mu, shape.duration_sigma)
        duration = min(shape.duration_max_s, max(shape.duration_min_s, duration))
        roll = rng.random()
        priority = 2 if roll < shape.high else 0 if roll < shape.high + shape.low else 1
        team = rng.choices(names, shares)[0]
        drawn.append((gpus, round(duration), priority, team))
    offered = sum(g * d for g, d, _, _ in drawn) / len(drawn)  # GPU-seconds per job
    rate = shape.load * shape.gpus / offered  # jobs per second
    t = 0.0
    jobs = []
    for i, (gpus, duration, priority, team) in enumerate(drawn):
        jobs.append(TraceJob(f"g{i}", round(t), gpus, duration, team, priority))
        t += rng.expovariate(rate)
    return jobs


def to_csv(jobs: Iterable[TraceJob]) -> str:
    """The trace format of ../shared/data/traces, with a priority column."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["job_id", "submit_s", "gpus", "duration_s", "team", "status", "priority"])
    for job in jobs:
        writer.writerow(
            [
                job.job_id,
                int(job.submit_s),
                job.gpus,
                int(job.duration_s),
                job.team,
                "generated",
                PRIORITY_LABELS[job.priority],
            ]
        )
    return out.getvalue()
