"""A job's own state changes: submit, cancel, time limit, priority, requeue after a backoff."""

from __future__ import annotations

from datetime import datetime

from django.db import transaction

from jobs.actions.base import begin_stop, lock_job_for_stop, push_state, record_event, wake
from jobs.actions.preemption import withdraw_open_preemptions_of
from jobs.event_kinds import EventKind
from jobs.models import (
    Job,
)
from jobs.queries import (
    run_seconds,
)
from teams.models import Team


@transaction.atomic
def do_submit_job(*, owner, team: Team, now: datetime, **fields) -> Job:
    job = Job.objects.create(
        owner=owner,
        team=team,
        submitted_at=now,
        state=Job.State.QUEUED,
        reason="queued; waiting for the scheduler's next pass",
        **fields,
    )
    record_event(
        EventKind.JOB_SUBMITTED,
        f"{owner.username} submitted {job.name}: {job.gpus} GPUs, priority {job.priority}",
        job=job,
        team=team,
        actor=owner,
    )
    wake("job submitted")
    return job


@transaction.atomic
def do_cancel_job(job: Job, *, actor, now: datetime, reason: str = "") -> Job:
    job, attempt = lock_job_for_stop(job.pk)
    if job.is_terminal:
        return job
    why = reason or f"cancelled by {actor.username if actor else 'the system'}"
    if attempt is not None:
        # Checkpoint first: the agent sends SIGTERM, the trainer saves at the next step
        # boundary and exits; the GPUs are released when it does (or at the deadline).
        begin_stop(attempt, now=now, reason=why)
    job.state = Job.State.CANCELLED
    job.reason = why
    job.finished_at = now
    job.save(update_fields=["state", "reason", "finished_at"])
    record_event(EventKind.JOB_CANCELLED, why, job=job, team_id=job.team_id, actor=actor)
    withdraw_open_preemptions_of(job, why=f"job {job.id} was cancelled", now=now)
    push_state(job)
    wake("job cancelled")
    return job


@transaction.atomic
def do_enforce_time_limit(job: Job, *, now: datetime) -> bool:
    """A job past its time limit is stopped checkpoint-first and ends FAILED, like Slurm's
    TIMEOUT. The limit counts the job's run time over all its attempts: a job that waited
    through a preemption or a failure does not lose that time from its limit."""
    job, attempt = lock_job_for_stop(job.pk)
    if job.is_terminal or not job.time_limit_s or job.first_started_at is None:
        return False
    if run_seconds([job.id], now=now).get(job.id, 0.0) < job.time_limit_s:
        return False
    why = f"time limit of {job.time_limit_s}s reached"
    if attempt is not None:
        begin_stop(attempt, now=now, reason=why)
    job.state, job.reason, job.finished_at = Job.State.FAILED, why, now
    job.save(update_fields=["state", "reason", "finished_at"])
    record_event(EventKind.JOB_TIME_LIMIT, why, job=job, team_id=job.team_id)
    withdraw_open_preemptions_of(job, why=f"job {job.id} reached its time limit", now=now)
    push_state(job)
    wake("time limit")
    return True


@transaction.atomic
def do_set_job_priority(job: Job, *, priority: str, actor) -> Job:
    before = job.priority
    job.priority = priority
    job.save(update_fields=["priority"])
    record_event(
        EventKind.JOB_PRIORITY_CHANGED,
        f"priority {before} -> {priority}",
        job=job,
        team_id=job.team_id,
        actor=actor,
    )
    wake("priority changed")
    return job


@transaction.atomic
def do_requeue_job(job: Job, *, now: datetime) -> bool:
    """RESTARTING -> QUEUED once the backoff has passed."""
    updated = Job.objects.filter(
        pk=job.pk, state=Job.State.RESTARTING, restart_after__lte=now
    ).update(state=Job.State.QUEUED, reason="requeued after a failure; waiting to be placed")
    if updated:
        job.refresh_from_db()
        record_event(
            EventKind.JOB_REQUEUED,
            f"requeued for restart {job.restart_count}",
            job=job,
            team_id=job.team_id,
        )
        push_state(job)
    return bool(updated)
