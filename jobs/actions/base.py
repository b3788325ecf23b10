"""What every state change shares: the Event it writes, the pushes and scheduler wake-ups it
sends on commit, and the locks and checkpoint-and-stop that every stop begins with."""

from __future__ import annotations

import signal
from datetime import datetime, timedelta

from django.db import transaction

from jobs.conf import lockstep_setting
from jobs.event_kinds import EventKind
from jobs.models import (
    Attempt,
    Event,
    Job,
)
from jobs.notify import on_commit_send
from jobs.scheduling.wake import wake_scheduler


def record_event(kind: EventKind, message: str, **refs) -> Event:
    """Write the Event; EventKind(kind) refuses a kind that is not in the list."""
    # Messages quote agent and trainer reports; PostgreSQL text cannot hold a NUL character.
    text = message.replace("\x00", "\ufffd")[:2000]
    return Event.objects.create(kind=EventKind(kind), message=text, **refs)


def push_state(job: Job) -> None:
    on_commit_send(
        job.id, {"type": "state", "state": job.state, "reason": job.reason, "job": job.id}
    )


def wake(reason: str) -> None:
    transaction.on_commit(lambda: wake_scheduler(reason))


def describe_exit(code: int | None) -> str:
    if code is None:
        return "no exit code"
    if code < 0:
        try:
            return f"signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def lock_job_for_stop(job_id: int) -> tuple[Job, Attempt | None]:
    """Lock the job's live attempt, then the job: the heartbeat's order (node, attempt, job).
    A stop that locked the job first and then waited for the attempt deadlocked with a
    heartbeat marking that attempt running or ended, which waits for the job. The live
    attempt is read again under the job's lock: one started meanwhile is locked then."""
    live = Attempt.objects.select_for_update(no_key=True).filter(job_id=job_id, ended_at=None)
    list(live.order_by("id"))
    job = Job.objects.select_for_update(no_key=True).get(pk=job_id)
    return job, live.order_by("id").first()


def begin_stop(
    attempt: Attempt, *, now: datetime, reason: str, grace_s: float | None = None
) -> None:
    """Checkpoint-and-stop the attempt within STOP_GRACE_S (or `grace_s`, if shorter)."""
    if attempt.state == Attempt.State.STOPPING:
        return
    grace = lockstep_setting("STOP_GRACE_S")
    if grace_s is not None:
        grace = min(grace, max(grace_s, 0.0))
    attempt.state = Attempt.State.STOPPING
    attempt.stop_deadline = now + timedelta(seconds=grace)
    attempt.end_reason = reason
    attempt.save(update_fields=["state", "stop_deadline", "end_reason"])
    record_event(
        EventKind.ATTEMPT_STOPPING,
        f"attempt {attempt.number}: checkpoint-and-stop, deadline {attempt.stop_deadline:%H:%M:%S}",
        job_id=attempt.job_id,
        attempt=attempt,
    )
