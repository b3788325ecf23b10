"""GPU-hours per team and week: used, lost to failures and to preemption, goodput; and per
week the cluster's capacity, allocated and idle GPU-hours (the console's usage report)."""

from __future__ import annotations

from collections import defaultdict
from datetime import UTC, datetime, timedelta

from django.db.models import Count, F, Max, Q

from jobs.models import GPU, Allocation, Attempt
from jobs.reports.goodput import FAILURES, effective_share

LOST_FAILURE = FAILURES  # the attempt ends that count as failures, as goodput counts them
LOST_PREEMPTION = (Attempt.State.PREEMPTED,)


def week_starts(now: datetime, weeks: int) -> list[datetime]:
    """Mondays 00:00 UTC, oldest first, the last one the start of `now`'s week."""
    today = now.astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    monday = today - timedelta(days=today.weekday())
    return [monday - timedelta(weeks=weeks - 1 - i) for i in range(weeks)]


def _split(start: datetime, end: datetime, bounds: list[datetime], add) -> None:
    """Call add(week index, seconds) for each week [bounds[i], bounds[i+1]) the span overlaps."""
    for i, week_start in enumerate(bounds[:-1]):
        seconds = (min(end, bounds[i + 1]) - max(start, week_start)).total_seconds()
        if seconds > 0:
            add(i, seconds)


def _week_of(when: datetime, bounds: list[datetime]) -> int | None:
    for i in range(len(bounds) - 1):
        if bounds[i] <= when < bounds[i + 1]:
            return i
    return None


def usage_report(*, now: datetime, weeks: int, teams) -> dict:
    """GPU-hours per team and week: used (allocations held), lost to failures and to
    preemption, goodput; and per week the cluster's capacity, allocated and idle GPU-hours.

    Lost work of an attempt that failed, was lost with its node, or was preempted = its GPUs x
    the time from its last checkpoint (or, without one, its start) to its end: what the next
    attempt recomputes. It counts in the week the attempt ended. Goodput = (used - lost) / used.
    Capacity counts every registered GPU from its node's registration, down nodes included.
    """
    starts = week_starts(now, weeks)
    bounds = [*starts, now]
    teams = list(teams)
    team_ids = {t.id for t in teams}
    used = defaultdict(float)  # (week, team id) -> GPU-seconds
    lost = defaultdict(float)  # (week, team id, cause) -> GPU-seconds
    begin = starts[0]

    # An attempt's GPUs are claimed together and released together: one row per gang.
    for team_id, claimed, released, count in (
        Allocation.objects.filter(
            Q(released_at__isnull=True) | Q(released_at__gt=begin),
            claimed_at__lt=now,
            attempt__job__team_id__in=team_ids,
        )
        .values_list("attempt__job__team_id", "claimed_at", "released_at")
        .annotate(count=Count("id"))
        .order_by()
    ):

        def add(i, s, team_id=team_id, count=count):
            used[i, team_id] += count * s

        _split(claimed, released or now, bounds, add)

    ended = (
        Attempt.objects.filter(
            state__in=LOST_FAILURE + LOST_PREEMPTION,
            ended_at__gte=begin,
            ended_at__lt=now,
            job__team_id__in=team_ids,
        )
        .annotate(
            last_checkpoint=Max(
                "checkpoints__created_at", filter=Q(checkpoints__created_at__lte=F("ended_at"))
            )
        )
        .values_list(
            "job__team_id", "job__gpus", "state", "created_at", "ended_at", "last_checkpoint"
        )
    )
    for team_id, gpus, state, created, end, checkpoint in ended:
        since = max(checkpoint, created) if checkpoint else created
        week = _week_of(end, bounds)
        if week is not None:
            cause = "failure" if state in LOST_FAILURE else "preemption"
            lost[week, team_id, cause] += gpus * max((end - since).total_seconds(), 0.0)

    capacity = defaultdict(float)
    for registered, count in (
        GPU.objects.values_list("node__registered_at").annotate(count=Count("id")).order_by()
    ):

        def add_capacity(i, s, count=count):
            capacity[i] += count * s

        _split(registered, now, bounds, add_capacity)

    def hours(seconds: float) -> float:
        return round(seconds / 3600, 2)

    def goodput(used_s: float, lost_s: float) -> dict:
        share = effective_share(used_s - lost_s, used_s)
        return {
            "goodput": None if share is None else round(share, 4),
            "goodput_pct": "" if share is None else f"{100 * share:.1f}%",
        }

    rows, cluster = [], []
    for i, start in enumerate(starts):
        allocated = sum(used[i, t.id] for t in teams)
        cluster.append(
            {
                "week": start.date(),
                "capacity_h": hours(capacity[i]),
                "allocated_h": hours(allocated),
                "idle_h": hours(max(capacity[i] - allocated, 0.0)),
            }
        )
        for team in teams:
            failure, preemption = lost[i, team.id, "failure"], lost[i, team.id, "preemption"]
            rows.append(
                {
                    "week": start.date(),
                    "team": team.name,
                    "used_h": hours(used[i, team.id]),
                    "lost_failure_h": hours(failure),
                    "lost_preemption_h": hours(preemption),
                    **goodput(used[i, team.id], failure + preemption),
                }
            )
    totals = []
    for team in teams:
        u = sum(used[i, team.id] for i in range(len(starts)))
        f = sum(lost[i, team.id, "failure"] for i in range(len(starts)))
        p = sum(lost[i, team.id, "preemption"] for i in range(len(starts)))
        totals.append(
            {
                "team": team.name,
                "used_h": hours(u),
                "lost_failure_h": hours(f),
                "lost_preemption_h": hours(p),
                **goodput(u, f + p),
            }
        )
    return {"weeks": [s.date() for s in starts], "rows": rows, "cluster": cluster, "totals": totals}
