"""An attempt's end and what it means for its job: success, restart after a backoff, requeue
after a stop, or failure (no restarts left, or a user error)."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.db import transaction

from jobs.actions.base import push_state, record_event, wake
from jobs.actions.strikes import strike_node
from jobs.conf import lockstep_setting
from jobs.event_kinds import EventKind
from jobs.models import (
    Allocation,
    Attempt,
    Checkpoint,
    Job,
    MetricPoint,
    Node,
)
from jobs.queries import (
    latest_checkpoint,
    world_size,
)

# The stop reason of a grow-back (preemption.do_grow_job); its requeue says "requeued: ...".
GROW_REASON = "growing back to"
# The stop reason of a planned restart (nodes.do_node_leaving); likewise "requeued: ...".
LEAVING_REASON = "planned restart of"
# The stop reason of a move off a straggler's node (failures.do_flag_straggler); likewise.
STRAGGLER_REASON = "moving off the straggler's node"


def _backoff(restart_count: int) -> float:
    base = lockstep_setting("RESTART_BACKOFF_S")
    return min(base * (2 ** max(restart_count - 1, 0)), lockstep_setting("RESTART_BACKOFF_MAX_S"))


def did_work(attempt: Attempt) -> bool:
    """Whether the attempt got as far as training: a step reported, or, for a script that
    reports none, a scalar it logged or a save it wrote (a framework's, seen by the agent).
    A failure before that is the command's or the image's, not a node's."""
    if attempt.first_step_at is not None:
        return True
    return (
        MetricPoint.objects.filter(attempt=attempt).exists()
        or Checkpoint.objects.filter(attempt=attempt).exists()
    )


def _early_failures(job: Job, limit: int) -> list[Attempt]:
    """The job's latest ended attempts if the last `limit` all failed before doing any work."""
    recent = list(job.attempts.filter(ended_at__isnull=False).order_by("-number")[:limit])
    if len(recent) < limit or any(a.state != Attempt.State.FAILED or did_work(a) for a in recent):
        return []
    return recent


def do_end_attempt(
    attempt: Attempt,
    *,
    state: str,
    reason: str,
    now: datetime,
    failed_at: datetime | None = None,
    blame_node: Node | None = None,
    data: dict | None = None,
    final: bool = False,
) -> Attempt:
    """End a live attempt, release its GPUs, and move the job on (restart, finish or fail).

    `failed_at` is when the failure happened (for a hang: the last progress; for a lost node:
    its last heartbeat), so time to detect = now - failed_at. `blame_node` is the node the
    failure is attributed to: it gets a strike, unless the attempt never made a step (then the
    job's own code is the likelier cause). `final`: a failure any restart would repeat (its
    image cannot be run): the job fails at once, with no restart used.
    """
    with transaction.atomic():
        attempt = Attempt.objects.select_for_update(no_key=True).get(pk=attempt.pk)
        if attempt.ended_at is not None:
            return attempt
        was_stopping = attempt.state == Attempt.State.STOPPING
        failure = state in (Attempt.State.FAILED, Attempt.State.LOST)
        attempt.state = state
        attempt.ended_at = now
        attempt.end_reason = reason
        attempt.failed_at = (failed_at or now) if failure else None
        attempt.save(update_fields=["state", "ended_at", "end_reason", "failed_at"])
        Allocation.objects.filter(attempt=attempt, released_at__isnull=True).update(released_at=now)
        job = Job.objects.select_for_update(no_key=True).get(pk=attempt.job_id)
        record_event(
            EventKind(f"attempt.{state}"),
            f"attempt {attempt.number} {state}: {reason}",
            job=job,
            attempt=attempt,
            node=blame_node,
            team_id=job.team_id,
            data={
                **(data or {}),
                "detect_s": round((now - attempt.failed_at).total_seconds(), 3)
                if attempt.failed_at
                else None,
                "last_step": attempt.last_step,
            },
        )
        if blame_node is not None and (did_work(attempt) or state == Attempt.State.LOST):
            strike_node(
                blame_node,
                f"job {job.id} attempt {attempt.number}: {reason}",
                now=now,
                attempt=attempt,
            )
        early = (
            _early_failures(job, lockstep_setting("EARLY_FAILURES_USER_ERROR"))
            if state == Attempt.State.FAILED
            else []
        )
        if job.is_terminal:
            pass  # cancelled while running: the job already says so
        elif state == Attempt.State.SUCCEEDED:
            job.state, job.reason, job.finished_at = Job.State.SUCCEEDED, "finished", now
            record_event(
                EventKind.JOB_SUCCEEDED,
                f"succeeded after {attempt.number} attempt(s)",
                job=job,
                team_id=job.team_id,
            )
        elif state == Attempt.State.PREEMPTED or (was_stopping and state != Attempt.State.FAILED):
            job.state = Job.State.QUEUED
            job.reason = (
                f"requeued: {reason}"
                if reason.startswith((GROW_REASON, LEAVING_REASON, STRAGGLER_REASON))
                else f"requeued after preemption: {reason}"
            )
        elif final and state == Attempt.State.FAILED:
            job.state, job.finished_at = Job.State.FAILED, now
            job.reason = f"{reason} (not restarted: every attempt would fail the same way)"
            record_event(
                EventKind.JOB_FAILED,
                job.reason,
                job=job,
                team_id=job.team_id,
                data={"class": "user_error", **(data or {})},
            )
        elif early:
            # Several attempts in a row died before their first step: the job's command,
            # image or data is the likelier cause than the hardware; stop burning restarts.
            job.state, job.finished_at = Job.State.FAILED, now
            job.reason = (
                f"user error: the last {len(early)} attempts failed before their first step; "
                f"last: {reason}"
            )
            record_event(
                EventKind.JOB_FAILED,
                job.reason,
                job=job,
                team_id=job.team_id,
                data={"class": "user_error"},
            )
        elif job.restart_count < job.max_restarts:
            job.restart_count += 1
            delay = _backoff(job.restart_count)
            job.state = Job.State.RESTARTING
            job.restart_after = now + timedelta(seconds=delay)
            checkpoint = latest_checkpoint(job.id)
            job.reason = (
                f"{reason}; restart {job.restart_count}/{job.max_restarts} in {delay:.0f}s from "
                + (f"checkpoint at step {checkpoint.step}" if checkpoint else "step 0")
            )
            record_event(EventKind.JOB_RESTARTING, job.reason, job=job, team_id=job.team_id)
        else:
            job.state, job.finished_at = Job.State.FAILED, now
            job.reason = f"{reason}; no restarts left ({job.max_restarts} used)"
            record_event(EventKind.JOB_FAILED, job.reason, job=job, team_id=job.team_id)
        job.save(update_fields=["state", "reason", "restart_count", "restart_after", "finished_at"])
        push_state(job)
        wake("attempt ended")
        return attempt


@transaction.atomic
def do_mark_attempt_running(attempt: Attempt, *, now: datetime) -> None:
    if not Attempt.objects.filter(pk=attempt.pk, state=Attempt.State.STARTING).update(
        state=Attempt.State.RUNNING, running_at=now
    ):
        return
    job = Job.objects.get(pk=attempt.job_id)
    if job.state == Job.State.STARTING:
        job.state = Job.State.RUNNING
        job.reason = f"attempt {attempt.number} running, all {world_size(attempt)} ranks up"
        job.save(update_fields=["state", "reason"])
        push_state(job)
    record_event(
        EventKind.ATTEMPT_RUNNING,
        f"attempt {attempt.number}: all {world_size(attempt)} ranks up",
        job=job,
        attempt=attempt,
        team_id=job.team_id,
    )
