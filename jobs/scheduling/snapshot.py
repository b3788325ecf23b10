"""An immutable picture of the cluster for the policy: pure frozen views, no ORM objects and no
Django (jobs.scheduling.reader fills them from the database)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime


@dataclass(frozen=True)
class NodeView:
    id: int
    name: str
    rack: str
    gpu_ids: tuple[int, ...]  # by GPU index: gpu_ids[i] is the id of GPU i
    free: frozenset[int]  # free GPU indices
    schedulable: bool = True  # up, not cordoned/draining/down
    # Its agent runs each job in the job's own container (not the "process" runtime, which
    # runs jobs as the agent's user beside every other team's: jobs.scheduling.isolation).
    isolated: bool = True

    @property
    def total(self) -> int:
        return len(self.gpu_ids)


@dataclass(frozen=True)
class JobView:
    id: int
    team_id: int
    gpus: int
    priority: int  # higher first
    submitted_at: datetime
    name: str = ""
    runtime_estimate_s: float | None = None  # time limit or estimate, for backfill
    min_gpus: int | None = None  # elastic: may run on fewer GPUs (down to this) when short
    # Nodes its executed preemptions are freeing (victims still stopping) or have just freed:
    # the GPUs there go to this job first (rule 5).
    claim_nodes: tuple[int, ...] = ()
    # When a reclaim last stopped it: a job reclaimed within its protection is not restarted
    # on borrowed GPUs while a guaranteed job of another team waits (it would be taken back).
    reclaimed_at: datetime | None = None
    # Its minimum run once started (jobs.scheduling.protection.min_run_s): a job may fill a
    # reservation's draining nodes only if that run ends before the reservation's time.
    min_run_s: float = 0.0
    # Stopped before as a reservation's filler within the safety window: it does not fill again.
    filled: bool = False
    # Waiting for jobs that end within the grace anyway (jobs.scheduling.ending): when the
    # first of those waits was due to end. A later wait must end by then (no chained waits).
    ending_by: datetime | None = None


@dataclass(frozen=True)
class RunningView:
    """A job holding GPUs now."""

    id: int
    team_id: int
    gpus: int
    priority: int
    slots: tuple[tuple[int, int], ...]  # (node id, GPU index) per rank
    started_at: datetime
    expected_end: datetime | None = None  # from its time limit or estimate; None = unknown
    # When its steps should be done at its pace (jobs.progress), no later than expected_end.
    # Advice: start estimates end it there; the policy plans with expected_end only.
    projected_end: datetime | None = None
    # When its GPUs are free again at the latest, without anyone stopping it: its time limit
    # plus the checkpoint-first stop's grace, or its stop deadline if already told to stop.
    # A claim that would be met by then waits for it instead of stopping a job (rule 5).
    frees_by: datetime | None = None
    last_checkpoint_at: datetime | None = None
    stopping: bool = False  # already told to checkpoint and stop
    claimant_id: int | None = None  # stopping for this queued job (a preemption's claimant)
    # Minimum run (jobs.scheduling.protection): before this no priority or starvation claim
    # takes it, and reclaims take it only when no other victim will do. None: unprotected.
    protected_until: datetime | None = None
    restart_s: float = 0.0  # what a stop costs it besides lost work: start-up, restore
    preemptions: int = 0  # stopped by preemptions within the safety window (a day)
    # It has made a step since it started (or resumed): an attempt that has not is not grown
    # back (its restart would be thrown away before it trained at all).
    stepped: bool = True
    # Started on a reservation's draining nodes although it ends after they drain (rule 4's
    # fillers): the reservation's holder stops it, checkpoint-first, once the rest has drained.
    filler: bool = False


@dataclass(frozen=True)
class TeamView:
    id: int
    name: str
    quota: int
    borrow_limit: int
    used: int  # GPUs held by the team's live attempts
    weight: float = 1.0
    usage_history: float = 0.0  # decayed GPU-seconds used, for fair share
    borrow_paused: bool = False  # its borrowed GPUs were just reclaimed: no borrowing for now
    # An admin refused process-runtime nodes for it: its jobs run on isolated nodes only.
    isolated_only: bool = False

    @property
    def cap(self) -> int:
        return self.quota + (0 if self.borrow_paused else self.borrow_limit)


@dataclass(frozen=True)
class Snapshot:
    now: datetime
    nodes: tuple[NodeView, ...]
    queued: tuple[JobView, ...]
    teams: tuple[TeamView, ...] = field(default=())
    running: tuple[RunningView, ...] = field(default=())
    # The least protection a started job gets (RunningView.protected_until comes from its
    # start-up cost and checkpoint interval, never below this; Slurm's PreemptExemptTime).
    preempt_exempt_s: float = 600.0
    # The safety stop: a job preempted this many times within a day is not preempted again
    # (an admin alert says so); a policy that would go on is in a preemption loop.
    max_preemptions: int = 5
    # A job a reclaim stopped does not borrow again within this while another team's
    # guaranteed job waits (jobs.scheduling.protection, rule 2).
    reclaim_hold_s: float = 3600.0
    # A gang of whole nodes beyond its team's quota is not reclaimed before it has run this
    # long (jobs.scheduling.protection, rule 5).
    gang_reclaim_exempt_s: float = 14400.0
    # Rule 1: aged borrowed work goes first among guaranteed work (True) or after it
    # (jobs.scheduling.order.job_order_key; the AGED_BORROWED_FIRST setting).
    aged_borrowed_first: bool = True
    # A job within its team's quota may start on the free GPUs of a borrowing head's draining
    # nodes (jobs.scheduling.policy; the QUOTA_BEFORE_DRAIN setting).
    quota_before_drain: bool = False
    # Claims wait for jobs ending within the stop grace anyway instead of stopping one
    # (jobs.scheduling.ending; the WAIT_FOR_ENDING_JOBS setting, off: see its text).
    wait_for_ending: bool = False
    # A shrunk elastic job grows back (rule 8) only after running this long at its smaller
    # size: each grow costs a checkpoint and a restart.
    grow_after_s: float = 600.0
    # How long a stopped job has to checkpoint before it is killed (STOP_GRACE_S): what a
    # claim waits for its victims anyway, and so how long it may wait for jobs ending.
    stop_grace_s: float = 60.0

    def team(self, team_id: int) -> TeamView:
        for team in self.teams:
            if team.id == team_id:
                return team
        raise KeyError(team_id)
