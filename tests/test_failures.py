"""Detection and response (DESIGN.md section 8) through the real actions and scheduler pass:
a running attempt that stops making progress (hangs, judged by steps, output, CPU and GPU
use; no first step after start-up) and how an attempt ends once rank 0 is done. The same
paths run with real processes in test_e2e_faults.py.

The rest of the failure tests, a file per concept:
- tests/test_failures_stacks.py: a hang's stacks and flight recorders name the rank, and the
  node, it is at;
- tests/test_failures_nodes.py: whose fault a failure is (stragglers, strikes and cordoning,
  user errors), nodes lost or restarting (a portal outage, agent restarts, planned restarts),
  admins' cordon and drain, rendezvous ports;
- tests/test_failures_checkpoints.py: which checkpoints are taken, recovered and kept
  (retention, the rq worker's prunes), Young/Daly, goodput and the teams API.
Their shared helpers are in tests/failures_helpers.py."""

from datetime import timedelta

import pytest
from django.utils import timezone

from jobs.health import progress_timeout
from jobs.models import Event, Job, LogChunk
from jobs.scheduling.loop import run_pass
from tests.failures_helpers import _run, _steps
from tests.heartbeats import beat, live_attempt


def test_progress_timeout_adapts_to_the_jobs_step_time():
    assert progress_timeout([], minimum=60, factor=10) == 60
    assert progress_timeout([0.05] * 100, minimum=60, factor=10) == 60
    slow = [30.0] * 95 + [45.0] * 5
    assert progress_timeout(slow, minimum=60, factor=10) == 300.0  # p95 = 30 s


@pytest.mark.django_db
def test_hang_is_detected_stacks_are_captured_then_the_job_restarts(setup, settings):
    settings.LOCKSTEP = {**settings.LOCKSTEP, "HANG_MIN_S": 20.0, "DUMP_WAIT_S": 3.0}
    job, attempt, a, b, _ = _run(setup)
    t0 = timezone.now()
    beat(a, attempt, {0: None, 1: None}, records=_steps(1, 10), now=t0)
    for t in (10, 19):  # heartbeats keep coming: the agent is alive, the job is not moving
        beat(a, attempt, {0: None, 1: None}, now=t0 + timedelta(seconds=t))
        beat(b, attempt, {2: None, 3: None}, now=t0 + timedelta(seconds=t))
        run_pass(now=t0 + timedelta(seconds=t))
    assert live_attempt(job).dump_requested_at is None
    t = t0 + timedelta(seconds=21)
    beat(a, attempt, {0: None, 1: None}, now=t)
    beat(b, attempt, {2: None, 3: None}, now=t)
    run_pass(now=t)
    attempt.refresh_from_db()
    assert attempt.dump_requested_at == t and "no progress for 21s after step 10" in (
        attempt.end_reason
    )
    assert [d["action"] for d in beat(a, attempt, {0: None, 1: None}, now=t)["desired"]] == ["dump"]
    dump = 'Thread 0x00007f (most recent call first):\n  File "train.py", line 9 in step\n'
    LogChunk.objects.create(attempt=attempt, rank=0, text="step 10\n" + dump, created_at=t)
    later = t + timedelta(seconds=4)
    beat(a, attempt, {0: None, 1: None}, now=later)
    beat(b, attempt, {2: None, 3: None}, now=later)
    run_pass(now=later)
    attempt.refresh_from_db()
    assert attempt.state == "failed" and "stacks from 1 of 4 ranks" in attempt.end_reason
    event = Event.objects.get(attempt=attempt, kind="attempt.failed")
    assert event.data["stacks"] == {"0": dump}
    assert event.data["detect_s"] == pytest.approx(25, abs=1)  # since the last progress
    assert Job.objects.get(pk=job.pk).state == "RESTARTING"


@pytest.mark.django_db
def test_the_hang_detector_reads_step_times_only_of_attempts_silent_past_the_minimum(
    setup, settings
):
    """Every pass looks at every running attempt; the adaptive timeout (a query of its step
    times each) is never under HANG_MIN_S, so it is read only for attempts silent longer."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from jobs.scheduling.detect import detect_hangs

    settings.LOCKSTEP = {**settings.LOCKSTEP, "HANG_MIN_S": 20.0}
    job, attempt, a, b, _ = _run(setup)
    t0 = timezone.now()
    beat(a, attempt, {0: None, 1: None}, records=_steps(1, 10), now=t0)

    def step_time_reads(at) -> int:
        with CaptureQueriesContext(connection) as ctx:
            detect_hangs(at, heard_since=t0 - timedelta(hours=1))
        return sum('"jobs_metricpoint"' in q["sql"] for q in ctx.captured_queries)

    assert step_time_reads(t0 + timedelta(seconds=19)) == 0
    assert live_attempt(job).dump_requested_at is None
    assert step_time_reads(t0 + timedelta(seconds=21)) == 1
    assert live_attempt(job).dump_requested_at == t0 + timedelta(seconds=21)


@pytest.mark.django_db
def test_no_first_step_after_start_up_is_a_hang_too(setup, settings):
    settings.LOCKSTEP = {**settings.LOCKSTEP, "STARTUP_PROGRESS_TIMEOUT_S": 30.0}
    job, attempt, a, b, _ = _run(setup)
    t = timezone.now() + timedelta(seconds=31)
    beat(a, attempt, {0: None, 1: None}, now=t)
    beat(b, attempt, {2: None, 3: None}, now=t)
    run_pass(now=t)
    attempt.refresh_from_db()
    assert attempt.dump_requested_at is not None
    assert attempt.end_reason.startswith(
        "no first step, output or CPU use 31s after all ranks came up"
    )


@pytest.mark.django_db
def test_a_script_that_reports_no_steps_is_judged_by_its_output_and_cpu_use(setup, settings):
    """A plain script (no trainer.api) reports no steps: while its ranks print or use CPU it
    is not hung, however long; once they do neither for the timeout, it is."""
    settings.LOCKSTEP = {**settings.LOCKSTEP, "STARTUP_PROGRESS_TIMEOUT_S": 30.0}
    job, attempt, a, b, _ = _run(setup)
    t0 = timezone.now()
    # Seconds after t0: CPU seconds used so far by ranks 0-3, and what a rank printed.
    timeline = {
        0: ((5.0, 5.0, 5.0, 5.0), {}),  # the baselines
        20: ((5.0, 9.0, 5.0, 5.0), {}),  # rank 1 computes: 4 CPU-seconds
        40: ((5.0, 9.0, 5.1, 5.1), {3: "epoch 1 done\n"}),  # rank 3 prints, little CPU
        50: ((5.4, 9.0, 5.1, 5.1), {}),  # rank 0: 0.4, then 0.9 in all: under 1 CPU-second
        60: ((5.9, 9.0, 5.1, 5.1), {}),
    }
    cpu, printed = timeline[0]
    for second in (0, 10, 20, 30, 40, 50, 60, 70, 71):
        cpu, printed = timeline.get(second, (cpu, {}))
        at = t0 + timedelta(seconds=second)
        logs = {r: t for r, t in printed.items() if r < 2}
        beat(a, attempt, {0: None, 1: None}, cpu={0: cpu[0], 1: cpu[1]}, logs=logs, now=at)
        logs = {r: t for r, t in printed.items() if r >= 2}
        beat(b, attempt, {2: None, 3: None}, cpu={2: cpu[2], 3: cpu[3]}, logs=logs, now=at)
        run_pass(now=at)
        attempt.refresh_from_db()
        if second <= 70:  # within 30 s of the last activity (at 40 s): busy, not hung
            assert attempt.dump_requested_at is None, (second, attempt.end_reason)
    assert attempt.last_activity_at == t0 + timedelta(seconds=40)
    assert attempt.dump_requested_at == t0 + timedelta(seconds=71)
    assert attempt.end_reason == (
        "hung: no output or CPU use for 31s and no step reported (timeout 30s)"
    )


@pytest.mark.django_db
def test_a_busy_gpu_of_the_attempt_counts_as_activity_a_cpu_nodes_load_does_not(setup):
    job, attempt, a, b, _ = _run(setup)
    mine = sorted(attempt.allocations.filter(node=a).values_list("gpu__index", flat=True))
    others = [max(mine) + 1]  # a GPU of the node the attempt does not hold
    t0 = timezone.now()

    def reading(index, util, kind="cuda"):
        return {"index": index, "kind": kind, "util": util, "mem_used": 0, "mem_total": 0}

    quiet = [reading(i, 100.0, "cpu") for i in mine] + [reading(i, 90.0) for i in others]
    beat(a, attempt, {0: None, 1: None}, telemetry=quiet, now=t0)
    attempt.refresh_from_db()
    assert attempt.last_activity_at is None  # a load average, and someone else's GPU
    busy = [reading(mine[0], 3.0), reading(mine[1], 60.0)]
    beat(a, attempt, {0: None, 1: None}, telemetry=busy, now=t0 + timedelta(seconds=5))
    attempt.refresh_from_db()
    assert attempt.last_activity_at == t0 + timedelta(seconds=5)


@pytest.mark.django_db
def test_once_a_script_reports_steps_its_cpu_use_no_longer_hides_a_hang(setup, settings):
    """A rank spinning in a collective that never ends is busy but hung: steps judge a
    script that reports them, not its CPU use."""
    settings.LOCKSTEP = {**settings.LOCKSTEP, "HANG_MIN_S": 20.0}
    job, attempt, a, b, _ = _run(setup)
    t0 = timezone.now()
    beat(a, attempt, {0: None, 1: None}, records=_steps(1, 3, rank=0), now=t0)
    for second in (0, 10, 20, 30, 31):
        at = t0 + timedelta(seconds=second)
        spin = {0: 10.0 * second, 1: 10.0 * second}
        beat(a, attempt, {0: None, 1: None}, cpu=spin, now=at)
        beat(b, attempt, {2: None, 3: None}, now=at)
        run_pass(now=at)
    attempt.refresh_from_db()
    assert attempt.dump_requested_at is not None and attempt.last_activity_at is None
    assert attempt.end_reason.startswith("hung: no progress for")


@pytest.mark.django_db
def test_ranks_still_running_after_rank_0_finished_do_not_make_a_finished_job_hang(setup, settings):
    """An unmodified script's ranks can hang at exit once rank 0 (which hosts torch's store)
    is gone. EXIT_GRACE_S after rank 0 exited 0, with no rank failed, the attempt has
    succeeded: it ends so, the agents stop the rest, and the job is not restarted."""
    settings.LOCKSTEP = {
        **settings.LOCKSTEP, "EXIT_GRACE_S": 60.0, "STARTUP_PROGRESS_TIMEOUT_S": 600.0,
    }  # fmt: skip
    job, attempt, a, b, _ = _run(setup)
    t0 = timezone.now()
    beat(a, attempt, {0: 0, 1: None}, now=t0)
    beat(b, attempt, {2: 0, 3: None}, now=t0)
    for second in (30, 59):
        at = t0 + timedelta(seconds=second)
        beat(a, attempt, {0: 0, 1: None}, now=at)
        beat(b, attempt, {2: 0, 3: None}, now=at)
        run_pass(now=at)
        assert live_attempt(job) == attempt  # within the grace: still running
    at = t0 + timedelta(seconds=61)
    run_pass(now=at)
    attempt.refresh_from_db()
    assert attempt.state == "succeeded", attempt.end_reason
    assert attempt.end_reason == (
        "rank 0 exited 0; rank(s) 1, 3 still running 60s later were stopped (a hang at exit)"
    )
    assert Job.objects.get(pk=job.pk).state == "SUCCEEDED"
    # The agents are no longer asked to run it: they stop the lingering ranks.
    desired = beat(a, attempt, {0: 0, 1: None}, now=at)["desired"]
    assert all(d["attempt_id"] != attempt.id or d["action"] != "run" for d in desired)


@pytest.mark.django_db
def test_only_rank_0_finishing_ends_an_attempt_early_and_a_failure_stays_a_failure(setup, settings):
    settings.LOCKSTEP = {
        **settings.LOCKSTEP, "EXIT_GRACE_S": 60.0, "STARTUP_PROGRESS_TIMEOUT_S": 600.0,
    }  # fmt: skip
    job, attempt, a, b, _ = _run(setup)
    t0 = timezone.now()
    # Ranks other than 0 may finish early (rank 0 evaluates on): nothing ends.
    beat(a, attempt, {0: None, 1: None}, now=t0)
    beat(b, attempt, {2: 0, 3: 0}, now=t0)
    at = t0 + timedelta(seconds=120)
    beat(a, attempt, {0: None, 1: None}, cpu={0: 50.0, 1: 50.0}, now=at)
    beat(b, attempt, {2: 0, 3: 0}, now=at)
    run_pass(now=at)
    attempt.refresh_from_db()
    assert attempt.ended_at is None, attempt.end_reason
    # Rank 0 done, then rank 1 fails within the grace: a failure, as before.
    beat(a, attempt, {0: 0, 1: None}, now=at + timedelta(seconds=1))
    beat(a, attempt, {0: 0, 1: 1}, now=at + timedelta(seconds=30))
    attempt.refresh_from_db()
    assert attempt.state == "failed" and "rank 1" in attempt.end_reason, attempt.end_reason
