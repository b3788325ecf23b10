"""The scheduler process: housekeeping, snapshot, plan, apply; woken by events or a tick."""

from __future__ import annotations

import gc
import logging
import signal
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import redis
from django.core.cache import cache
from django.db import close_old_connections
from django.db.models import Max, Min, Q
from django.utils import timezone

from jobs import actions, metric_store, queries
from jobs.conf import lockstep_setting
from jobs.models import Attempt, Job, Node, PreemptionRequest
from jobs.reports.reclaim import open_overdue, reclaim_bound_s
from jobs.scheduling.apply import ApplyResult, ReasonMemo, apply_plan
from jobs.scheduling.detect import detect_exit_hangs, detect_hangs, detect_stragglers
from jobs.scheduling.estimate import estimate_starts, head_of_queue
from jobs.scheduling.estimator import Estimator
from jobs.scheduling.leader import LeaderLease
from jobs.scheduling.owed import Overdue, OwedClocks, drained_for_gangs, lending, owed_jobs
from jobs.scheduling.policy import plan
from jobs.scheduling.reader import QueueMemo, UsageMemo, take_snapshot
from jobs.scheduling.wake import subscriber, wake_scheduler

log = logging.getLogger("lockstep.scheduler")


@dataclass
class PassReport:
    applied: int
    rejected: int
    queued: int
    seconds: float
    # Seconds per phase (housekeeping, snapshot, plan, estimates, apply, reasons): where a slow
    # pass went (bench/hollow.py reads them back from the cache).
    phases: dict[str, float] = field(default_factory=dict)
    reasons_deferred: int = 0  # wait reasons left for the next pass (its write budget)
    housekeeping: dict[str, float] = field(default_factory=dict)  # seconds per chore


class HeartbeatIntake:
    """Tells a silent node from a portal that could not listen.

    When no node at all has been heard from for a while, the portal (or its database) was down
    or restarting, not every node at once: no node is declared lost then, and once heartbeats
    flow again every node gets a full timeout from that moment. A newly started scheduler
    likewise gives every node a full timeout before judging it.
    """

    def __init__(self, started: datetime):
        self.resumed_at = started
        self.was_down = False

    def observe(self, newest: datetime | None, now: datetime) -> bool:
        timeout = lockstep_setting("HEARTBEAT_TIMEOUT_S")
        gap = min(timeout / 2, max(3 * lockstep_setting("HEARTBEAT_S"), 5.0))
        if newest is None or (now - newest).total_seconds() > gap:
            self.was_down = True
            return False
        if self.was_down:
            log.info("heartbeats flow again; every node gets a full timeout from now")
            self.resumed_at, self.was_down = now, False
        return True


intake = HeartbeatIntake(timezone.now())


def detect_lost_nodes(now: datetime) -> bool:
    """Mark silent nodes down; False when the portal itself was not hearing anyone."""
    live = Node.objects.exclude(state=Node.State.DOWN)
    if not intake.observe(live.aggregate(newest=Max("last_heartbeat_at"))["newest"], now):
        return False
    timeout = lockstep_setting("HEARTBEAT_TIMEOUT_S")
    cutoff = now - timedelta(seconds=timeout)
    if intake.resumed_at > cutoff:
        return True
    for node in live.filter(last_heartbeat_at__lt=cutoff):
        age = (now - node.last_heartbeat_at).total_seconds()
        actions.do_mark_node_lost(node, now=now, reason=f"no heartbeat for {age:.0f}s")
    return True


def housekeeping(now, parts: dict[str, float] | None = None) -> None:
    """Time-driven transitions: lost nodes, restart backoffs, start and stop deadlines.
    `parts`, if given, gets the seconds each step took (the pass report's `housekeeping`)."""
    mark = time.monotonic()

    def part(name: str) -> None:
        nonlocal mark
        if parts is not None:
            parts[name] = round(time.monotonic() - mark, 4)
        mark = time.monotonic()

    hearing = detect_lost_nodes(now)
    part("lost_nodes")
    for job in Job.objects.filter(state=Job.State.RESTARTING, restart_after__lte=now):
        actions.do_requeue_job(job, now=now)
    part("requeue")
    limited = list(
        Job.objects.filter(time_limit_s__isnull=False, first_started_at__isnull=False)
        .exclude(state__in=Job.TERMINAL)
        .only("id", "time_limit_s")
    )
    # The run time of them all in one query; the action (a lock and a transaction each, which
    # were most of housekeeping with ~190 gangs running) only for those at their limit, where
    # it checks again under the lock.
    ran = queries.run_seconds([job.id for job in limited], now=now)
    for job in limited:
        if ran.get(job.id, 0.0) >= job.time_limit_s:
            actions.do_enforce_time_limit(job, now=now)
    part("time_limits")
    detect_exit_hangs(now)
    part("exit_hangs")
    if hearing:
        detect_hangs(now, heard_since=intake.resumed_at)
    part("hangs")
    actions.do_withdraw_stale_preemptions(now=now)
    # Reclaims have no approval deadline: one still proposed was left by a proposal that
    # committed before its approval failed (code before reclaims were proposed and approved
    # in one transaction); carry it out now.
    for request in PreemptionRequest.objects.filter(
        Q(auto_approve_at__lte=now) | Q(kind__in=PreemptionRequest.AUTOMATIC),
        state=PreemptionRequest.State.PROPOSED,
    ):
        actions.do_decide_preemption(request, approve=True, actor=None, now=now)
    part("preemptions")
    detect_stragglers(now)
    part("stragglers")
    start_cutoff = now - timedelta(seconds=lockstep_setting("START_TIMEOUT_S"))
    for attempt in Attempt.objects.filter(
        ended_at__isnull=True, state=Attempt.State.STARTING, created_at__lt=start_cutoff
    ):
        if attempt.created_at + timedelta(seconds=attempt.pull_s or 0.0) >= start_cutoff:
            continue  # its image pull does not count against its start: that comes after
        actions.do_end_attempt(
            attempt,
            state=Attempt.State.FAILED,
            now=now,
            reason="start timeout: not every rank came up",
        )
    for attempt in Attempt.objects.filter(
        ended_at__isnull=True,
        state=Attempt.State.STOPPING,
        stop_deadline__lt=now - timedelta(seconds=10),
    ):
        actions.do_end_attempt(
            attempt,
            state=queries.stopped_state(attempt.job),
            now=now,
            reason="stop deadline passed; workers killed",
        )
    part("deadlines")


def run_pass(
    now=None,
    memo: ReasonMemo | None = None,
    estimator: Estimator | None = None,
    usage: UsageMemo | None = None,
    queue: QueueMemo | None = None,
    owed: OwedClocks | None = None,
) -> tuple[PassReport, ApplyResult]:
    """One scheduling pass: housekeeping, snapshot, plan, estimates, apply. The loop passes
    its leadership term's `memo` of written wait reasons (apply.ReasonMemo), its `estimator`
    (jobs/scheduling/estimator.py: estimates beside the pass once they are slow) and its
    `usage` memo of fair-share history (reader.UsageMemo) and its `queue` memo of the queued
    jobs' rows (reader.QueueMemo); without them the pass reads and works everything out
    itself. With the term's `owed` clocks it also times the jobs their team's quota owes
    GPUs (jobs/scheduling/owed.py) and writes an Event for each past the reclaim bound."""
    collecting = gc.isenabled()
    gc.disable()  # the leader collects after the pass instead (_collect_between_passes)
    try:
        return _pass(now, memo, estimator, usage, queue, owed)
    finally:
        if collecting:
            gc.enable()


def _collect_between_passes() -> None:
    """The garbage collector's work, between passes rather than during them. A pass builds a
    view of every queued job (10,000 at the target's size), and the automatic collector ran
    several full collections in the middle of it: 0.05-0.13 s of a 0.3 s snapshot and plan
    (docs/production.md, "The pass without the collector's pauses"; bench/pass_collector.py).
    Paused for the pass, one collection after it
    does the same work where the scheduler would wait anyway; what the term's first pass
    left (the platform's code and settings) is frozen out of every later collection."""
    gc.collect()
    if not gc.get_freeze_count():
        gc.freeze()


def _pass(now, memo, estimator, usage, queue, owed=None) -> tuple[PassReport, ApplyResult]:
    started = time.monotonic()
    phases, mark = {}, started

    def phase(name: str) -> None:
        nonlocal mark
        phases[name], mark = round(time.monotonic() - mark, 4), time.monotonic()

    now = now or timezone.now()
    chores: dict[str, float] = {}
    housekeeping(now, chores)
    phase("housekeeping")
    snapshot = take_snapshot(now, usage, queue)
    phase("snapshot")
    decided = plan(snapshot)
    phase("plan")
    grace = lockstep_setting("STOP_GRACE_S")
    delay = lockstep_setting("PREEMPTION_APPROVAL_DELAY_S")
    if not decided.reasons:
        estimates = {}
    elif estimator is not None:
        estimates = estimator.estimates(
            snapshot,
            stop_grace_s=grace,
            approval_delay_s=delay,
            plan_s=phases["plan"],
            order=decided.order,
        )
    else:
        estimates = estimate_starts(
            head_of_queue(snapshot, order=decided.order),
            stop_grace_s=grace,
            approval_delay_s=delay,
        )
    phase("estimates")
    result = apply_plan(
        decided,
        now=now,
        estimates=estimates,
        memo=memo,
        reason_budget_s=lockstep_setting("REASON_WRITE_S"),
    )
    phase("apply")
    if owed is not None:
        time_owed(owed, snapshot, result, now)
        phase("owed")
    # The wait reasons' share of apply, as a phase of its own (gangs placed, then advice).
    phases["reasons"] = round(min(result.reasons_s, phases["apply"]), 4)
    phases["apply"] = round(phases["apply"] - phases["reasons"], 4)
    report = PassReport(
        len(result.applied),
        len(result.rejected),
        len(snapshot.queued),
        time.monotonic() - started,
        phases,
        result.reasons_deferred,
        chores,
    )
    record_pass(report, now)
    return report, result


def time_owed(clocks: OwedClocks, snapshot, result: ApplyResult, now: datetime) -> None:
    """The pass's owed jobs (less those it started) on the term's clocks; an Event for each
    clock that ran past the reclaim bound and for each overdue one that ended. A failure here
    is logged, not raised: the pass has been applied, and its report must still go out."""
    try:
        owed = {j: t for j, t in owed_jobs(snapshot).items() if j not in result.applied}
        newly, ended = clocks.update(owed, now, lent=lending(snapshot))
        if newly:
            gangs = drained_for_gangs(snapshot)
            for overdue in newly:
                actions.do_note_quota_overdue(overdue, bound_s=clocks.bound_s, gangs=gangs, now=now)
        for overdue in ended:
            actions.do_note_quota_overdue_ended(overdue)
    except Exception:
        log.exception("timing the jobs their team's quota owes failed; scheduling goes on")


def owed_clocks(now: datetime | None = None) -> OwedClocks:
    """A leadership term's owed clocks, held to the bound of a reclaim (the stop grace plus
    one tick): a job its team's quota owes GPUs waits no longer than a reclaim's claimant.
    They take over the overdue waits the last term left open (a restart or a new leader),
    which the first pass continues or ends, so none stays open in the report for ever and
    none is alerted twice."""
    clocks = OwedClocks(bound_s=reclaim_bound_s(PreemptionRequest.Kind.RECLAIM))
    left = open_overdue(now or timezone.now())
    clocks.adopt([Overdue(job_id, team_id, since) for job_id, team_id, _, since in left])
    return clocks


LAST_PASS_KEY = "lockstep:scheduler:last_pass"
# The next pass's wait while wait reasons are left over: soon, but not back to back, so the
# portal and the agents get the database between passes.
REASON_CATCH_UP_S = 1.0


def record_pass(report: PassReport, now: datetime) -> None:
    """Leave the pass's duration in the shared cache (Redis) for the portal's /metrics: the
    scheduler is another process, and a table for one row a second would be overkill."""
    try:
        cache.set(
            LAST_PASS_KEY,
            {
                "seconds": report.seconds,
                "at": now.timestamp(),
                "queued": report.queued,
                "phases": report.phases,
                "housekeeping": report.housekeeping,
            },
            timeout=None,
        )
    except Exception as exc:  # metrics are best effort; a cache outage must not stop a pass
        log.warning("could not record the pass time (%s)", exc)


def run_forever(*, tick_s: float | None = None, once: bool = False) -> None:
    tick_s = tick_s or lockstep_setting("SCHEDULER_TICK_S")
    pubsub = None
    # Long enough that a busy pass and the tick never let it lapse while the leader lives.
    lease = LeaderLease(ttl_s=max(lockstep_setting("SCHEDULER_LEASE_S"), 3 * tick_s))
    log.info("scheduler loop started (tick %.1fs, lease %.0f ms)", tick_s, lease.ttl_ms)
    # SIGTERM (systemd, Kubernetes, `make up`'s Ctrl-C) unwinds through `finally`, so a stopped
    # scheduler hands the lease over at once instead of leaving a standby waiting out the TTL.
    main = threading.current_thread() is threading.main_thread()  # signals: main thread only
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) if main else None
    try:
        _loop(lease, tick_s, once, pubsub)
    finally:
        lease.release()
        if main:
            signal.signal(signal.SIGTERM, previous)


def _exit_on_sigterm(signum, frame):
    raise SystemExit(0)


def _estimator() -> Estimator:
    return Estimator(
        inline_s=lockstep_setting("ESTIMATE_INLINE_S"),
        every_s=lockstep_setting("ESTIMATE_EVERY_S"),
        on_ready=lambda: wake_scheduler("start estimates ready"),
    )


def _loop(lease, tick_s: float, once: bool, pubsub) -> None:
    memo, estimator, usage, queue = ReasonMemo(), _estimator(), UsageMemo(), QueueMemo()
    try:
        _lead(lease, tick_s, once, pubsub, memo, estimator, usage, queue, None)
    finally:
        estimator.close()


def _lead(lease, tick_s: float, once: bool, pubsub, memo, estimator, usage, queue, owed) -> None:
    while True:
        close_old_connections()
        if not lease.acquire_or_renew():
            if once:
                raise SystemExit(f"another scheduler leads ({lease.holder()}); no pass run")
            # Another leader writes meanwhile: a new term reads afresh.
            memo, usage, queue, owed = ReasonMemo(), UsageMemo(), QueueMemo(), None
            pubsub = _wait_for_wake(pubsub, tick_s)
            continue
        wait_s = None
        try:
            if owed is None:  # a term's first pass: the clocks the last term left, taken over
                owed = owed_clocks()
            report, _ = run_pass(
                memo=memo,
                estimator=None if once else estimator,
                usage=usage,
                queue=queue,
                owed=owed,
            )
            if report.reasons_deferred:
                wait_s = REASON_CATCH_UP_S  # a backlog's reasons: written over the next passes
            if report.applied or report.rejected:
                log.info(
                    "pass: %d placed, %d rejected, %d queued, %.3fs",
                    report.applied,
                    report.rejected,
                    report.queued,
                    report.seconds,
                )
        except Exception:  # one bad pass must not stop the loop; the next one retries
            log.exception("scheduler pass failed")
        _collect_between_passes()
        try:
            # The leader's chore, every few minutes: raw metric partitions made ahead, those
            # past the retention dropped (jobs/metric_store.py).
            metric_store.maintain(timezone.now())
        except Exception:
            log.exception("metric storage maintenance failed")
        if once:
            return
        pubsub = _wait_for_wake(pubsub, _next_wait(min(tick_s, wait_s or tick_s)))


def _next_wait(tick_s: float) -> float:
    """Sleep until the tick, or until a restart's backoff ends if that comes first."""
    due = Job.objects.filter(state=Job.State.RESTARTING).aggregate(due=Min("restart_after"))["due"]
    if due is None:
        return tick_s
    return min(tick_s, max((due - timezone.now()).total_seconds(), 0.05))


def _wait_for_wake(pubsub, tick_s: float):
    """Block until a wake message or the tick; drain extra wakes so a burst costs one pass."""
    try:
        if pubsub is None:
            pubsub = subscriber()
        deadline = time.monotonic() + tick_s
        while (left := deadline - time.monotonic()) > 0:
            message = pubsub.get_message(timeout=left)
            if message is not None:
                time.sleep(0.05)  # coalesce a burst of wakes
                while pubsub.get_message(timeout=0.01) is not None:
                    pass
                break
        return pubsub
    except redis.RedisError as exc:
        log.warning("wake channel unavailable (%s); ticking only", exc)
        time.sleep(tick_s)
        return None
