"""The one transactional applier: commits each planned gang whole, or rejects it."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime

from django.db import DatabaseError, transaction

from jobs.models import Job
from jobs.scheduling.policy import Plan

log = logging.getLogger(__name__)


@dataclass
class ApplyResult:
    applied: dict[int, int] = field(default_factory=dict)  # job id -> attempt id
    rejected: dict[int, str] = field(default_factory=dict)  # job id -> why
    preemptions: list[int] = field(default_factory=list)  # PreemptionRequest ids


def apply_plan(plan: Plan, *, now: datetime, estimates: dict | None = None) -> ApplyResult:
    """Apply a plan in one transaction; each placement in its own savepoint.

    A rejected placement (the job was claimed elsewhere, a GPU was taken, a node went down, the
    team's cap would be crossed) rolls back only its own savepoint; the job stays queued and the
    next pass plans it again. Nothing here raises for a lost race.
    """
    from jobs.actions import ClaimRejected, do_start_attempt

    result = ApplyResult()
    with transaction.atomic():
        for placement in plan.placements:
            try:
                with transaction.atomic():
                    attempt = do_start_attempt(placement, now=now)
                result.applied[placement.job_id] = attempt.id
            except ClaimRejected as exc:
                result.rejected[placement.job_id] = str(exc)
            except DatabaseError as exc:
                # IntegrityError on the allocation index (a GPU taken concurrently) or a
                # deadlock victim on PostgreSQL: the savepoint is rolled back, the gang with it.
                result.rejected[placement.job_id] = f"claim lost a race: {exc.__class__.__name__}"
        _write_reasons(plan, result, estimates or {})
    # Outside the placement transaction: each proposal is its own small transaction, so a
    # victim that just ended is simply skipped.
    from jobs.actions import do_propose_preemption

    for preemption in plan.preemptions:
        request = do_propose_preemption(
            victim_id=preemption.victim_job_id,
            claimant_id=preemption.claimant_job_id,
            kind=preemption.kind,
            reason=preemption.reason,
            now=now,
        )
        if request is not None:
            result.preemptions.append(request.id)
    if result.rejected:
        log.info("rejected placements: %s", result.rejected)
    return result


def _write_reasons(plan: Plan, result: ApplyResult, estimates: dict) -> None:
    reasons = dict(plan.reasons)
    for job_id, why in result.rejected.items():
        reasons[job_id] = f"placement rejected ({why}); retrying next pass"
    if not reasons:
        return
    current = {
        jid: (reason, start)
        for jid, reason, start in Job.objects.filter(
            id__in=reasons, state=Job.State.QUEUED
        ).values_list("id", "reason", "estimated_start_at")
    }
    for job_id, why in reasons.items():
        start = estimates.get(job_id)
        if start is not None:
            why = f"{why}; est. start {start:%Y-%m-%d %H:%M} UTC"
        why = why[:500]
        if job_id in current and current[job_id] != (why, start):
            # Conditional, so a reason never overwrites a job that moved on meanwhile.
            Job.objects.filter(id=job_id, state=Job.State.QUEUED).update(
                reason=why, estimated_start_at=start
            )
