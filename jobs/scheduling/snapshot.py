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
    last_checkpoint_at: datetime | None = None
    stopping: bool = False  # already told to checkpoint and stop
    claimant_id: int | None = None  # stopping for this queued job (a preemption's claimant)


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
    # A victim that started (or resumed) less than this long ago is taken only when no
    # longer-running one will do: without it, a just-resumed job - little work at risk - is
    # the cheapest victim again and again (Slurm's PreemptExemptTime, as a preference).
    preempt_exempt_s: float = 600.0
    # A shrunk elastic job grows back (rule 8) only after running this long at its smaller
    # size: each grow costs a checkpoint and a restart.
    grow_after_s: float = 600.0

    def team(self, team_id: int) -> TeamView:
        for team in self.teams:
            if team.id == team_id:
                return team
        raise KeyError(team_id)
