"""Failure detectors run by the scheduler loop: hung attempts (and ranks that hang at exit
after rank 0 has finished) and stragglers."""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime, timedelta
from statistics import median

from jobs import actions
from jobs.conf import lockstep_setting
from jobs.event_kinds import EventKind
from jobs.health import StragglerVerdict, find_stragglers, progress_timeout, straggler_verdict
from jobs.models import Allocation, Attempt, Checkpoint, Event, MetricPoint
from jobs.queries import capacity_without, remaining_estimate, restart_costs


def attempt_progress_timeout(attempt: Attempt) -> float:
    times = list(
        MetricPoint.objects.filter(attempt=attempt, rank=0, name="step_time_s")
        .order_by("-step")
        .values_list("value", flat=True)[:200]
    )
    return progress_timeout(
        times, minimum=lockstep_setting("HANG_MIN_S"), factor=lockstep_setting("HANG_STEP_FACTOR")
    )


def detect_hangs(now: datetime, *, heard_since: datetime) -> None:
    """`heard_since`: when the portal could last start hearing progress (after an outage of its
    own, silence is counted from then, not from the last step)."""
    startup = lockstep_setting("STARTUP_PROGRESS_TIMEOUT_S")
    for attempt in Attempt.objects.filter(
        ended_at__isnull=True, state=Attempt.State.RUNNING, dump_requested_at__isnull=True
    ):
        if attempt.first_step_at is None:
            # No step reported (yet, or ever: a script that reports none): judged by what the
            # platform sees on its own, the ranks' output and CPU use (jobs/actions/activity.py).
            since = max(attempt.running_at, attempt.last_activity_at or attempt.running_at)
            waited = (now - max(since, heard_since)).total_seconds()
            if waited > startup:
                reason = (
                    f"hung: no output or CPU use for {waited:.0f}s and no step reported "
                    f"(timeout {startup:.0f}s)"
                    if attempt.last_activity_at
                    else f"no first step, output or CPU use {waited:.0f}s after all ranks "
                    f"came up (start-up timeout {startup:.0f}s)"
                )
                actions.do_request_stack_dump(attempt, now=now, reason=reason)
            continue
        silent = (now - max(attempt.last_progress_at, heard_since)).total_seconds()
        # The timeout is never under HANG_MIN_S: only an attempt silent longer than that
        # needs its step times read (one query each; every running attempt, every pass).
        if silent <= lockstep_setting("HANG_MIN_S"):
            continue
        timeout = attempt_progress_timeout(attempt)
        if silent > timeout:
            actions.do_request_stack_dump(
                attempt,
                now=now,
                reason=f"hung: no progress for {silent:.0f}s after step {attempt.last_step} "
                f"(timeout {timeout:.0f}s)",
            )
    wait = timedelta(seconds=lockstep_setting("DUMP_WAIT_S"))
    # Not one told to stop meanwhile (preempted, cancelled, drained in the dump's seconds):
    # ending it failed cut its checkpoint grace short, used a restart, and could fail the
    # job; its stop deadline ends it if it is truly stuck.
    for attempt in (
        Attempt.objects.filter(ended_at__isnull=True, dump_requested_at__lt=now - wait)
        .exclude(state=Attempt.State.STOPPING)
        .select_related("job")
    ):
        actions.do_end_hung_attempt(attempt, now=now)


def detect_exit_hangs(now: datetime) -> None:
    """Running attempts whose rank 0 exited 0 over EXIT_GRACE_S ago while other ranks still
    run, none failed: finished (`do_end_finished_attempt`), not hung. Before the hang
    detector, which would otherwise fail and restart a job that is done."""
    cutoff = now - timedelta(seconds=lockstep_setting("EXIT_GRACE_S"))
    done = Allocation.objects.filter(rank=0, exit_code=0, exited_at__lt=cutoff)
    for attempt in Attempt.objects.filter(
        ended_at__isnull=True,
        state=Attempt.State.RUNNING,
        pk__in=done.values("attempt_id"),
    ):
        codes = dict(attempt.allocations.values_list("rank", "exit_code"))
        if any(code not in (None, 0) for code in codes.values()):
            continue  # a failure: record_exits ends it as one
        lingering = sorted(rank for rank, code in codes.items() if code is None)
        if lingering:
            actions.do_end_finished_attempt(attempt, lingering=lingering, now=now)


def detect_stragglers(now: datetime) -> None:
    every = timedelta(seconds=lockstep_setting("STRAGGLER_CHECK_S"))
    window = lockstep_setting("STRAGGLER_WINDOW_STEPS")
    warmup = 5  # the first steps after a (re)start include compilation and bucket rebuilds
    for attempt in Attempt.objects.filter(
        ended_at__isnull=True, state=Attempt.State.RUNNING
    ).select_related("job"):
        if attempt.job.gpus < 2 or attempt.last_step - attempt.resumed_from_step < window + warmup:
            continue
        if attempt.straggler_checked_at and now - attempt.straggler_checked_at < every:
            continue
        Attempt.objects.filter(pk=attempt.pk).update(straggler_checked_at=now)
        compute: dict[int, list[float]] = defaultdict(list)
        for rank, value in MetricPoint.objects.filter(
            attempt=attempt,
            name="compute_s",
            step__gt=max(attempt.last_step - window, attempt.resumed_from_step + warmup),
        ).values_list("rank", "value"):
            compute[rank].append(value)
        flagged = find_stragglers(
            compute,
            factor=lockstep_setting("STRAGGLER_FACTOR"),
            min_excess=lockstep_setting("STRAGGLER_MIN_EXCESS_S"),
        )
        nodes = {
            a.rank: a.node
            for a in Allocation.objects.filter(attempt=attempt).select_related("node")
        }
        # One flag per node and attempt: two slow ranks of one node are one slow node (one
        # strike, one move), measured by its slowest rank. A node flagged before for this
        # attempt is not flagged again when another of its ranks slows.
        flagged_nodes = {nodes[r].id for r in attempt.stragglers if r in nodes}
        by_node: dict[int, list[tuple[int, float, float]]] = defaultdict(list)
        for flag in flagged:
            if nodes[flag[0]].id not in flagged_nodes:
                by_node[nodes[flag[0]].id].append(flag)
        for node_flags in by_node.values():
            rank, own, rest = max(node_flags, key=lambda flag: flag[1])
            node = nodes[rank]
            actions.do_flag_straggler(
                attempt,
                rank=rank,
                ranks=[flag[0] for flag in node_flags],
                node=node,
                seconds=own,
                gang_seconds=rest,
                window=window,
                now=now,
                verdict=_verdict(attempt, node, own - rest, now=now),
                node_ranks=sum(1 for n in nodes.values() if n.id == node.id),
            )


def _verdict(attempt: Attempt, node, excess_s: float, *, now: datetime) -> StragglerVerdict:
    """The straggler's cost to the job against a restart's, from what was measured."""
    step_times = list(
        MetricPoint.objects.filter(attempt=attempt, rank=0, name="step_time_s")
        .order_by("-step")
        .values_list("value", flat=True)[: lockstep_setting("STRAGGLER_WINDOW_STEPS")]
    )
    remaining, _basis = remaining_estimate(attempt.job, now=now)
    saves = list(
        Checkpoint.objects.filter(job_id=attempt.job_id, save_s__gt=0).values_list(
            "save_s", flat=True
        )
    )
    restart = restart_costs([attempt.job_id])[attempt.job_id] + (median(saves) if saves else 0.0)
    moved = Event.objects.filter(
        job_id=attempt.job_id, kind=EventKind.ATTEMPT_STRAGGLER, data__moved=True
    ).count()
    return straggler_verdict(
        excess_s=excess_s,
        step_time_s=median(step_times) if step_times else excess_s,
        remaining_s=remaining,
        restart_s=restart,
        spare=capacity_without(attempt, node),
        moves_left=moved < lockstep_setting("STRAGGLER_MAX_MOVES"),
    )
