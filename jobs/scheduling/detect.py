"""Failure detectors run by the scheduler loop: hung attempts and stragglers."""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime, timedelta

from jobs import actions
from jobs.conf import lockstep_setting
from jobs.health import find_stragglers, progress_timeout
from jobs.models import Allocation, Attempt, MetricPoint


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
        timeout = attempt_progress_timeout(attempt)
        silent = (now - max(attempt.last_progress_at, heard_since)).total_seconds()
        if silent > timeout:
            actions.do_request_stack_dump(
                attempt,
                now=now,
                reason=f"hung: no progress for {silent:.0f}s after step {attempt.last_step} "
                f"(timeout {timeout:.0f}s)",
            )
    wait = timedelta(seconds=lockstep_setting("DUMP_WAIT_S"))
    for attempt in Attempt.objects.filter(
        ended_at__isnull=True, dump_requested_at__lt=now - wait
    ).select_related("job"):
        actions.do_end_hung_attempt(attempt, now=now)


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
        for rank, own, rest in flagged:
            actions.do_flag_straggler(
                attempt,
                rank=rank,
                node=nodes[rank],
                seconds=own,
                gang_seconds=rest,
                window=window,
                now=now,
            )
