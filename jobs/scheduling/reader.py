"""Reads the database into a Snapshot for the policy (a few queries, no per-row queries): the
one place where ORM rows become the policy's pure views."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from django.db import connection
from django.db.models import Count, Max, Q

from jobs.bulk_sql import read_rows
from jobs.conf import lockstep_setting
from jobs.models import GPU, PRIORITY_RANK, Allocation, Attempt, Job, Node, PreemptionRequest
from jobs.progress import pace
from jobs.queries import (
    attempt_protected_until,
    last_reclaims,
    recent_backfill_stops,
    recent_preemptions,
    restart_costs,
    run_seconds,
    teams_with_usage,
)
from jobs.scheduling.protection import min_run_s
from jobs.scheduling.snapshot import JobView, NodeView, RunningView, Snapshot, TeamView
from teams.models import Team

# How long the leader's fair-share history of released allocations is reused (UsageMemo).
USAGE_REFRESH_S = 300.0


@dataclass
class UsageMemo:
    """The leader's decayed usage per team of the allocations released before `at`, as of
    `at`. Until `refresh_s` has passed it is decayed by the elapsed time instead of read
    again (exact but for the window's far edge, where a second weighs 1/16), and each pass
    reads only the allocations held or released since `at`. One per leadership term, like
    apply.ReasonMemo; without one every pass reads the whole window."""

    refresh_s: float = USAGE_REFRESH_S
    at: datetime | None = None
    closed: dict[int, float] = field(default_factory=dict)


# The columns of a queued job the snapshot reads (JobView's, and what its derived fields need).
QUEUED_FIELDS = (
    "id",
    "team_id",
    "gpus",
    "priority",
    "submitted_at",
    "name",
    "time_limit_s",
    "first_started_at",
    "min_gpus",
    "checkpoint_interval_s",
)
# How long the leader's QueueMemo goes before it reads every queued row again.
QUEUE_REFRESH_S = 300.0


@dataclass
class QueueMemo:
    """The leader's copy of the queued jobs' rows, each with its version: PostgreSQL's `xmin`,
    the transaction that wrote the row, which every UPDATE of it changes (a row lock does
    not). A pass reads the queue's ids and versions, two numbers a row, and whole rows only of
    the jobs new to it or changed since: with 10,000 queued most passes read a handful
    (bench/snapshot_read.py). A version that differs for any other reason (a VACUUM FREEZE)
    only costs a read again; a changed row always has a new version. Everything is read again
    every `refresh_s` all the same. One per leadership term, like UsageMemo; PostgreSQL only
    (elsewhere the queue is read whole each pass). `reread` is how many rows the last pass
    read whole."""

    refresh_s: float = QUEUE_REFRESH_S
    at: float | None = None
    rows: dict[int, tuple[str, tuple]] = field(default_factory=dict)
    reread: int = 0


def _queued_rows(memo: QueueMemo | None) -> list:
    """The queued jobs' QUEUED_FIELDS rows, newest first (Job's ordering), as read_rows gives
    them; through the memo where there is one."""
    queued = Job.objects.filter(state=Job.State.QUEUED)
    if memo is None or connection.vendor != "postgresql":
        return read_rows(queued.values_list(*QUEUED_FIELDS, named=True))
    if memo.at is None or time.monotonic() - memo.at > memo.refresh_s:
        memo.rows.clear()
        memo.at = time.monotonic()
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT id, xmin::text FROM {Job._meta.db_table} WHERE state = %s",
            [Job.State.QUEUED],
        )
        versions = dict(cursor.fetchall())
    stale = [i for i, v in versions.items() if memo.rows.get(i, ("",))[0] != v]
    # Many changed (the term's first pass, a burst of submissions): the queue in one read.
    wanted = queued if len(stale) > len(versions) // 2 else queued.filter(id__in=stale)
    fresh = read_rows(wanted.values_list(*QUEUED_FIELDS, named=True)) if stale else []
    # Only what is queued now, as of the versions read: a job that left the queue since (or
    # arrived since) is not in this pass, as if it had left (arrived) after the snapshot.
    memo.rows = {i: row for i, row in memo.rows.items() if i in versions and i not in stale}
    for row in fresh:
        if row.id in versions:
            # A row changed between the two reads is stored under the older version, so the
            # next pass reads it again.
            memo.rows[row.id] = (versions[row.id], row)
    memo.reread = len(fresh)
    return [memo.rows[i][1] for i in sorted(memo.rows, reverse=True)]


def take_snapshot(
    now: datetime, usage: UsageMemo | None = None, queue: QueueMemo | None = None
) -> Snapshot:
    """Read the database into a Snapshot (a few queries, no per-row queries); the leader
    passes its term's memos of fair-share history and of the queue's rows."""
    live = list(
        Allocation.objects.filter(released_at__isnull=True).values_list(
            "gpu_id", "attempt_id", "node_id", "gpu__index"
        )
    )
    held = {gpu_id for gpu_id, _, _, _ in live}
    gpus_by_node: dict[int, list[tuple[int, int]]] = {}
    for gpu_id, node_id, index in GPU.objects.values_list("id", "node_id", "index"):
        gpus_by_node.setdefault(node_id, []).append((index, gpu_id))
    nodes = []
    for node in Node.objects.order_by("name").only("id", "name", "rack", "state", "runtime"):
        pairs = sorted(gpus_by_node.get(node.id, []))
        nodes.append(
            NodeView(
                id=node.id,
                name=node.name,
                rack=node.rack,
                gpu_ids=tuple(gpu_id for _, gpu_id in pairs),
                free=frozenset(index for index, gpu_id in pairs if gpu_id not in held),
                schedulable=node.state == Node.State.UP,
                isolated=node.isolated,
            )
        )
    # Rows, not model instances: 10,000 queued jobs built as models were half the read
    # (bench/snapshot_read.py); their timestamps parsed by psycopg's C loader (read_rows).
    queued_jobs = _queued_rows(queue)
    # A requeued job's limit is what is left of it (limits count run time, not wall time).
    ran = run_seconds([j.id for j in queued_jobs if j.time_limit_s and j.first_started_at], now=now)
    claim_nodes, claimant_of = _claims(now)
    # Only read back while the setting is on: the JSON lookup scans the queue every pass.
    ending = _ending_holds(now) if lockstep_setting("WAIT_FOR_ENDING_JOBS") else {}
    claim_nodes = {**{j: nodes for j, (nodes, _) in ending.items()}, **claim_nodes}
    started_before = [j.id for j in queued_jobs if j.first_started_at]
    reclaimed = last_reclaims(started_before)
    filled = recent_backfill_stops(started_before, now=now)
    queued_restart = restart_costs(started_before)
    # The interval its next attempt will get: its own setting, else its last attempt's (a
    # fresh job's Young/Daly advice is not computed here; if it comes out longer, the filler's
    # protection simply ends later and its reservation waits for that, never stopping it early).
    last_interval = dict(
        Attempt.objects.filter(job_id__in=started_before, checkpoint_interval_s__isnull=False)
        .order_by("job_id", "number")
        .values_list("job_id", "checkpoint_interval_s")
    )
    floor_s = float(lockstep_setting("PREEMPT_EXEMPT_S"))
    default_restart = float(lockstep_setting("RESTART_COST_S"))
    queued = tuple(
        JobView(
            id=j.id,
            team_id=j.team_id,
            gpus=j.gpus,
            priority=PRIORITY_RANK[j.priority],
            submitted_at=j.submitted_at,
            name=j.name,
            runtime_estimate_s=max(j.time_limit_s - ran.get(j.id, 0.0), 1.0)
            if j.time_limit_s
            else None,
            min_gpus=j.min_gpus,
            claim_nodes=claim_nodes.get(j.id, ()),
            ending_by=ending[j.id][1] if j.id in ending else None,
            reclaimed_at=reclaimed.get(j.id),
            # What its minimum run will be once started (attempt_protected_until's rule).
            min_run_s=min_run_s(
                j.checkpoint_interval_s or last_interval.get(j.id),
                queued_restart.get(j.id, default_restart),
                floor_s,
            ),
            filled=j.id in filled,
        )
        for j in queued_jobs
    )
    slots: dict[int, list[tuple[int, int]]] = {}
    for _, attempt_id, node_id, index in live:
        slots.setdefault(attempt_id, []).append((node_id, index))
    last_saves = dict(
        Job.objects.filter(attempts__ended_at__isnull=True)
        .annotate(last=Max("checkpoints__created_at"))
        .values_list("id", "last")
    )
    live_attempts = list(Attempt.objects.filter(ended_at__isnull=True).select_related("job"))
    ran_before = run_seconds(
        [a.job_id for a in live_attempts if a.job.time_limit_s], now=now, live=False
    )
    running_ids = [a.job_id for a in live_attempts]
    restart = restart_costs(running_ids)
    stops = recent_preemptions(running_ids, now=now)
    running = tuple(
        RunningView(
            id=a.job_id,
            team_id=a.job.team_id,
            gpus=a.job.gpus,
            priority=PRIORITY_RANK[a.job.priority],
            slots=tuple(slots.get(a.id, ())),
            started_at=a.created_at,
            expected_end=(end := _expected_end(a, ran_before.get(a.job_id, 0.0))),
            projected_end=_projected_end(a, end),
            frees_by=_frees_by(a, end),
            last_checkpoint_at=last_saves.get(a.job_id),
            stopping=a.state == Attempt.State.STOPPING,
            claimant_id=claimant_of.get(a.id) if a.state == Attempt.State.STOPPING else None,
            protected_until=attempt_protected_until(a, restart[a.job_id]),
            restart_s=restart[a.job_id],
            preemptions=stops.get(a.job_id, 0),
            stepped=a.first_step_at is not None,
            filler=a.filler,
        )
        for a in live_attempts
    )
    return Snapshot(
        now=now,
        nodes=tuple(nodes),
        queued=queued,
        teams=_teams(now, usage),
        running=running,
        **live_rules(),
    )


def live_rules() -> dict:
    """The policy's rules as today's LOCKSTEP settings set them, as Snapshot fields: the live
    pass reads them here, and so do the what-if's replays (jobs.whatif.sim_config)."""
    return {
        "preempt_exempt_s": lockstep_setting("PREEMPT_EXEMPT_S"),
        "max_preemptions": lockstep_setting("PREEMPT_MAX_PER_DAY"),
        "reclaim_hold_s": lockstep_setting("RECLAIM_HOLD_S"),
        "gang_reclaim_exempt_s": lockstep_setting("RECLAIM_GANG_EXEMPT_S"),
        "aged_borrowed_first": bool(lockstep_setting("AGED_BORROWED_FIRST")),
        "quota_before_drain": bool(lockstep_setting("QUOTA_BEFORE_DRAIN")),
        "wait_for_ending": bool(lockstep_setting("WAIT_FOR_ENDING_JOBS")),
        "grow_after_s": lockstep_setting("ELASTIC_GROW_AFTER_S"),
        "stop_grace_s": lockstep_setting("STOP_GRACE_S"),
    }


def _teams(now: datetime, memo: UsageMemo | None = None) -> tuple[TeamView, ...]:
    """Every team with its GPUs in use, its decayed usage, and whether a reclaim within
    RECLAIM_BACKOFF_S paused its borrowing."""
    backoff = now - timedelta(seconds=lockstep_setting("RECLAIM_BACKOFF_S"))
    paused = set(
        PreemptionRequest.objects.filter(
            kind=PreemptionRequest.Kind.RECLAIM, executed_at__gte=backoff
        ).values_list("victim__team_id", flat=True)
    )
    history = _usage_history(now, lockstep_setting("USAGE_HALF_LIFE_S"), memo)
    return tuple(
        TeamView(
            id=t.id,
            name=t.name,
            quota=t.quota,
            borrow_limit=t.borrow_limit,
            used=t.used,
            weight=t.weight,
            usage_history=history.get(t.id, 0.0),
            borrow_paused=t.id in paused,
            isolated_only=t.isolated_only,
        )
        # GPUs held now (queries.teams_with_usage: from the held allocations alone).
        for t in teams_with_usage(Team.objects.order_by("id"))
    )


def _expected_end(attempt, ran_before_s: float) -> datetime | None:
    """The time limit's remainder, counted from the attempt's start; for an attempt told to
    stop, no later than its stop deadline (the agent kills it then)."""
    end = (
        attempt.created_at + timedelta(seconds=max(attempt.job.time_limit_s - ran_before_s, 0.0))
        if attempt.job.time_limit_s
        else None
    )
    deadline = attempt.stop_deadline if attempt.state == attempt.State.STOPPING else None
    if deadline is not None:
        end = deadline if end is None else min(end, deadline)
    return end


def _frees_by(attempt, expected_end: datetime | None) -> datetime | None:
    """When the attempt's GPUs are free at the latest: a running one is told to stop at its
    time limit and has the stop grace to save (do_enforce_time_limit); a stopping one is
    killed at its deadline (expected_end is already that)."""
    if expected_end is None or attempt.state == attempt.State.STOPPING:
        return expected_end
    return expected_end + timedelta(seconds=lockstep_setting("STOP_GRACE_S"))


def _projected_end(attempt, expected_end: datetime | None) -> datetime | None:
    """When its steps should be done at its pace, no later than its expected end (a time
    limit or a stop deadline ends it first)."""
    at_pace = pace(attempt)
    if at_pace is None:
        return None
    if expected_end is None:
        return at_pace.projected_end
    return min(at_pace.projected_end, expected_end)


# How long after its last victim has gone a claim still holds (a few scheduler ticks: the
# pass that runs when the victim's exit is reported places the claimant).
CLAIM_AFTER_EXIT_S = 15.0


def _claims(now: datetime) -> tuple[dict[int, tuple[int, ...]], dict[int, int]]:
    """Executed preemptions whose claimant still waits and whose victim is still stopping or
    left less than CLAIM_AFTER_EXIT_S ago: (claimant job id -> the victims' node ids, victim
    attempt id -> claimant job id)."""
    requests = list(
        PreemptionRequest.objects.filter(
            state=PreemptionRequest.State.EXECUTED,
            claimant_started_at__isnull=True,
            claimant__state=Job.State.QUEUED,
        ).values_list("claimant_id", "victim_id", "executed_at")
    )
    if not requests:
        return {}, {}
    recent = now - timedelta(seconds=CLAIM_AFTER_EXIT_S)
    attempts = Attempt.objects.filter(
        Q(ended_at__isnull=True) | Q(ended_at__gte=recent),
        job_id__in={victim for _, victim, _ in requests},
    ).values_list("id", "job_id", "created_at", "ended_at")
    # The attempt each preemption stopped: the victim's attempt that was live when it ran.
    stopped: dict[int, int] = {}  # victim attempt id -> claimant job id
    by_victim: dict[int, list[tuple[int, datetime]]] = {}
    for claimant, victim, executed_at in requests:
        if executed_at is not None:
            by_victim.setdefault(victim, []).append((claimant, executed_at))
    for attempt_id, job_id, created_at, ended_at in attempts:
        for claimant, executed_at in by_victim.get(job_id, ()):
            if created_at <= executed_at and (ended_at is None or ended_at >= executed_at):
                stopped[attempt_id] = claimant
    nodes: dict[int, dict[int, None]] = {}
    for attempt_id, node_id in Allocation.objects.filter(attempt_id__in=stopped).values_list(
        "attempt_id", "node_id"
    ):
        nodes.setdefault(stopped[attempt_id], {})[node_id] = None
    return {claimant: tuple(ids) for claimant, ids in nodes.items()}, stopped


def _ending_holds(now: datetime) -> dict[int, tuple[tuple[int, ...], datetime]]:
    """Queued jobs whose last pass had them hold nodes for jobs ending within the grace anyway
    (wait "ending", jobs.scheduling.ending): job id -> (the nodes, theirs first in the next
    pass as a claimant's, and the first such wait's deadline), until CLAIM_AFTER_EXIT_S after
    those jobs were due to be gone."""
    recent = now.timestamp() - CLAIM_AFTER_EXIT_S
    holds = {}
    for job_id, wait in Job.objects.filter(state=Job.State.QUEUED, wait__code="ending").values_list(
        "id", "wait"
    ):
        data = wait.get("data") or {}
        until = float(data.get("until") or 0.0)
        if data.get("node_ids") and until >= recent:
            by = datetime.fromtimestamp(float(data.get("by") or until), tz=UTC)
            holds[job_id] = (tuple(int(n) for n in data["node_ids"]), by)
    return holds


def _usage_history(
    now: datetime, half_life_s: float, memo: UsageMemo | None = None
) -> dict[int, float]:
    """Per team, GPU-seconds held over the last four half-lives, each second weighted by
    0.5 ** (age / half-life) (approximated at each allocation's midpoint).

    Read grouped: a gang's ranks share their claim and release times, so the database returns
    one row per attempt with its GPU count, not one per GPU. At the target's churn (every GPU
    busy, gangs of ~2 h) four days of a 4,096-GPU cluster are ~200,000 allocations, which
    took 2-3 s to read one by one on every pass (bench/snapshot_read.py --history-days). With
    a `memo` the released ones are read once per `refresh_s`."""
    since = now - timedelta(seconds=4 * half_life_s)
    window = Allocation.objects.filter(claimed_at__lt=now)
    if memo is None:
        return _decayed(
            window.filter(Q(released_at__isnull=True) | Q(released_at__gte=since)),
            now,
            since,
            half_life_s,
        )
    if memo.at is None or not 0 <= (now - memo.at).total_seconds() < memo.refresh_s:
        memo.at = now
        memo.closed = _decayed(
            window.filter(released_at__gte=since, released_at__lt=now), now, since, half_life_s
        )
    factor = 0.5 ** ((now - memo.at).total_seconds() / half_life_s)
    usage = {team_id: value * factor for team_id, value in memo.closed.items()}
    recent = window.filter(Q(released_at__isnull=True) | Q(released_at__gte=memo.at))
    for team_id, value in _decayed(recent, now, since, half_life_s).items():
        usage[team_id] = usage.get(team_id, 0.0) + value
    return usage


def _decayed(allocations, now: datetime, since: datetime, half_life_s: float) -> dict[int, float]:
    usage: dict[int, float] = {}
    for team_id, claimed, released, gpus in (
        allocations.values_list("attempt__job__team_id", "claimed_at", "released_at")
        .annotate(gpus=Count("id"))
        .order_by()
    ):
        start, end = max(claimed, since), min(released or now, now)
        seconds = (end - start).total_seconds()
        if seconds <= 0:
            continue
        age = (now - (start + (end - start) / 2)).total_seconds()
        usage[team_id] = usage.get(team_id, 0.0) + gpus * seconds * 0.5 ** (age / half_life_s)
    return usage
