"""Detection and response (DESIGN.md section 8) through the real actions and scheduler pass:
hangs with stack capture, stragglers, node strikes and cordoning, user errors, retention,
Young/Daly and goodput accounting. The same paths run with real processes in test_e2e.py."""

import json
import os
from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from jobs import actions, queries
from jobs.checkpoint_policy import checkpoint_advice
from jobs.health import (
    find_stragglers,
    innermost_frame,
    odd_rank_out,
    progress_timeout,
    young_daly_interval,
)
from jobs.models import Attempt, Checkpoint, Event, Job, LogChunk, Node
from jobs.reports.goodput import job_goodput
from jobs.scheduling.loop import run_pass
from jobs.tasks import prune_checkpoints
from tests.heartbeats import beat, commit_checkpoint, live_attempt, submit


def test_progress_timeout_adapts_to_the_jobs_step_time():
    assert progress_timeout([], minimum=60, factor=10) == 60
    assert progress_timeout([0.05] * 100, minimum=60, factor=10) == 60
    slow = [30.0] * 95 + [45.0] * 5
    assert progress_timeout(slow, minimum=60, factor=10) == 300.0  # p95 = 30 s


def test_stragglers_are_ranks_slower_than_the_rest_of_the_gang():
    gang = {0: [0.010] * 20, 1: [0.011] * 20, 2: [0.060] * 20, 3: [0.009] * 20}
    assert find_stragglers(gang, factor=1.5, min_excess=0.01) == [(2, 0.060, 0.010)]
    # Noise on tiny steps is not a straggler.
    tiny = {0: [0.001] * 20, 1: [0.0025] * 20}
    assert find_stragglers(tiny, factor=1.5, min_excess=0.01) == []


def test_young_daly():
    assert young_daly_interval(10.0, 3600.0) == pytest.approx(268.3, abs=0.1)


def _run(setup, **fields):
    team, user, (a, b), root = setup
    job = submit(team, user, **fields)
    run_pass()
    attempt = live_attempt(job)
    beat(a, attempt, {0: None, 1: None})
    beat(b, attempt, {2: None, 3: None})
    job.refresh_from_db()
    return job, attempt, a, b, root


def _steps(first, last, rank=0, step_time=0.1, compute=0.05):
    return [
        {
            "kind": "step",
            "rank": rank,
            "step": s,
            "loss": 1.0,
            "tokens_per_s": 1.0,
            "step_time_s": step_time,
            "compute_s": compute,
        }
        for s in range(first, last + 1)
    ]


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
def test_a_straggler_is_flagged_with_its_node_and_gets_a_strike(setup, settings):
    settings.LOCKSTEP = {**settings.LOCKSTEP, "STRAGGLER_WINDOW_STEPS": 20}
    job, attempt, a, b, _ = _run(setup)
    records = [r for rank in (0, 1) for r in _steps(1, 25, rank=rank, compute=0.01)]
    beat(a, attempt, {0: None, 1: None}, records=records)
    records = _steps(1, 25, rank=2, compute=0.01) + _steps(1, 25, rank=3, compute=0.08)
    beat(b, attempt, {2: None, 3: None}, records=records)
    run_pass()
    event = Event.objects.get(attempt=attempt, kind="attempt.straggler")
    assert event.node == b and event.message.startswith("rank 3 on node-1 is a straggler: 80 ms")
    assert Event.objects.filter(node=b, kind="node.strike").count() == 1
    run_pass(now=timezone.now() + timedelta(minutes=5))  # flagged once per attempt and rank
    assert Event.objects.filter(attempt=attempt, kind="attempt.straggler").count() == 1


@pytest.mark.django_db
def test_repeated_failures_on_a_node_cordon_it_and_restarts_avoid_it(setup, make_nodes):
    team, user, (a, b), root = setup
    make_nodes(1, 2, prefix="spare")
    job = submit(team, user, gpus=2, max_restarts=5)
    for _ in range(3):
        run_pass()
        attempt = live_attempt(job)
        node = attempt.allocations.first().node
        # Force the failures onto node-1: cordon the others while placing.
        beat(node, attempt, {r: None for r in (0, 1)}, records=_steps(1, 3))
        beat(node, attempt, {0: -7, 1: None})
        Job.objects.filter(pk=job.pk).update(restart_after=timezone.now())
    struck = Node.objects.filter(events__kind="node.strike").distinct()
    # Each failure struck the node it happened on; a node with 3 strikes is cordoned.
    for node in Node.objects.all():
        strikes = Event.objects.filter(node=node, kind="node.strike").count()
        node.refresh_from_db()
        assert (node.state == "cordoned") == (strikes >= 3), (node, strikes)
    assert struck.exists()
    # Best fit puts every restart on the same node until it is cordoned.
    (cordoned,) = Node.objects.filter(state="cordoned")
    assert Event.objects.filter(kind="node.cordoned", node=cordoned).exists()
    assert "3 failures in 24h" in cordoned.state_reason
    run_pass()
    placed = live_attempt(job).allocations.values_list("node__state", flat=True)
    assert set(placed) == {"up"}


@pytest.mark.django_db
def test_failures_before_the_first_step_end_the_job_as_a_user_error(setup):
    team, user, (a, b), _ = setup
    job = submit(team, user, gpus=2, max_restarts=10)
    for _ in range(3):
        run_pass()
        attempt = live_attempt(job)
        node = attempt.allocations.first().node
        beat(node, attempt, {0: 1, 1: None})
        Job.objects.filter(pk=job.pk).update(restart_after=timezone.now())
    job.refresh_from_db()
    assert job.state == "FAILED" and job.restart_count == 2
    assert job.reason.startswith("user error: the last 3 attempts failed before their first step")
    # Failures before any step are the job's, not the node's: no strikes.
    assert not Event.objects.filter(kind="node.strike").exists()


@pytest.mark.django_db
def test_checkpoint_records_outside_the_jobs_own_directory_are_ignored(setup):
    job, attempt, a, b, root = _run(setup)
    other = submit(setup[0], setup[1])
    outside = root.parent / "elsewhere"
    records = []
    for path in (
        root / f"job-{other.id}" / "step-000010",  # another job's committed save
        root / f"job-{job.id}" / ".." / f"job-{other.id}" / "step-000010",  # climbing out
        outside / "step-000010",  # outside the checkpoint root
        root / f"job-{job.id}-x" / "step-000010",  # a sibling whose name starts the same
    ):
        path.mkdir(parents=True, exist_ok=True)
        (path / "COMMITTED").write_text('{"step": 10}')
        records.append({"kind": "checkpoint", "rank": 0, "step": 10, "path": str(path)})
    link = root / f"job-{job.id}" / "step-000020"  # a link inside that points out
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(outside / "step-000010")
    records.append({"kind": "checkpoint", "rank": 0, "step": 20, "path": str(link)})
    beat(a, attempt, {0: None, 1: None}, records=records)
    assert not Checkpoint.objects.exists()
    # The job's own committed save is taken.
    beat(a, attempt, {0: None, 1: None}, records=[commit_checkpoint(root, job, 30)])
    assert [c.step for c in Checkpoint.objects.all()] == [30]


@pytest.mark.django_db
def test_commits_while_a_prune_waits_queue_no_second_prune(
    setup, settings, django_capture_on_commit_callbacks
):
    import django_rq

    settings.LOCKSTEP = {**settings.LOCKSTEP, "KEEP_CHECKPOINTS": 1}
    job, attempt, a, b, root = _run(setup)
    queue = django_rq.get_queue()
    queue.empty()
    django_rq.get_connection().delete(f"lockstep:prune-pending:{job.id}")

    def prunes():
        return [j for j in queue.get_jobs() if j.args == (job.id,)]

    with django_capture_on_commit_callbacks(execute=True):
        beat(a, attempt, {0: None, 1: None}, records=[commit_checkpoint(root, job, 10)])
        beat(a, attempt, {0: None, 1: None}, records=[commit_checkpoint(root, job, 20)])
    assert len(prunes()) == 1
    # The waiting prune covers both commits once it runs (as the worker would).
    assert prunes()[0].perform() == [10]
    queue.empty()
    with django_capture_on_commit_callbacks(execute=True):
        beat(a, attempt, {0: None, 1: None}, records=[commit_checkpoint(root, job, 30)])
    assert len(prunes()) == 1  # a commit after the prune started queues the next one
    assert prunes()[0].perform() == [20]


def worker_pid_and_jobs(job_id: int) -> tuple[int, int]:
    """An rq job: the process it ran in, and what it reads from the database."""
    return os.getpid(), Job.objects.filter(pk=job_id).count()


@pytest.mark.django_db(transaction=True)
def test_the_rq_worker_prunes_in_its_own_process_and_forks_a_horse_for_other_jobs(setup, settings):
    import django_rq

    from jobs.worker import LockstepWorker

    settings.LOCKSTEP = {**settings.LOCKSTEP, "KEEP_CHECKPOINTS": 1}
    job, attempt, a, b, root = _run(setup)
    queue = django_rq.get_queue()
    django_rq.get_connection().delete(f"lockstep:prune-pending:{job.id}")
    before = set(queue.get_job_ids())
    beat(
        a, attempt, {0: None, 1: None}, records=[commit_checkpoint(root, job, s) for s in (10, 20)]
    )
    # Only this test's jobs are run (the queue's Redis may be shared with other test runs).
    (prune,) = [j for j in queue.get_jobs() if j.id not in before and j.args == (job.id,)]
    queue.remove(prune)
    other = queue.enqueue(worker_pid_and_jobs, job.id)
    queue.remove(other)

    class Recording(LockstepWorker):
        in_process = LockstepWorker.in_process | {
            worker_pid_and_jobs.__module__ + ".worker_pid_and_jobs"
        }

    worker = LockstepWorker([queue], connection=queue.connection)
    assert prune.timeout == 600
    # While a job runs in the worker process nothing renews rq's keys: they last the job.
    worker._running_in_process = True
    assert worker.get_heartbeat_ttl(prune) >= prune.timeout
    worker._running_in_process = False
    assert worker.get_heartbeat_ttl(prune) < prune.timeout  # a horse's monitor renews them
    worker.execute_job(prune, queue)
    assert prune.func_name in LockstepWorker.in_process
    assert prune.get_status(refresh=True) == "finished" and prune.return_value() == [10]
    assert not (root / f"job-{job.id}" / "step-000010").exists()
    assert (root / f"job-{job.id}" / "step-000020").exists()
    # No database socket is left open for the next horse to inherit, and it still gets one.
    from django.db import connections

    assert all(c.connection is None for c in connections.all(initialized_only=True))
    worker.execute_job(other, queue)
    assert other.get_status(refresh=True) == "finished", other.latest_result()
    forked_pid, seen = other.return_value()
    assert forked_pid != os.getpid() and seen == 1

    again = queue.enqueue(worker_pid_and_jobs, job.id)
    queue.remove(again)
    Recording([queue], connection=queue.connection).execute_job(again, queue)
    assert again.return_value() == (os.getpid(), 1)


@pytest.mark.django_db
def test_retention_keeps_the_last_k_registered_and_preemption_checkpoints(setup, settings):
    settings.LOCKSTEP = {**settings.LOCKSTEP, "KEEP_CHECKPOINTS": 2}
    job, attempt, a, b, root = _run(setup)
    beat(
        a,
        attempt,
        {0: None, 1: None},
        records=[commit_checkpoint(root, job, s) for s in (10, 20, 30, 40, 50)],
    )
    by_step = {c.step: c for c in Checkpoint.objects.filter(job=job)}
    actions.do_register_model_version(
        name="m", checkpoint=by_step[10], actor=job.owner, now=timezone.now()
    )
    Checkpoint.objects.filter(pk=by_step[20].pk).update(preemption=True)
    assert sorted(prune_checkpoints(job.id)) == [30]
    assert not (root / f"job-{job.id}" / "step-000030").exists()
    for step in (10, 20, 40, 50):
        assert (root / f"job-{job.id}" / f"step-{step:06d}").exists()
    assert queries.latest_checkpoint(job.id).step == 50
    # A pruned checkpoint is gone from the API and cannot be registered.
    client = APIClient()
    client.force_authenticate(job.owner)
    listed = [c["step"] for c in client.get(f"/api/v1/jobs/{job.id}/checkpoints/").json()]
    assert listed == [50, 40, 20, 10]
    response = client.post(
        "/api/v1/models/", {"name": "x", "checkpoint": by_step[30].id}, format="json"
    )
    assert response.status_code == 400


@pytest.mark.django_db
def test_young_daly_interval_uses_the_jobs_save_stall_and_failure_rate(setup):
    job, attempt, a, b, root = _run(setup)
    record = commit_checkpoint(root, job, 10) | {"save_s": 2.0}
    beat(a, attempt, {0: None, 1: None}, records=[record])
    Attempt.objects.filter(pk=attempt.pk).update(
        running_at=timezone.now() - timedelta(seconds=3600)
    )
    beat(b, attempt, {2: 9, 3: None})
    advice = checkpoint_advice(job)
    assert (advice["save_stall_s"], advice["mtbf_source"], advice["source"]) == (
        2.0,
        "job",
        "Young/Daly",
    )
    assert advice["interval_s"] == round((2 * 2.0 * advice["mtbf_s"]) ** 0.5)
    # One failure in an hour is smoothed with one failure-free default MTBF (a day), so an
    # early failure cannot push the interval down to seconds.
    assert advice["mtbf_s"] == pytest.approx((3600 + 86400) / 2, abs=5)
    Job.objects.filter(pk=job.pk).update(checkpoint_interval_s=120)
    job.refresh_from_db()
    assert checkpoint_advice(job)["interval_s"] == 120


@pytest.mark.django_db
def test_goodput_counts_lost_steps_and_detection_and_recovery_times(setup):
    job, attempt, a, b, root = _run(setup)
    t0 = timezone.now()
    beat(
        a,
        attempt,
        {0: None, 1: None},
        records=[*_steps(1, 10), commit_checkpoint(root, job, 8)],
        now=t0,
    )
    beat(a, attempt, {0: None, 1: None}, records=_steps(11, 20), now=t0 + timedelta(seconds=10))
    beat(b, attempt, {2: -9, 3: None}, now=t0 + timedelta(seconds=12))
    run_pass(now=t0 + timedelta(seconds=30))
    second = live_attempt(job)
    beat(a, second, {0: None, 1: None}, now=t0 + timedelta(seconds=31))
    beat(b, second, {2: None, 3: None}, now=t0 + timedelta(seconds=31))
    beat(a, second, {0: None, 1: None}, records=_steps(9, 30), now=t0 + timedelta(seconds=40))
    (incident,) = job_goodput(job, now=t0 + timedelta(seconds=40))["incidents"]
    assert incident["attempt"] == 1 and incident["lost_steps"] == 12  # steps 9..20 recomputed
    assert incident["recover_s"] == 28.0 and incident["detect_s"] == 0.0
    client = APIClient()
    client.force_authenticate(job.owner)
    body = client.get(f"/api/v1/jobs/{job.id}/").json()
    assert body["goodput"]["incidents"][0]["lost_steps"] == 12
    assert body["checkpoint_policy"]["source"] == "Young/Daly"


@pytest.mark.django_db
def test_only_admins_cordon_drain_and_uncordon(setup, make_user):
    team, user, (a, b), _ = setup
    job = submit(team, user, gpus=2)
    run_pass()
    node = live_attempt(job).allocations.first().node
    member = APIClient()
    member.force_authenticate(user)
    assert member.post(f"/api/v1/nodes/{node.id}/cordon/").status_code == 403
    admin = APIClient()
    admin.force_authenticate(make_user("root", staff=True))
    response = admin.post(f"/api/v1/nodes/{node.id}/drain/", {"reason": "bad fan"}, format="json")
    assert response.status_code == 200 and response.json()["state"] == "draining"
    attempt = live_attempt(job)
    assert attempt.state == "stopping" and "draining: bad fan" in attempt.end_reason
    beat(node, attempt, {0: 0, 1: 0})
    job.refresh_from_db()
    assert job.state == "QUEUED" and "requeued" in job.reason
    assert admin.post(f"/api/v1/nodes/{node.id}/uncordon/").json()["state"] == "up"


@pytest.mark.django_db
def test_a_portal_outage_is_not_mistaken_for_every_node_dying(setup, monkeypatch):
    from jobs.scheduling import loop

    team, user, (a, b), _ = setup
    t0 = timezone.now()
    monkeypatch.setattr(loop, "intake", loop.HeartbeatIntake(t0 - timedelta(hours=1)))
    # Nobody heard from for 40 s (> the 30 s timeout): the portal was down, not both nodes.
    loop.detect_lost_nodes(t0 + timedelta(seconds=40))
    assert set(Node.objects.values_list("state", flat=True)) == {"up"}
    # Heartbeats flow again, but only from node-0: node-1 gets a full timeout from now on.
    resumed = t0 + timedelta(seconds=41)
    actions.do_heartbeat(a, {"boot_id": a.boot_id}, now=resumed)
    loop.detect_lost_nodes(resumed)
    b.refresh_from_db()
    assert b.state == "up"
    later = resumed + timedelta(seconds=31)
    actions.do_heartbeat(a, {"boot_id": a.boot_id}, now=later)
    loop.detect_lost_nodes(later)
    b.refresh_from_db()
    assert b.state == "down" and b.state_reason == "no heartbeat for 72s"


@pytest.mark.django_db
def test_teams_api_shows_usage_and_goodput_and_only_admins_change_quotas(setup, make_user):
    job, attempt, a, b, root = _run(setup)
    beat(a, attempt, {0: None, 1: None}, records=_steps(1, 10))
    member = APIClient()
    member.force_authenticate(job.owner)
    (team,) = member.get("/api/v1/teams/").json()["results"]
    assert (team["name"], team["quota"], team["used"]) == ("lab", 8, 4)
    assert team["goodput"]["jobs"] == 1 and team["goodput"]["wall_s"] >= 0
    assert (
        member.patch(f"/api/v1/teams/{team['id']}/", {"quota": 99}, format="json").status_code
        == 403
    )
    admin = APIClient()
    admin.force_authenticate(make_user("root", staff=True))
    bad = admin.patch(f"/api/v1/teams/{team['id']}/", {"quota": -1}, format="json")
    assert bad.status_code == 400 and "quota" in bad.json()
    ok = admin.patch(f"/api/v1/teams/{team['id']}/", {"quota": 12}, format="json")
    assert ok.status_code == 200 and ok.json()["quota"] == 12
    assert Event.objects.filter(kind="team.quota_changed").count() == 1
    stranger = APIClient()
    stranger.force_authenticate(make_user("nobody"))
    assert stranger.get(f"/api/v1/teams/{team['id']}/").status_code == 404


@pytest.mark.django_db
def test_a_committed_checkpoint_whose_report_was_lost_with_its_node_is_resumed_from(setup):
    job, attempt, a, b, root = _run(setup)
    beat(a, attempt, {0: None, 1: None}, records=[commit_checkpoint(root, job, 20)])
    # Rank 0's node commits step 40, then goes silent before its agent reports it.
    unreported = root / f"job-{job.id}" / "attempt-1" / "step-000040"
    unreported.mkdir(parents=True)
    (unreported / "COMMITTED").write_text('{"step": 40, "world_size": 4}')
    actions.do_mark_node_lost(a, now=timezone.now(), reason="test")
    Job.objects.filter(pk=job.pk).update(restart_after=timezone.now())
    actions.do_heartbeat(a, {"boot_id": a.boot_id}, now=timezone.now())
    run_pass()
    second = live_attempt(job)
    assert second.resumed_from_step == 40
    assert Event.objects.filter(job=job, kind="checkpoint.recovered").count() == 1


@pytest.mark.django_db
def test_the_node_of_a_rank_that_cannot_dump_its_stacks_is_blamed_for_a_hang(setup, settings):
    settings.LOCKSTEP = {**settings.LOCKSTEP, "HANG_MIN_S": 20.0, "DUMP_WAIT_S": 3.0}
    job, attempt, a, b, _ = _run(setup)
    t0 = timezone.now()
    beat(a, attempt, {0: None, 1: None}, records=_steps(1, 10), now=t0)
    t = t0 + timedelta(seconds=25)
    for node, ranks in ((a, {0: None, 1: None}), (b, {2: None, 3: None})):
        beat(node, attempt, ranks, now=t)
    run_pass(now=t)
    for rank in (0, 1, 2):  # rank 3 is stopped: no dump
        LogChunk.objects.create(
            attempt=attempt,
            rank=rank,
            created_at=t,
            text="Current thread 0x1 (most recent call first):\n",
        )
    later = t + timedelta(seconds=4)
    for node, ranks in ((a, {0: None, 1: None}), (b, {2: None, 3: None})):
        beat(node, attempt, ranks, now=later)
    run_pass(now=later)
    attempt.refresh_from_db()
    assert "no stacks from rank(s) 3" in attempt.end_reason
    assert Event.objects.filter(node=b, kind="node.strike").count() == 1
    assert not Event.objects.filter(node=a, kind="node.strike").exists()


@pytest.mark.django_db
def test_an_agent_restart_is_timed_from_its_last_heartbeat_and_strikes_its_node(setup):
    job, attempt, a, b, _ = _run(setup)
    beat(a, attempt, {0: None, 1: None}, records=_steps(1, 3))
    last = timezone.now()
    actions.do_heartbeat(a, {"boot_id": a.boot_id}, now=last)
    actions.do_register_node(
        name=a.name, gpus=2, address="127.0.0.1", boot_id="reborn", now=last + timedelta(seconds=6)
    )
    event = Event.objects.get(attempt=attempt, kind="attempt.lost")
    assert event.data["detect_s"] == pytest.approx(6, abs=0.01)
    assert Event.objects.filter(node=a, kind="node.strike").count() == 1


@pytest.mark.django_db
def test_rendezvous_ports_of_live_attempts_on_one_master_differ(setup, make_nodes):
    team, user, _, _ = setup
    jobs = [submit(team, user, gpus=1) for _ in range(4)]
    run_pass()
    ports = [live_attempt(j).master_port for j in jobs]
    assert len(set(ports)) == 4


@pytest.mark.django_db
def test_the_suggested_interval_is_never_below_10_s_nor_20_save_stalls(setup, settings):
    from jobs import checkpoint_policy

    job, attempt, a, b, root = _run(setup)
    settings.LOCKSTEP = {**settings.LOCKSTEP, "DEFAULT_MTBF_S": 60.0}  # a failure a minute
    for stall, expected in ((0.15, 10), (2.0, 40)):
        record = commit_checkpoint(root, job, int(stall * 100)) | {"save_s": stall}
        Checkpoint.objects.filter(job=job).delete()
        beat(a, attempt, {0: None, 1: None}, records=[record])
        checkpoint_policy._fleet_cache["at"] = 0.0
        advice = checkpoint_advice(job)
        # Young/Daly alone would say sqrt(2 x stall x 60 s): 4.2 s and 15.5 s.
        assert advice["young_daly_s"] == expected and advice["interval_s"] == expected


@pytest.mark.django_db
def test_a_planned_restart_requeues_the_gang_without_a_strike_or_a_restart(setup):
    """An agent that says it is leaving (SIGTERM: an upgrade, Ctrl-C): its node takes no new
    work, the whole gang (both nodes) checkpoints and stops, the job is requeued with its
    restart count unchanged, no node gets a strike, and when the agent registers again with a
    new boot the node is schedulable and the job resumes from its checkpoint."""
    job, attempt, a, b, root = _run(setup, max_restarts=2)
    beat(a, attempt, {0: None, 1: None}, records=[*_steps(1, 20), commit_checkpoint(root, job, 20)])
    stopping = actions.do_node_leaving(a, reason="SIGTERM", grace_s=15, now=timezone.now())
    assert stopping == [attempt.id]
    a.refresh_from_db()
    attempt.refresh_from_db()
    job.refresh_from_db()
    assert (a.state, attempt.state, job.state) == ("down", "stopping", "PREEMPTING")
    assert a.leaving_at is not None and "planned" in a.state_reason
    assert (attempt.stop_deadline - timezone.now()).total_seconds() <= 15
    # The rest of the gang, on b, is told to stop too.
    assert [d["action"] for d in queries.desired_for_node(b, timezone.now())] == ["stop"]
    # The leaving agent keeps reporting while its workers checkpoint; it stays down.
    beat(a, attempt, {0: 0, 1: 0})
    a.refresh_from_db()
    assert a.state == "down"
    beat(b, attempt, {2: 0, 3: 0})
    attempt.refresh_from_db()
    job.refresh_from_db()
    assert attempt.state == "preempted"
    assert job.state == "QUEUED" and job.reason.startswith("requeued: planned restart of node-0")
    assert job.restart_count == 0
    run_pass()
    assert not Attempt.objects.filter(job=job, ended_at__isnull=True).exists()  # a is down
    # The agent comes back with a new boot: no crash, no strike; the node takes work again.
    a, _ = actions.do_register_node(
        name=a.name, gpus=2, address="127.0.0.1", boot_id="upgraded", now=timezone.now()
    )
    assert (a.state, a.leaving_at) == ("up", None)
    run_pass()
    second = live_attempt(job)
    job.refresh_from_db()
    assert second.number == 2 and second.resumed_from_step == 20
    assert job.restart_count == 0
    assert not Event.objects.filter(kind="node.strike").exists()
    assert Event.objects.filter(node=a, kind="node.leaving").count() == 1
    assert Event.objects.get(node=a, kind="node.reregistered").data["planned"] is True


@pytest.mark.django_db
def test_an_agent_back_from_a_planned_restart_ends_what_it_left_open_without_a_strike(setup):
    """The leaving agent's last report never arrived (it gave up waiting, or was killed after
    saying it was leaving): when it registers again the attempt ends as stopped, not lost."""
    job, attempt, a, b, _ = _run(setup)
    beat(a, attempt, {0: None, 1: None}, records=_steps(1, 3))
    actions.do_node_leaving(a, reason="SIGINT", now=timezone.now())
    a, _ = actions.do_register_node(
        name=a.name, gpus=2, address="127.0.0.1", boot_id="again", now=timezone.now()
    )
    attempt.refresh_from_db()
    job.refresh_from_db()
    assert attempt.state == "preempted" and job.state == "QUEUED" and job.restart_count == 0
    assert a.state == "up"
    assert not Event.objects.filter(kind="node.strike").exists()
    # Without the word first, a new boot is a crash the node may have caused: a strike.
    run_pass()
    attempt = live_attempt(job)
    beat(a, attempt, {0: None, 1: None}, records=_steps(1, 3))
    actions.do_register_node(
        name=a.name, gpus=2, address="127.0.0.1", boot_id="crashed", now=timezone.now()
    )
    attempt.refresh_from_db()
    assert attempt.state == "lost"
    assert Event.objects.filter(node=a, kind="node.strike").count() == 1


@pytest.mark.django_db
def test_a_cordoned_node_that_restarts_as_planned_stays_cordoned(setup, make_user):
    team, user, (a, b), _ = setup
    admin = make_user("root", staff=True)
    actions.do_cordon_node(a, actor=admin, reason="maintenance", now=timezone.now())
    actions.do_node_leaving(a, reason="SIGTERM", now=timezone.now())
    a, _ = actions.do_register_node(
        name=a.name, gpus=2, address="127.0.0.1", boot_id="next", now=timezone.now()
    )
    assert (a.state, a.state_reason) == ("cordoned", "maintenance")


def _py_spy(rank: int, *frames: str, state: str = "S") -> str:
    """A rank's log tail as the agent writes it: its header (with the process's state) over
    py-spy's dump (--native)."""
    body = "\n".join(f"    {f}" for f in frames)
    return (
        f"step 24 loss 1.2\nlockstep agent: stacks of rank {rank}, read from outside "
        f"(py-spy dump), process state {state}\nProcess {100 + rank}: python -m trainer\n"
        "Python v3.11.7 (/usr/bin/"
        f'python3.11)\n\nThread {100 + rank} (idle): "MainThread"\n{body}\n'
        f'Thread {200 + rank} (idle): "Thread-1 (pin_memory)"\n    wait (threading.py:327)\n'
    )


WAITING = (
    "pthread_cond_wait (libc.so.6)",
    "gloo::transport::tcp::UnboundBuffer::waitRecv (libtorch_cpu.so)",
    "backward (torch/autograd/__init__.py:266)",
    "run_step (trainer/train.py:410)",
    "<module> (trainer/__main__.py:4)",
)
STALLED = (
    "clock_nanosleep (libc.so.6)",
    "stall (trainer/faults.py:31)",
    "run_step (trainer/train.py:402)",
    "<module> (trainer/__main__.py:4)",
)


def test_the_innermost_python_frame_is_read_from_py_spy_or_faulthandler():
    assert innermost_frame(_py_spy(1, *WAITING)) == "backward (__init__.py)"
    assert innermost_frame(_py_spy(0, *STALLED)) == "stall (faults.py)"
    faulthandler = (
        "Thread 0x00007f0a (most recent call first):\n"
        '  File "/usr/lib/python3.11/threading.py", line 327 in wait\n\n'
        "Current thread 0x00007f0b (most recent call first):\n"
        '  File "/opt/lockstep/trainer/faults.py", line 31 in stall\n'
        '  File "/opt/lockstep/trainer/train.py", line 402 in run_step\n'
    )
    assert innermost_frame(faulthandler) == "stall (faults.py)"
    assert innermost_frame("rank 3 printed this and nothing else\n") is None


def test_the_rank_outside_the_collective_the_others_wait_in_is_named():
    stacks = {0: _py_spy(0, *STALLED), **{r: _py_spy(r, *WAITING) for r in (1, 2, 3)}}
    assert odd_rank_out(stacks) == (0, "stall (faults.py)", "backward (__init__.py)")
    # Two ranks, or a gang split in two, or everyone in one place: nobody can be named.
    assert odd_rank_out({0: stacks[0], 1: stacks[1]}) is None
    assert odd_rank_out({0: stacks[0], 1: stacks[1], 2: stacks[0], 3: stacks[1]}) is None
    assert odd_rank_out({r: _py_spy(r, *WAITING) for r in range(4)}) is None


def test_a_stopped_rank_is_named_by_its_process_state_whatever_its_stack():
    """Frozen by SIGSTOP inside its backward pass, a rank shows the Python frame its peers wait
    in for its gradients: its state (T) names it."""
    stacks = {r: _py_spy(r, *WAITING) for r in range(4)}
    stacks[2] = _py_spy(2, *WAITING, state="T")
    assert odd_rank_out(stacks) == (2, "stopped (SIGSTOP)", "")
    stacks[3] = _py_spy(3, *WAITING, state="D")  # two stuck ranks: no telling
    assert odd_rank_out(stacks) is None


def _hung_with_logs(setup, settings, logs: dict[int, str]) -> Event:
    """A 4-rank attempt on node-0 (ranks 0, 1) and node-1 (2, 3) that stops stepping; once its
    stacks are asked for, each rank's log carries `logs[rank]`. Returns the failure's event."""
    settings.LOCKSTEP = {**settings.LOCKSTEP, "HANG_MIN_S": 20.0, "DUMP_WAIT_S": 3.0}
    job, attempt, a, b, _ = _run(setup)
    t0 = timezone.now()
    beat(a, attempt, {0: None, 1: None}, records=_steps(1, 3, rank=0), now=t0)
    beat(b, attempt, {2: None, 3: None}, now=t0)
    t = t0 + timedelta(seconds=21)
    beat(a, attempt, {0: None, 1: None}, now=t)
    beat(b, attempt, {2: None, 3: None}, now=t)
    run_pass(now=t)  # hung: the stacks are asked for
    t += timedelta(seconds=1)
    beat(a, attempt, {0: None, 1: None}, logs={r: logs[r] for r in (0, 1)}, now=t)
    beat(b, attempt, {2: None, 3: None}, logs={r: logs[r] for r in (2, 3)}, now=t)
    t += timedelta(seconds=3)
    beat(a, attempt, {0: None, 1: None}, now=t)
    beat(b, attempt, {2: None, 3: None}, now=t)
    run_pass(now=t)
    return Event.objects.get(attempt=attempt, kind="attempt.failed")


@pytest.mark.django_db
def test_a_hang_names_the_odd_rank_and_strikes_only_its_node(setup, settings):
    logs = {0: _py_spy(0, *STALLED), **{r: _py_spy(r, *WAITING) for r in (1, 2, 3)}}
    failed = _hung_with_logs(setup, settings, logs)
    assert failed.data["odd_rank"] == 0 and failed.data["common_frame"] == "backward (__init__.py)"
    assert "rank 0 on node-0 is in stall (faults.py) while the other ranks wait in" in (
        failed.message
    )
    struck = set(Event.objects.filter(kind="node.strike").values_list("node__name", flat=True))
    assert struck == {"node-0"}


def _flight_line(rank: int, entered: int, completed: int) -> str:
    """The agent's line for a rank's flight recorder (nodeagent/flight_recorder.py)."""
    group = {
        "entered": entered,
        "completed": completed,
        "desc": "default_pg",
        "last": {"seq": entered, "op": "nccl:all_reduce", "sizes": [[4096]], "state": "started"},
    }
    return (
        f"\nlockstep agent: flight recorder of rank {rank}: "
        + json.dumps({"groups": {"0": group}, "entries": 2000})
        + "\n"
    )


@pytest.mark.django_db
def test_a_hang_the_stacks_cannot_place_is_placed_by_the_flight_recorders(setup, settings):
    """Every rank's stack is in the same backward pass (rank 3 computes its gradients while the
    others wait for them): the stacks name nobody. The flight recorders do: rank 3 never
    entered all-reduce #118, so its node alone is struck, and the summaries are in the event."""
    logs = {r: _py_spy(r, *WAITING) + _flight_line(r, 118, 117) for r in range(3)}
    logs[3] = _py_spy(3, *WAITING) + _flight_line(3, 117, 117)
    failed = _hung_with_logs(setup, settings, logs)
    assert failed.data["odd_rank"] == 3, failed.message
    assert "rank 3 on node-1 never entered collective #118 (nccl:all_reduce of [[4096]])" in (
        failed.message
    )
    assert set(failed.data["flight_recorder"]) == {"0", "1", "2", "3"}
    struck = set(Event.objects.filter(kind="node.strike").values_list("node__name", flat=True))
    assert struck == {"node-1"}
