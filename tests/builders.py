"""Builders for policy tests (pure values, no database)."""

from datetime import UTC, datetime, timedelta

from jobs.scheduling.snapshot import JobView, NodeView, RunningView, Snapshot, TeamView

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
_ids = iter(range(1, 10**9))


def node(
    name: str,
    gpus: int = 8,
    *,
    busy: int | set = 0,
    rack: str = "r1",
    up: bool = True,
    isolated: bool = True,
):
    node_id = next(_ids)
    busy_set = set(range(busy)) if isinstance(busy, int) else set(busy)
    return NodeView(
        id=node_id,
        name=name,
        rack=rack,
        gpu_ids=tuple(node_id * 100 + i for i in range(gpus)),
        free=frozenset(set(range(gpus)) - busy_set),
        schedulable=up,
        isolated=isolated,
    )


def team(
    name: str = "t",
    quota: int = 1000,
    *,
    borrow: int = 0,
    used: int = 0,
    team_id=None,
    weight: float = 1.0,
    history: float = 0.0,
    paused: bool = False,
    isolated_only: bool = False,
):
    return TeamView(
        id=team_id or next(_ids),
        name=name,
        quota=quota,
        borrow_limit=borrow,
        used=used,
        weight=weight,
        usage_history=history,
        borrow_paused=paused,
        isolated_only=isolated_only,
    )


def job(
    job_id: int,
    gpus: int,
    *,
    team_id: int,
    prio: int = 1,
    submitted: int = 0,
    estimate: float | None = None,
    min_run: float = 1800.0,
):
    return JobView(
        id=job_id,
        team_id=team_id,
        gpus=gpus,
        priority=prio,
        submitted_at=T0 + timedelta(seconds=submitted),
        runtime_estimate_s=estimate,
        min_run_s=min_run,
    )


def running(
    job_id: int,
    node_view: NodeView,
    indices,
    *,
    team_id: int,
    prio: int = 1,
    ends_in: float | None = None,
    checkpoint_age: float | None = None,
    started_ago: float = 3600,
):
    return RunningView(
        id=job_id,
        team_id=team_id,
        gpus=len(list(indices)),
        priority=prio,
        slots=tuple((node_view.id, i) for i in indices),
        started_at=T0 - timedelta(seconds=started_ago),
        expected_end=None if ends_in is None else T0 + timedelta(seconds=ends_in),
        last_checkpoint_at=None
        if checkpoint_age is None
        else T0 - timedelta(seconds=checkpoint_age),
    )


def snapshot(nodes, jobs, teams, runs=()) -> Snapshot:
    return Snapshot(
        now=T0, nodes=tuple(nodes), queued=tuple(jobs), teams=tuple(teams), running=tuple(runs)
    )


def placed(plan):
    """A plan's placements by job id."""
    return {pl.job_id: pl for pl in plan.placements}
