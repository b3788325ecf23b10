"""What the simulator takes and gives: its configuration (`SimConfig`), the planners it can
replay (`resolve_policy`), its result (`SimResult`) and the virtual clock's epoch. The engine
that uses them is jobs.scheduling.simulate, which re-exports these names."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from jobs.scheduling.baselines import backfill, fifo
from jobs.scheduling.policy import plan
from jobs.scheduling.protection import DEFAULT_RESTART_S
from jobs.scheduling.snapshot import Snapshot
from jobs.scheduling.trace import TeamQuota

EPOCH = datetime(2021, 3, 4, tzinfo=UTC)  # t = 0 of the virtual clock (any aware time works)
POLICIES = ("fifo", "backfill", "lockstep")
PlanFn = Callable[[Snapshot], object]


def resolve_policy(policy: str | PlanFn) -> tuple[str, PlanFn]:
    if callable(policy):
        return getattr(policy, "__name__", "custom"), policy
    if policy == "fifo":
        return policy, fifo
    if policy == "backfill":
        return policy, backfill
    if policy == "lockstep":
        return policy, plan
    raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")


@dataclass(frozen=True)
class SimConfig:
    gpus: int
    gpus_per_node: int = 8
    racks: int | None = None  # default: one rack per 32 nodes
    quotas: dict[str, TeamQuota] | None = None  # default: equal_quotas over the trace's teams
    checkpoint_interval_s: float = 1800.0  # of run time; <= 0: never checkpoints
    grace_s: float = 60.0  # a victim stops this long after its preemption is carried out
    checkpoint_on_stop: bool = False  # True: the victim saves when told to stop (loses nothing)
    approval_delay_s: float = 300.0  # priority preemptions auto-approve after this (reclaims: 0)
    reclaim_backoff_s: float = 300.0  # a team whose GPUs were reclaimed may not borrow for this
    estimate_noise: float = 0.0  # sigma of a log-normal factor on runtime estimates
    seed: int = 0
    usage_half_life_s: float = 86400.0  # decay of TeamView.usage_history (LOCKSTEP setting)
    starve_factor: float = 10.0  # starved: waited more than this many times its duration
    max_preemptions: int = 100  # of one job: more means the policy is in a preemption loop
    # What a restart costs a preempted job (start-up, restore), run again before its work
    # resumes; first starts are not charged, so the baselines' results stay comparable.
    restart_s: float = DEFAULT_RESTART_S
    preempt_exempt_s: float = 600.0  # the least minimum run (LOCKSTEP PREEMPT_EXEMPT_S)
    safety_stop: int = 5  # preemptions of one job in a day before no one may take it (live too)
    # A gang beyond its team's quota is not reclaimed before this (protection rule 5; live:
    # RECLAIM_GANG_EXEMPT_S).
    gang_reclaim_exempt_s: float = 14400.0
    # The live scheduler passes every tick; this engine passes at events only (arrivals, ends,
    # stops). True adds a pass when a job's protection ends (its minimum run, and rule 5's
    # exemption for a drained-for gang), so a claim waiting for it goes ahead then rather
    # than at the next event. On by default since 2026-12-06 (results before then were
    # measured without it; docs/thrash.md, "Passes when protection ends", compares).
    pass_at_protection_end: bool = True
    # Rule 1: aged borrowed work first among guaranteed work (live: AGED_BORROWED_FIRST).
    aged_borrowed_first: bool = True
    # A job within its quota may start on a borrowing head's draining nodes (live:
    # QUOTA_BEFORE_DRAIN).
    quota_before_drain: bool = False
    # Claims wait for jobs ending within the grace anyway instead of stopping one (rule 5,
    # jobs.scheduling.ending; live: WAIT_FOR_ENDING_JOBS).
    wait_for_ending: bool = False
    # Record each job's start estimate at submit and an hour on as promises, and their error
    # (jobs.scheduling.promises; metrics "estimates"). Costly: an estimate replays plan().
    track_promises: bool = False


class SimulationError(RuntimeError):
    """The planner drove the simulation somewhere it cannot finish (e.g. a preemption loop)."""


@dataclass
class SimResult:
    policy: str
    metrics: dict
    series: tuple[list[float], list[int], list[int]]  # t, busy GPUs, queued jobs (step values)
    waits: dict[str, list[float]] = field(default_factory=dict)  # size class -> waits (s)
    # per job, in submit order: (trace job id, submit, gpus, first start, finish, preemptions)
    records: list[tuple[str, float, int, float | None, float | None, int]] = field(
        default_factory=list
    )
    # with track_promises: (job index, GPUs, promise at submit, after 1 h, first start)
    promises: list[tuple] = field(default_factory=list)

    def starts(self) -> dict[str, float | None]:
        return {r[0]: r[3] for r in self.records}

    def to_json(self) -> dict:
        return self.metrics


def _at(t: float) -> datetime:
    return EPOCH + timedelta(seconds=t)
