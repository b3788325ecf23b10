"""A team's quota owed and late: the scheduler's owed clocks (jobs/scheduling/owed.py) past the
reclaim bound become Events, an alert when one passes it and a record when it ends, which the
reclaim report (jobs/reports/reclaim.py) counts beside the preemption requests' claims."""

from __future__ import annotations

from datetime import datetime

from django.db import transaction

from jobs.actions.base import record_event
from jobs.event_kinds import EventKind
from jobs.models import Event, Job
from jobs.scheduling.owed import Overdue


def do_note_quota_overdue(overdue: Overdue, *, bound_s: float, gangs: int, now: datetime):
    """`overdue.job_id`, owed GPUs by its team's quota since `overdue.since`, is past the
    reclaim bound at `now`. `gangs`: drained-for gangs holding lent GPUs (protection rule 5
    gives those lenders a longer bound)."""
    job = Job.objects.select_related("team").filter(pk=overdue.job_id).first()
    if job is None:
        return None
    waited = (now - overdue.since).total_seconds()
    why = (
        f"; {gangs} drained-for gang(s) hold lent GPUs (rule 5: reclaimed after their exemption)"
        if gangs
        else ""
    )
    with transaction.atomic():
        return record_event(
            EventKind.TEAM_QUOTA_OVERDUE,
            f"job {job.id} ({job.name}) of {job.team.name} has waited {waited:.0f}s for GPUs "
            f"within its team's quota while other teams borrow (bound {bound_s:.0f}s){why}",
            job=job,
            team=job.team,
            data={"since": overdue.since.isoformat(), "bound_s": bound_s, "gangs": gangs},
        )


def do_note_quota_overdue_ended(overdue: Overdue) -> Event | None:
    """An overdue wait ended at `overdue.ended`: the job started, left the queue, or its
    team got its quota back for other work."""
    job = Job.objects.select_related("team").filter(pk=overdue.job_id).first()
    if job is None:
        return None
    owed_s = (overdue.ended - overdue.since).total_seconds()
    if job.state == Job.State.QUEUED:
        how = "still queued: its team's own work took the room, or no team borrows now"
    elif job.state in (Job.State.CANCELLED, Job.State.FAILED):
        how = job.state.lower()
    else:
        how = "started"
    with transaction.atomic():
        return record_event(
            EventKind.TEAM_QUOTA_OVERDUE_ENDED,
            f"job {job.id} ({job.name}) of {job.team.name} was owed GPUs for {owed_s:.0f}s ({how})",
            job=job,
            team=job.team,
            data={"since": overdue.since.isoformat(), "owed_s": round(owed_s, 1), "how": how},
        )
