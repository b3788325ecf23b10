"""Builders for policy tests (pure values) and for database fixtures (through the actions)."""

from datetime import UTC, datetime, timedelta

from jobs.scheduling.snapshot import JobView, NodeView, Snapshot, TeamView

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
_ids = iter(range(1, 10**9))


def node(name: str, gpus: int = 8, *, busy: int | set = 0, rack: str = "r1", up: bool = True):
    node_id = next(_ids)
    busy_set = set(range(busy)) if isinstance(busy, int) else set(busy)
    return NodeView(
        id=node_id,
        name=name,
        rack=rack,
        gpu_ids=tuple(node_id * 100 + i for i in range(gpus)),
        free=frozenset(set(range(gpus)) - busy_set),
        schedulable=up,
    )


def team(name: str = "t", quota: int = 1000, *, borrow: int = 0, used: int = 0, team_id=None):
    return TeamView(
        id=team_id or next(_ids), name=name, quota=quota, borrow_limit=borrow, used=used
    )


def job(job_id: int, gpus: int, *, team_id: int, prio: int = 1, submitted: int = 0):
    return JobView(
        id=job_id,
        team_id=team_id,
        gpus=gpus,
        priority=prio,
        submitted_at=T0 + timedelta(seconds=submitted),
    )


def snapshot(nodes, jobs, teams) -> Snapshot:
    return Snapshot(now=T0, nodes=tuple(nodes), queued=tuple(jobs), teams=tuple(teams))
