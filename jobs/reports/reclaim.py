"""Reclaim times as the live system measured them, per team, against the bound DESIGN.md
(section 6, rule 4) promises: a job that preempts others for its team's quota runs within the
victims' stop grace, plus the approval delay for a priority preemption, plus one scheduler tick.

A claim is one wait of one claimant job: its preemption requests that the same start ended
(several victims count once, from the earliest proposal). Its time is
PreemptionRequest.reclaim_s of that earliest request: proposal to the claimant's start.

Beside the claims, the waits no request measures: a job its team's quota owes GPUs (queued,
within the quota's room, while another team borrows) is timed by the scheduler from the pass
that first sees it owed (jobs/scheduling/owed.py); past the bound it writes
`team.quota_overdue`, and `team.quota_overdue_ended` when the wait ends. Those count here as
`owed_overdue` (ended in the window, with their longest) and `owed_overdue_now`.
"""

from __future__ import annotations

import statistics
from datetime import datetime, timedelta

from django.db.models import Max

from jobs.conf import lockstep_setting
from jobs.event_kinds import EventKind
from jobs.models import Event, Job, PreemptionRequest

# Every kind the model knows: a report that listed only some raised KeyError on the others.
KINDS = tuple(PreemptionRequest.Kind)


def reclaim_bound_s(kind: str) -> float:
    """STOP_GRACE_S + SCHEDULER_TICK_S, plus PREEMPTION_APPROVAL_DELAY_S for a kind that waits
    for an admin (one that is not carried out at once)."""
    bound = lockstep_setting("STOP_GRACE_S") + lockstep_setting("SCHEDULER_TICK_S")
    if kind not in PreemptionRequest.AUTOMATIC:
        bound += lockstep_setting("PREEMPTION_APPROVAL_DELAY_S")
    return float(bound)


def _empty(team_id: int, team: str, since: datetime) -> dict:
    return {
        "team_id": team_id,
        "team": team,
        "since": since,
        "claims": 0,
        "median_s": None,
        "max_s": None,
        "breaches": 0,
        "waiting": 0,
        "waiting_over_bound": 0,
        "oldest_waiting_s": None,
        "by_kind": dict.fromkeys(KINDS, 0),
        "bound_s": {kind: reclaim_bound_s(kind) for kind in KINDS},
        "owed_overdue": 0,
        "owed_overdue_max_s": None,
        "owed_overdue_now": 0,
        "owed_oldest_s": None,
        "breached": False,
    }


# An owed wait still open is looked for among the alerts of this many days before `now`.
OPEN_OVERDUE_DAYS = 30


def _owed_overdue(out: dict, *, since: datetime, now: datetime, team_ids) -> None:
    """Add the scheduler's overdue owed waits (ended in [since, now], or still open) to `out`."""
    events = Event.objects.filter(created_at__lte=now, team__isnull=False)
    if team_ids is not None:
        events = events.filter(team_id__in=list(team_ids))
    ended = events.filter(kind=EventKind.TEAM_QUOTA_OVERDUE_ENDED, created_at__gte=since)
    for team_id, team, data in ended.values_list("team_id", "team__name", "data"):
        row = out.setdefault(team_id, _empty(team_id, team, since))
        row["owed_overdue"] += 1
        row["owed_overdue_max_s"] = max(row["owed_overdue_max_s"] or 0.0, data.get("owed_s", 0))
    for _, team_id, team, owed_since in open_overdue(now, team_ids=team_ids):
        row = out.setdefault(team_id, _empty(team_id, team, since))
        row["owed_overdue_now"] += 1
        waited = (now - owed_since).total_seconds()
        row["owed_oldest_s"] = round(max(row["owed_oldest_s"] or 0.0, waited), 1)


def open_overdue(now: datetime, *, team_ids=None) -> list[tuple[int, int, str, datetime]]:
    """Owed waits past the bound not yet ended: a job still queued whose latest overdue Event
    (of the last OPEN_OVERDUE_DAYS) is the alert, not its end. (job id, team id, team name,
    owed since) each. The scheduler's new leadership term takes these over (loop.owed_clocks)."""
    recent = Event.objects.filter(
        kind__in=[EventKind.TEAM_QUOTA_OVERDUE, EventKind.TEAM_QUOTA_OVERDUE_ENDED],
        created_at__gte=now - timedelta(days=OPEN_OVERDUE_DAYS),
        created_at__lte=now,
        team__isnull=False,
        job__state=Job.State.QUEUED,
    )
    if team_ids is not None:
        recent = recent.filter(team_id__in=list(team_ids))
    latest = recent.values("job_id").annotate(last=Max("id")).values_list("last", flat=True)
    alerts = Event.objects.filter(id__in=list(latest), kind=EventKind.TEAM_QUOTA_OVERDUE)
    return [
        (job_id, team_id, team, datetime.fromisoformat(data["since"]))
        for job_id, team_id, team, data in alerts.values_list(
            "job_id", "team_id", "team__name", "data"
        )
    ]


def reclaim_summary(
    *, since: datetime, now: datetime, team_ids=None, teams=None
) -> dict[int, dict]:
    """Per claimant team id: claims proposed in [since, now]. `teams` (id -> name) adds a
    zero row for each team without claims; `team_ids` limits the query.

    Per team: `claims` (ended by the claimant's start), their `median_s` and `max_s`,
    `breaches` (claims longer than their kind's bound), `waiting` (claimants still queued
    behind an open or executed request), `waiting_over_bound` (of those, older than their
    bound: breaches in the making), `by_kind` (claims per kind), `bound_s` per kind,
    `owed_overdue` / `owed_overdue_max_s` (owed waits past the bound that ended in the
    window, and the longest), `owed_overdue_now` / `owed_oldest_s` (still waiting), and
    `breached` (any breach, ended or still waiting). Rejected and withdrawn requests do not
    count: nothing was promised for them.
    """
    requests = PreemptionRequest.objects.filter(created_at__gte=since, created_at__lte=now).exclude(
        state__in=[PreemptionRequest.State.REJECTED, PreemptionRequest.State.WITHDRAWN]
    )
    if team_ids is not None:
        requests = requests.filter(claimant__team_id__in=list(team_ids))
    # (claimant, its start or None) -> [team id, team name, earliest proposal, kind, state]
    claims: dict[tuple[int, datetime | None], list] = {}
    for claimant_id, team_id, team, kind, created, started, state in requests.values_list(
        "claimant_id",
        "claimant__team_id",
        "claimant__team__name",
        "kind",
        "created_at",
        "claimant_started_at",
        "claimant__state",
    ):
        if started is None and state != Job.State.QUEUED:
            continue  # the claimant gave up (cancelled) without starting
        claim = claims.setdefault((claimant_id, started), [team_id, team, created, kind])
        claim[2] = min(claim[2], created)
        if kind == PreemptionRequest.Kind.PRIORITY:
            claim[3] = kind  # the longer bound applies when priority was involved

    out = {tid: _empty(tid, name, since) for tid, name in (teams or {}).items()}
    times: dict[int, list[float]] = {}
    for (_, started), (team_id, team, created, kind) in claims.items():
        row = out.setdefault(team_id, _empty(team_id, team, since))
        bound = row["bound_s"][kind]
        if started is None:
            waited = (now - created).total_seconds()
            row["waiting"] += 1
            row["oldest_waiting_s"] = round(max(row["oldest_waiting_s"] or 0.0, waited), 1)
            if waited > bound:
                row["waiting_over_bound"] += 1
            continue
        took = (started - created).total_seconds()
        times.setdefault(team_id, []).append(took)
        row["by_kind"][kind] += 1
        if took > bound:
            row["breaches"] += 1
    _owed_overdue(out, since=since, now=now, team_ids=team_ids)
    for team_id, row in out.items():
        took = times.get(team_id, [])
        row["claims"] = len(took)
        if took:
            row["median_s"] = round(statistics.median(took), 1)
            row["max_s"] = round(max(took), 1)
        row["breached"] = bool(
            row["breaches"]
            or row["waiting_over_bound"]
            or row["owed_overdue"]
            or row["owed_overdue_now"]
        )
    return out
