"""An immutable picture of the cluster for the policy: no ORM objects cross this line."""

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

    def team(self, team_id: int) -> TeamView:
        for team in self.teams:
            if team.id == team_id:
                return team
        raise KeyError(team_id)


def take_snapshot(now: datetime) -> Snapshot:
    """Read the database into a Snapshot (a few queries, no per-row queries)."""
    from django.db.models import Count, Q

    from jobs.models import GPU, PRIORITY_RANK, Allocation, Job, Node
    from teams.models import Team

    held = set(Allocation.objects.filter(released_at__isnull=True).values_list("gpu_id", flat=True))
    gpus_by_node: dict[int, list[tuple[int, int]]] = {}
    for gpu_id, node_id, index in GPU.objects.values_list("id", "node_id", "index"):
        gpus_by_node.setdefault(node_id, []).append((index, gpu_id))
    nodes = []
    for node in Node.objects.order_by("name").only("id", "name", "rack", "state"):
        pairs = sorted(gpus_by_node.get(node.id, []))
        nodes.append(
            NodeView(
                id=node.id,
                name=node.name,
                rack=node.rack,
                gpu_ids=tuple(gpu_id for _, gpu_id in pairs),
                free=frozenset(index for index, gpu_id in pairs if gpu_id not in held),
                schedulable=node.state == Node.State.UP,
            )
        )
    queued = tuple(
        JobView(
            id=j.id,
            team_id=j.team_id,
            gpus=j.gpus,
            priority=PRIORITY_RANK[j.priority],
            submitted_at=j.submitted_at,
            name=j.name,
        )
        for j in Job.objects.filter(state=Job.State.QUEUED).only(
            "id", "team_id", "gpus", "priority", "submitted_at", "name"
        )
    )
    teams = tuple(
        TeamView(id=t.id, name=t.name, quota=t.quota, borrow_limit=t.borrow_limit, used=t.used)
        for t in Team.objects.annotate(
            used=Count(
                "jobs__attempts__allocations",
                filter=Q(jobs__attempts__allocations__released_at__isnull=True),
            )
        )
    )
    return Snapshot(now=now, nodes=tuple(nodes), queued=queued, teams=teams)
