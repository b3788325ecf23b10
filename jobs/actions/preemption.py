"""Preemption: proposals, decisions, checkpoint-first execution, growing a shrunk elastic job
back, and withdrawing proposals whose claimant no longer waits."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.db import transaction

from jobs.actions.attempts import GROW_REASON
from jobs.actions.base import begin_stop, lock_job_for_stop, push_state, record_event, wake
from jobs.conf import lockstep_setting
from jobs.event_kinds import EventKind
from jobs.models import (
    Attempt,
    Event,
    Job,
    PreemptionRequest,
)
from jobs.queries import (
    SAFETY_WINDOW,
    latest_checkpoint,
    recent_preemptions,
    teams_with_usage,
    world_size,
)
from teams.models import Team


def do_propose_preemption(
    *, victim_id: int, claimant_id: int, kind: str, reason: str, now: datetime
) -> PreemptionRequest | None:
    """Record a planned preemption; reclaims and starvation claims are approved and carried
    out at once, priority preemptions wait for an admin or for their auto-approve deadline.
    None if the victim already has an open request or is no longer running."""
    with transaction.atomic():
        victim, _ = lock_job_for_stop(victim_id)
        if victim.state not in (Job.State.STARTING, Job.State.RUNNING):
            return None
        if PreemptionRequest.objects.filter(
            victim=victim, state__in=PreemptionRequest.OPEN
        ).exists():
            return None
        if _at_safety_stop(victim, now):
            return None
        since = (
            latest_checkpoint(victim.id).created_at
            if latest_checkpoint(victim.id)
            else (victim.first_started_at or now)
        )
        request = PreemptionRequest.objects.create(
            victim=victim,
            claimant_id=claimant_id,
            kind=kind,
            reason=reason[:500],
            created_at=now,
            work_at_risk_s=max((now - since).total_seconds(), 0.0),
            auto_approve_at=None
            if kind in PreemptionRequest.AUTOMATIC
            else now + timedelta(seconds=lockstep_setting("PREEMPTION_APPROVAL_DELAY_S")),
        )
        record_event(
            EventKind.PREEMPTION_PROPOSED,
            f"{kind} preemption of job {victim.id} proposed for job {claimant_id}: {reason}",
            job=victim,
            team_id=victim.team_id,
            data={"request": request.id, "claimant": claimant_id, "kind": kind},
        )
        if kind in PreemptionRequest.AUTOMATIC:
            # Reclaims are automatic: lent GPUs go back to their owner without asking anyone;
            # so are starvation claims (they take no team below its quota).
            # In the proposal's transaction: a reclaim has no approval deadline, so one left
            # proposed (its approval a deadlock victim) would block every later proposal for
            # this victim and never be carried out. Rolled back whole, the next pass proposes
            # it again.
            do_decide_preemption(request, approve=True, actor=None, now=now)
    return request


def _at_safety_stop(victim: Job, now: datetime) -> bool:
    """The live scheduler's safety stop (jobs.scheduling.protection, rule 4), here as well as
    in the policy so that no planner, however wrong, can loop: a job preempted
    PREEMPT_MAX_PER_DAY times within a day is not preempted again. The first refusal of a day
    raises an admin alert (an Event the console shows), not one per pass."""
    limit = int(lockstep_setting("PREEMPT_MAX_PER_DAY"))
    count = recent_preemptions([victim.id], now=now).get(victim.id, 0)
    if limit <= 0 or count < limit:
        return False
    alerted = Event.objects.filter(
        kind=EventKind.PREEMPTION_SAFETY_STOP, job=victim, created_at__gte=now - SAFETY_WINDOW
    ).exists()
    if not alerted:
        record_event(
            EventKind.PREEMPTION_SAFETY_STOP,
            f"job {victim.id} was preempted {count} times within a day; the scheduler will not "
            "preempt it again for now. The policy would be in a preemption loop: look at what "
            "claims it (Preemptions page) and at the teams' quotas.",
            job=victim,
            team_id=victim.team_id,
            data={"preemptions": count, "limit": limit},
        )
    return True


def do_decide_preemption(
    request: PreemptionRequest, *, approve: bool, actor, now: datetime
) -> PreemptionRequest:
    with transaction.atomic():
        request = PreemptionRequest.objects.select_for_update(no_key=True).get(pk=request.pk)
        if request.state != PreemptionRequest.State.PROPOSED:
            return request
        request.state = (
            PreemptionRequest.State.APPROVED if approve else PreemptionRequest.State.REJECTED
        )
        request.decided_by, request.decided_at = actor, now
        request.save(update_fields=["state", "decided_by", "decided_at"])
        who = (
            actor.username
            if actor
            else (
                f"automatic ({request.kind})"
                if request.kind in PreemptionRequest.AUTOMATIC
                else "automatic (approval deadline passed)"
            )
        )
        record_event(
            EventKind(f"preemption.{request.state}"),
            f"preemption of job {request.victim_id} for job {request.claimant_id} "
            f"{request.state} by {who}",
            job_id=request.victim_id,
            actor=actor,
            data={"request": request.id},
        )
        if approve:
            _execute_preemption(request, now=now)
        else:
            wake("preemption rejected")
    return request


def _execute_preemption(request: PreemptionRequest, *, now: datetime) -> None:
    victim, attempt = lock_job_for_stop(request.victim_id)
    # A proposal waits up to the approval delay: what the plan saw then may be gone. Carried
    # out blindly, it requeued a job cancelled (or timed out) meanwhile, which then ran again,
    # and stopped a job whose team had fallen back within its quota for another team's
    # borrowing (invariant 6).
    stale = _no_longer_takable(request, victim, attempt)
    if stale:
        _withdraw(request, why=stale, now=now)
        return
    request.state, request.executed_at = PreemptionRequest.State.EXECUTED, now
    request.save(update_fields=["state", "executed_at"])
    why = f"preempted ({request.kind}) for job {request.claimant_id}: {request.reason}"
    stop_to_requeue(
        victim,
        attempt,
        why=why,
        now=now,
        kind=EventKind.JOB_PREEMPTING,
        data={"request": request.id, "kind": request.kind},
    )


def _no_longer_takable(request: PreemptionRequest, victim: Job, attempt: Attempt | None) -> str:
    """Why the request may not be carried out now ("" if it may): the victim no longer runs,
    the claimant no longer waits, or a victim of another team is no longer beyond its team's
    quota (its GPUs guaranteed again) while the claimant would borrow. The victim is locked;
    the counts are read now."""
    if victim.state not in (Job.State.RUNNING, Job.State.STARTING) or attempt is None:
        return f"job {victim.id} no longer runs ({victim.state.lower()})"
    if attempt.state == Attempt.State.STOPPING:
        return f"job {victim.id} is already stopping ({attempt.end_reason})"
    claimant = Job.objects.only("state", "team_id", "gpus").get(pk=request.claimant_id)
    if claimant.state != Job.State.QUEUED:
        return f"job {request.claimant_id} no longer waits"
    if victim.team_id == claimant.team_id or request.kind == PreemptionRequest.Kind.BACKFILL:
        return ""
    teams = {
        t.id: t
        for t in teams_with_usage(Team.objects.filter(pk__in=[victim.team_id, claimant.team_id]))
    }
    mine = teams[claimant.team_id]
    if request.kind == PreemptionRequest.Kind.PRIORITY and mine.used + claimant.gpus <= mine.quota:
        return ""  # a claimant within its own quota borrows nothing (victims.py: any lower work)
    team = teams[victim.team_id]
    beyond = team.used - team.quota
    # A reclaim may take the job that straddles its team's quota (victims.py); the others
    # take only work wholly beyond it.
    needed = 1 if request.kind == PreemptionRequest.Kind.RECLAIM else world_size(attempt)
    if beyond < needed:
        return f"team {team.name} is within its quota again ({team.used} of {team.quota} GPUs)"
    return ""


def _withdraw(request: PreemptionRequest, *, why: str, now: datetime) -> bool:
    """Withdraw a proposal that is still open, with its Event; False if it was decided
    meanwhile (the state is part of the update, so an executed request stays executed)."""
    undecided = (PreemptionRequest.State.PROPOSED, PreemptionRequest.State.APPROVED)
    changed = PreemptionRequest.objects.filter(pk=request.pk, state__in=undecided).update(
        state=PreemptionRequest.State.WITHDRAWN, decided_at=now
    )
    if not changed:
        return False
    request.state = PreemptionRequest.State.WITHDRAWN
    record_event(
        EventKind.PREEMPTION_WITHDRAWN,
        f"preemption of job {request.victim_id} for job {request.claimant_id} withdrawn: {why}",
        job_id=request.victim_id,
        data={"request": request.id},
    )
    wake("preemption withdrawn")
    return True


def withdraw_open_preemptions_of(job: Job, *, why: str, now: datetime) -> None:
    """A job that ends (cancelled, timed out) is nobody's victim any more: its open proposals
    go, so an admin's queue holds only what could still be carried out."""
    # SKIP LOCKED: the caller holds the job's attempt and row, and an approval being decided
    # holds its request and waits for them (request -> attempt -> job); waiting here for the
    # request deadlocked with it. The approval re-checks the victim once it has the job, and
    # withdraws itself then (`_no_longer_takable`).
    for request in PreemptionRequest.objects.select_for_update(
        skip_locked=True, no_key=True
    ).filter(victim_id=job.id, state=PreemptionRequest.State.PROPOSED):
        _withdraw(request, why=why, now=now)


def stop_to_requeue(
    job: Job,
    attempt: Attempt,
    *,
    why: str,
    now: datetime,
    kind: str,
    data: dict,
    message=None,
    grace_s: float | None = None,
) -> None:
    """Checkpoint-and-stop the job's live attempt; the job is requeued when it exits
    (`do_end_attempt`). `message` is the Event's text (default: the job's new reason). A job
    that has ended (cancelled while this was decided) is left as it is: requeued, it ran
    again."""
    if job.is_terminal:
        return
    begin_stop(attempt, now=now, reason=why, grace_s=grace_s)
    job.state, job.reason = Job.State.PREEMPTING, f"checkpointing and stopping: {why}"
    job.save(update_fields=["state", "reason"])
    record_event(kind, message or job.reason, job=job, team_id=job.team_id, data=data)
    push_state(job)


def do_grow_job(*, job_id: int, gpus: int, reason: str, now: datetime) -> bool:
    """Scheduling rule 8 carried out: checkpoint-and-stop a running elastic job that runs on
    fewer GPUs than it asked for, so that it is requeued and restarts at its full size from
    that checkpoint. False (nothing changed) if it no longer runs shrunk."""
    with transaction.atomic():
        job, attempt = lock_job_for_stop(job_id)
        if (
            job.state != Job.State.RUNNING
            or attempt is None
            or attempt.state != Attempt.State.RUNNING
            or world_size(attempt) >= job.gpus
        ):
            return False
        why = f"{GROW_REASON} {gpus} GPUs ({reason})"
        held = world_size(attempt)
        stop_to_requeue(
            job,
            attempt,
            why=why,
            now=now,
            kind=EventKind.JOB_GROWING,
            data={"from_gpus": held, "to_gpus": gpus},
            message=f"attempt {attempt.number} runs on {held} of {job.gpus} GPUs; {why}",
        )
    return True


@transaction.atomic
def do_withdraw_stale_preemptions(*, now: datetime) -> None:
    """Proposals whose claimant no longer waits (started, cancelled) are withdrawn, each with
    its Event (atomic: a crash between the two lost the Event)."""
    for request in PreemptionRequest.objects.filter(state=PreemptionRequest.State.PROPOSED).exclude(
        claimant__state=Job.State.QUEUED
    ):
        # Only while still proposed: an admin's concurrent approval is not overwritten.
        _withdraw(request, why=f"job {request.claimant_id} no longer waits", now=now)
