"""The one transactional applier: commits each planned gang whole, or rejects it."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import datetime

from django.db import DatabaseError, transaction

from jobs.actions import ClaimConflict, do_grow_job, do_propose_preemption, do_start_attempts
from jobs.bulk import BATCH, bulk_set
from jobs.models import Job
from jobs.scheduling.vocab import Placement, Plan, WaitReason

log = logging.getLogger(__name__)

# Gangs claimed per set-based batch. A pass rarely places more, so it is usually one batch:
# about 16 queries for the whole pass, whatever its size.
CHUNK = 1000
REASON_READ_BATCH = 5000
REASON_VERIFY_S = 60.0


@dataclass
class ReasonMemo:
    """What the leader last read or wrote as each queued job's wait reason, start estimate and
    wait data, so that a row it already holds is not read back every pass: with 10,000 jobs
    queued that read was a seventh of the pass (bench/hollow.py, issue 20). Another writer may
    change a queued job's reason meanwhile (a requeue, a cancel that loses to the pass): the
    memo is trusted for at most `verify_s`, then every row is read again. One per leadership
    term (jobs/scheduling/loop.py); a pass without one reads every row."""

    verify_s: float = REASON_VERIFY_S
    rows: dict[int, tuple] = field(default_factory=dict)
    since: float = field(default_factory=time.monotonic)

    def unchanged(self, wanted: dict[int, tuple]) -> set[int]:
        """The jobs whose wanted row is the one the memo holds; forgets jobs no longer
        waiting, and everything once the memo is older than `verify_s`."""
        if time.monotonic() - self.since >= self.verify_s:
            self.rows, self.since = {}, time.monotonic()
        self.rows = {job_id: row for job_id, row in self.rows.items() if job_id in wanted}
        return {job_id for job_id, row in wanted.items() if self.rows.get(job_id) == row}


@dataclass
class ApplyResult:
    applied: dict[int, int] = field(default_factory=dict)  # job id -> attempt id
    rejected: dict[int, str] = field(default_factory=dict)  # job id -> why
    preemptions: list[int] = field(default_factory=list)  # PreemptionRequest ids
    grown: list[int] = field(default_factory=list)  # job ids told to stop and grow back
    reasons_written: int = 0  # queued jobs whose reason or start estimate changed
    reasons_deferred: int = 0  # left unread for the next pass (the write budget)
    reasons_s: float = 0.0  # of which the wait reasons' read and write


def apply_plan(
    plan: Plan,
    *,
    now: datetime,
    estimates: dict | None = None,
    chunk: int = CHUNK,
    memo: ReasonMemo | None = None,
    reason_budget_s: float | None = None,
) -> ApplyResult:
    """Apply a plan in one transaction; the placements in batches, each in a savepoint.

    A batch claims its gangs set-based (`jobs.actions.do_start_attempts`: a few queries per
    batch, not per gang) and rejects, alone, each gang that fails a check (the job was claimed
    elsewhere, a GPU is held, a node went down, the team's cap would be crossed). When a batch
    meets a concurrent change after its checks (a GPU claimed meanwhile by another scheduler
    hits the allocation index, a deadlock victim, a job that moved on), its savepoint rolls
    back and its halves are retried, down to one gang per savepoint: only the gang that lost
    the race is rejected. Rejected jobs stay queued and the next pass plans them again.
    Nothing here raises for a lost race. `chunk=1` applies gang by gang (the baseline).

    The wait reasons follow in a transaction of their own, once the placements are committed:
    they are advice, and 10,000 first reasons (a backlog arriving) took 2.5-3 s to write on a
    loaded database, which held the placements' locks and the pass that long. With
    `reason_budget_s` the write stops after that many seconds, the queue's head written first;
    the rest are written by the next passes (`reasons_deferred`).
    """
    result = ApplyResult()
    placements = list(plan.placements)
    with transaction.atomic():
        for start in range(0, len(placements), max(chunk, 1)):
            _apply_batch(placements[start : start + max(chunk, 1)], now, result)
    reasons_started = time.monotonic()
    try:
        with transaction.atomic():
            result.reasons_written, result.reasons_deferred = _write_reasons(
                plan, result, estimates or {}, memo, budget_s=reason_budget_s
            )
    except BaseException as exc:
        if memo is not None:
            memo.rows.clear()  # it may hold rows of the rolled-back write
        if not isinstance(exc, DatabaseError):
            raise
        # A lost race over advice (a deadlock with a requeue): the placements stand, and the
        # next pass, its memo cleared, reads and writes every reason again.
        log.warning("wait reasons not written this pass: %s", exc)
    finally:
        result.reasons_s = time.monotonic() - reasons_started
    # Outside the placement transaction: each proposal is its own small transaction, so a
    # victim that just ended is simply skipped.
    for preemption in plan.preemptions:
        try:
            request = do_propose_preemption(
                victim_id=preemption.victim_job_id,
                claimant_id=preemption.claimant_job_id,
                kind=preemption.kind,
                reason=preemption.reason,
                now=now,
            )
        except DatabaseError as exc:
            # A lost race (a deadlock victim, a serialization failure) takes only this
            # proposal, whole; the next pass plans it again, and the other proposals stand.
            log.warning("preemption of job %s not proposed: %s", preemption.victim_job_id, exc)
            continue
        if request is not None:
            result.preemptions.append(request.id)
    for grow in plan.grows:
        try:
            if do_grow_job(job_id=grow.job_id, gpus=grow.gpus, reason=grow.reason, now=now):
                result.grown.append(grow.job_id)
        except DatabaseError as exc:  # a lost race: the next pass decides again
            log.warning("job %s not grown: %s", grow.job_id, exc)
    if result.rejected:
        log.info("rejected placements: %s", result.rejected)
    return result


def _apply_batch(placements: list[Placement], now: datetime, result: ApplyResult) -> None:
    try:
        with transaction.atomic():
            started, rejected = do_start_attempts(placements, now=now)
    except (DatabaseError, ClaimConflict) as exc:
        # IntegrityError on the allocation index (a GPU taken concurrently), a deadlock victim
        # on PostgreSQL, or a job changed under us: the savepoint is rolled back, the whole
        # batch with it. Halve it until the gang that lost the race is alone.
        if len(placements) == 1:
            result.rejected[placements[0].job_id] = f"claim lost a race: {exc.__class__.__name__}"
            return
        log.info(
            "a batch of %d claims lost a race (%r); retrying it in halves", len(placements), exc
        )
        half = len(placements) // 2
        _apply_batch(placements[:half], now, result)
        _apply_batch(placements[half:], now, result)
        return
    result.applied.update((job_id, attempt.id) for job_id, attempt in started.items())
    result.rejected.update(rejected)


def _write_reasons(
    plan: Plan,
    result: ApplyResult,
    estimates: dict,
    memo: ReasonMemo | None = None,
    *,
    budget_s: float | None = None,
) -> tuple[int, int]:
    """Each queued job's wait reason (its text, and as data in Job.wait) and start estimate;
    only those that changed are written, in bulk, and only onto jobs still QUEUED (the
    condition is in the UPDATE itself, so a job that moved on meanwhile keeps its own reason).
    With a `memo`, rows it holds unchanged are not read back. With `budget_s`, batches are
    read and written in queue order (the rejected gangs first) until that many seconds have
    passed, at least one; a row left over is not remembered, so the next pass reads and
    writes it. Returns how many rows were written, and how many were left unread."""
    started = time.monotonic()
    reasons, waits = {}, {}
    for job_id, why in result.rejected.items():
        rejected = WaitReason("rejected", {"why": why})
        reasons[job_id], waits[job_id] = rejected.text(), rejected.to_json()
    for job_id, why in plan.reasons.items():  # the policy's order: the queue's
        if job_id not in reasons:
            wait = plan.waits.get(job_id)
            reasons[job_id], waits[job_id] = why, wait.to_json() if wait is not None else {}
    if not reasons:
        return 0, 0
    wanted = {}
    for job_id, why in reasons.items():
        start = estimates.get(job_id)
        if start is not None:
            why = f"{why}; est. start {start:%Y-%m-%d %H:%M} UTC"
        wanted[job_id] = (why[:500], start, waits.get(job_id, {}))
    held = memo.unchanged(wanted) if memo is not None else set()
    ids = [job_id for job_id in wanted if job_id not in held]
    # With a budget, read and write a batch at a time: reading a backlog's 10,000 rows before
    # the first write took most of a loaded pass by itself.
    chunk = REASON_READ_BATCH if budget_s is None else BATCH
    fields = ["reason", "estimated_start_at", "wait", "promised_start_at"]
    written = 0
    for offset in range(0, len(ids), chunk):
        if budget_s is not None and offset and time.monotonic() - started >= budget_s:
            return written, len(ids) - offset
        part = ids[offset : offset + chunk]
        changed, seen = [], []
        rows = Job.objects.filter(id__in=part, state=Job.State.QUEUED).values_list(
            "id", "reason", "estimated_start_at", "wait", "promised_start_at", "first_started_at"
        )
        for job_id, reason, start, wait, promised, first_started in rows:
            seen.append(job_id)
            # A job's first estimate before it ever started is its promise, kept as it was.
            keep = promised if promised is not None or first_started else wanted[job_id][1]
            row = (*wanted[job_id], keep)
            if row != (reason, start, wait, promised):
                changed.append((job_id, *row))
        written += bulk_set(Job, fields, changed, where={"state": Job.State.QUEUED})
        if memo is not None:
            # Read as it is, or written so (a job that left QUEUED meanwhile is not waiting
            # at the next pass, and is forgotten then).
            memo.rows.update((job_id, wanted[job_id]) for job_id in seen)
    return written, 0
