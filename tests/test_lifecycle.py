"""The job lifecycle through the real actions and scheduler pass, on the test database:
placement, heartbeats, failure and restart from the latest checkpoint, max restarts, lost
nodes, time limits, and the portal ignoring reports from attempts that are no longer live."""

import signal
from datetime import timedelta

import pytest
from django.utils import timezone

from jobs import actions, queries
from jobs.actions import strikes
from jobs.actions.strikes import node_strikes
from jobs.conf import lockstep_setting
from jobs.models import Allocation, Event, Job
from jobs.scheduling.loop import run_pass
from tests.heartbeats import beat, commit_checkpoint, launch_of, live_attempt, submit


@pytest.mark.django_db
def test_a_failed_rank_restarts_the_job_from_its_latest_checkpoint(setup):
    team, user, (a, b), root = setup
    job = submit(team, user, max_restarts=2)
    run_pass()
    attempt = live_attempt(job)
    launch = launch_of(a, attempt)
    assert (launch["world_size"], launch["local_world_size"], launch["group_rank"]) == (4, 2, 0)
    assert launch["group_world_size"] == 2
    assert launch["resume_from"] == "" and [r["rank"] for r in launch["ranks"]] == [0, 1]
    # Once the agent reports the attempt it runs it: the spec is not sent again.
    assert beat(a, attempt, {0: None, 1: None})["desired"] == [
        {"attempt_id": attempt.id, "action": "run"}
    ]
    assert [r["rank"] for r in launch_of(b, attempt)["ranks"]] == [2, 3]
    beat(b, attempt, {2: None, 3: None})
    assert Job.objects.get(pk=job.pk).state == "RUNNING"

    ckpt = commit_checkpoint(root, job, 30)
    step = {
        "kind": "step",
        "rank": 0,
        "step": 31,
        "loss": 1.5,
        "tokens_per_s": 10.0,
        "step_time_s": 0.1,
    }
    beat(a, attempt, {0: None, 1: None}, records=[ckpt, step])
    beat(b, attempt, {2: -9, 3: None})
    attempt.refresh_from_db()
    job.refresh_from_db()
    assert attempt.state == "failed" and attempt.end_reason == (
        "rank 2 on node-1 exited with signal 9 (SIGKILL)"
    )
    assert job.state == "RESTARTING" and job.restart_count == 1
    assert "restart 1/2 in 10s from checkpoint at step 30" in job.reason
    assert not Allocation.objects.filter(released_at__isnull=True).exists()
    # The other node's agent is no longer asked to run it: it fences its ranks.
    assert beat(a, attempt, {0: None, 1: None})["desired"] == []

    run_pass()  # backoff not over: stays RESTARTING
    assert Job.objects.get(pk=job.pk).state == "RESTARTING"
    run_pass(now=timezone.now() + timedelta(seconds=11))
    second = live_attempt(job)
    assert (second.number, second.resumed_from_step) == (2, 30)
    launch = queries.launch_spec(second, a)
    assert launch["resume_from"].endswith("step-000030") and launch["restart_count"] == 1


@pytest.mark.django_db
def test_no_restarts_left_ends_the_job_failed_with_the_cause(setup):
    team, user, (a, b), _ = setup
    job = submit(team, user, max_restarts=0)
    run_pass()
    attempt = live_attempt(job)
    beat(a, attempt, {0: 1, 1: None})
    job.refresh_from_db()
    assert job.state == "FAILED"
    assert job.reason == "rank 0 on node-0 exited with exit code 1; no restarts left (0 used)"
    assert Event.objects.filter(job=job, kind="job.failed").exists()


@pytest.mark.django_db
def test_all_ranks_exiting_zero_succeeds_and_frees_the_gpus(setup):
    team, user, (a, b), _ = setup
    job = submit(team, user)
    run_pass()
    attempt = live_attempt(job)
    beat(a, attempt, {0: 0, 1: 0})
    assert Job.objects.get(pk=job.pk).state != "SUCCEEDED"  # rank 2 and 3 still run
    beat(b, attempt, {2: 0, 3: 0})
    assert Job.objects.get(pk=job.pk).state == "SUCCEEDED"
    assert not Allocation.objects.filter(released_at__isnull=True).exists()


@pytest.mark.django_db
def test_an_attempt_records_where_its_dataset_was(setup):
    team, user, _, _ = setup
    on_disk = submit(team, user, gpus=1, dataset="file://localhost/shared/corpora/wiki.txt")
    synthetic = submit(team, user, gpus=1, dataset="synthetic://addition")
    run_pass()
    assert live_attempt(on_disk).dataset_location == "/shared/corpora/wiki.txt"
    assert live_attempt(synthetic).dataset_location == "synthetic://addition"


@pytest.mark.django_db
def test_reports_from_an_attempt_that_is_no_longer_live_change_nothing(setup):
    team, user, (a, b), root = setup
    job = submit(team, user)
    run_pass()
    old = live_attempt(job)
    actions.do_mark_node_lost(b, now=timezone.now(), reason="test")
    old.refresh_from_db()
    assert old.state == "lost"
    records = [
        commit_checkpoint(root, job, 50),
        {"kind": "step", "rank": 0, "step": 51, "loss": 1.0},
    ]
    response = beat(a, old, {0: 1, 1: None}, records=records)
    assert old.id in response["acked"] and response["desired"] == []
    assert not job.checkpoints.exists() and not job.metric_points.exists()
    old.refresh_from_db()
    assert old.allocations.filter(exit_code__isnull=False).count() == 0


@pytest.mark.django_db
def test_a_node_silent_past_the_timeout_is_marked_down_and_its_attempt_lost(setup, settings):
    team, user, (a, b), _ = setup
    job = submit(team, user)
    run_pass()
    later = timezone.now() + timedelta(seconds=settings.LOCKSTEP["HEARTBEAT_TIMEOUT_S"] + 1)
    beat(a, live_attempt(job), {0: None, 1: None}, now=later)
    run_pass(now=later)
    b.refresh_from_db()
    assert b.state == "down" and "no heartbeat" in b.state_reason
    job.refresh_from_db()
    assert job.state == "RESTARTING" and "node node-1 lost" in job.reason
    # It cannot be placed while node-1 is down; the reason says so.
    actions.do_heartbeat(a, {"boot_id": a.boot_id}, now=later + timedelta(seconds=60))
    run_pass(now=later + timedelta(seconds=60))
    job.refresh_from_db()
    assert job.state == "QUEUED"
    assert job.reason == "needs 4 GPUs but only 2 GPUs are on schedulable nodes"


@pytest.mark.django_db
def test_time_limit_stops_the_job_checkpoint_first_and_fails_it(setup):
    team, user, (a, b), _ = setup
    job = submit(team, user, time_limit_s=60, checkpoint_interval_s=30)
    run_pass()
    attempt = live_attempt(job)
    assert queries.launch_spec(attempt, a)["env"] == {"LOCKSTEP_CHECKPOINT_INTERVAL_S": "30"}
    later = timezone.now() + timedelta(seconds=61)
    for node in (a, b):  # both agents alive at that time
        actions.do_heartbeat(node, {"boot_id": node.boot_id}, now=later)
    run_pass(now=later)
    job.refresh_from_db()
    attempt.refresh_from_db()
    assert job.state == "FAILED" and job.reason == "time limit of 60s reached"
    assert attempt.state == "stopping"
    (desired,) = beat(a, attempt, {0: None, 1: None})["desired"]
    assert desired["action"] == "stop"
    beat(a, attempt, {0: 0, 1: 0})
    beat(b, attempt, {2: 0, 3: -15})
    attempt.refresh_from_db()
    assert attempt.state == "cancelled"
    assert not Allocation.objects.filter(released_at__isnull=True).exists()


@pytest.mark.django_db
def test_time_limit_counts_run_time_so_time_spent_requeued_is_not_charged(setup):
    from jobs.models import Attempt
    from jobs.scheduling.reader import take_snapshot

    team, user, (a, b), _ = setup
    job = submit(team, user, time_limit_s=60, max_restarts=2)
    t0 = timezone.now()
    run_pass(now=t0)
    first = live_attempt(job)
    # It ran 20 s, failed, and then waited 100 s before the next attempt.
    beat(a, first, {0: None, 1: None})
    beat(b, first, {2: -9, 3: None})
    Attempt.objects.filter(pk=first.pk).update(created_at=t0, ended_at=t0 + timedelta(seconds=20))
    queued_at = t0 + timedelta(seconds=120)
    run_pass(now=queued_at)  # backoff over: requeued, and in the same pass placed again
    second = live_attempt(job)
    Attempt.objects.filter(pk=second.pk).update(created_at=queued_at)
    (run,) = take_snapshot(queued_at).running
    # 40 s of the limit are left, counted from the second attempt's start.
    assert run.expected_end == queued_at + timedelta(seconds=40)
    # Its GPUs are free at the latest once the stop at the limit has had its grace to save.
    grace = timedelta(seconds=lockstep_setting("STOP_GRACE_S"))
    assert run.frees_by == run.expected_end + grace

    def beat_both(at):
        for node in (a, b):
            actions.do_heartbeat(node, {"boot_id": node.boot_id}, now=at)

    at = queued_at + timedelta(seconds=35)  # 55 s of run time; 155 s of wall time
    beat_both(at)
    run_pass(now=at)
    job.refresh_from_db()
    assert job.state in ("STARTING", "RUNNING"), job.reason
    at = queued_at + timedelta(seconds=41)  # 61 s of run time
    beat_both(at)
    run_pass(now=at)
    job.refresh_from_db()
    assert job.state == "FAILED" and job.reason == "time limit of 60s reached"


@pytest.mark.django_db
def test_scheduler_pass_writes_wait_reasons_for_jobs_left_queued(setup):
    team, user, _, _ = setup
    first = submit(team, user, gpus=4)
    second = submit(team, user, gpus=2)
    report, result = run_pass()
    assert list(result.applied) == [first.id]
    second.refresh_from_db()
    assert second.state == "QUEUED"
    assert second.reason.startswith("waiting for 2 GPUs on one node; 0 free now")


@pytest.mark.django_db
def test_an_agent_restart_ends_its_attempts_and_says_it_killed_the_old_workers(setup):
    team, user, (a, b), _ = setup
    job = submit(team, user, max_restarts=1)
    run_pass()
    attempt = live_attempt(job)
    actions.do_register_node(
        name=a.name,
        gpus=2,
        address="127.0.0.1",
        boot_id="new-boot",
        killed_orphans=2,
        now=timezone.now(),
    )
    attempt.refresh_from_db()
    assert attempt.state == "lost"
    assert attempt.end_reason == (
        "agent on node-0 restarted; it killed 2 worker(s) left by its previous process "
        "(workers are not re-adopted)"
    )
    event = Event.objects.filter(kind="node.reregistered").last()
    assert "its agent killed 2 orphaned worker(s) on start" in event.message


@pytest.mark.django_db
def test_the_first_rank_to_die_is_blamed_and_its_exit_time_is_the_failure_time(setup):
    team, user, (a, b), _ = setup
    job = submit(team, user)
    run_pass()
    attempt = live_attempt(job)
    now = timezone.now()
    body = {
        "boot_id": a.boot_id,
        "attempts": [
            {
                "attempt_id": attempt.id,
                "ranks": [
                    {
                        "rank": 0,
                        "state": "exited",
                        "exit_code": 1,
                        "exited_at": now.timestamp() - 2,
                    },
                    {
                        "rank": 1,
                        "state": "exited",
                        "exit_code": -9,
                        "exited_at": now.timestamp() - 5,
                    },
                ],
            }
        ],
    }
    actions.do_heartbeat(a, body, now=now)
    attempt.refresh_from_db()
    assert attempt.end_reason == "rank 1 on node-0 exited with signal 9 (SIGKILL)"
    assert abs((now - attempt.failed_at).total_seconds() - 5) < 0.01
    event = Event.objects.get(attempt=attempt, kind="attempt.failed")
    assert event.data["detect_s"] == pytest.approx(5, abs=0.01)


def _running_on_two_nodes(setup):
    """A 4-rank job (max_restarts 2) whose attempt runs on nodes a and b: ((a, b), job, attempt)."""
    team, user, (a, b), _ = setup
    job = submit(team, user, max_restarts=2)
    run_pass()
    attempt = live_attempt(job)
    beat(a, attempt, {0: None, 1: None})
    beat(b, attempt, {2: None, 3: None})
    return (a, b), job, attempt


@pytest.mark.django_db
def test_the_rank_killed_by_a_signal_is_blamed_not_the_one_that_raised_after_it(setup):
    """Rank 1 is SIGKILLed; rank 0's collective breaks and it exits 1 within the same poll of
    its agent, so both exits carry the same time: the signal death is the cause."""
    (a, b), job, attempt = _running_on_two_nodes(setup)
    beat(a, attempt, {0: 1, 1: -9})
    attempt.refresh_from_db()
    assert attempt.end_reason == "rank 1 on node-0 exited with signal 9 (SIGKILL)"


@pytest.mark.django_db
def test_a_rank_killed_by_sigpipe_after_its_peer_died_is_not_blamed(setup):
    """Rank 3 is SIGKILLed; rank 2 writes to its dead socket and takes SIGPIPE in the same poll
    (a program that leaves SIGPIPE at its default): the SIGKILL is the cause."""
    (a, b), job, attempt = _running_on_two_nodes(setup)
    beat(b, attempt, {2: -signal.SIGPIPE, 3: -signal.SIGKILL})
    attempt.refresh_from_db()
    assert attempt.end_reason == "rank 3 on node-1 exited with signal 9 (SIGKILL)"


@pytest.mark.django_db
def test_a_cause_reported_just_after_by_another_node_revises_the_blame(setup):
    """Node a reports rank 0's exit 1 first (its collective broke): the attempt ends on it.
    Node b's report right after says rank 3 was SIGKILLed a moment before: the attempt and the
    job now name rank 3, and an Event says the cause was revised. A rank that node b's agent
    killed while fencing, after the attempt ended, is not a candidate."""
    from datetime import timedelta

    (a, b), job, attempt = _running_on_two_nodes(setup)
    t0 = timezone.now()
    beat(a, attempt, {0: 1, 1: None}, now=t0)
    attempt.refresh_from_db()
    assert attempt.end_reason == "rank 0 on node-0 exited with exit code 1"
    killed_at, fenced_at = (
        (t0 - timedelta(seconds=0.3)).timestamp(),
        (t0 + timedelta(seconds=0.5)).timestamp(),
    )
    body = {
        "boot_id": b.boot_id,
        "attempts": [
            {
                "attempt_id": attempt.id,
                "ranks": [
                    {"rank": 2, "state": "exited", "exit_code": -9, "exited_at": fenced_at},
                    {"rank": 3, "state": "exited", "exit_code": -9, "exited_at": killed_at},
                ],
            }
        ],
    }
    actions.do_heartbeat(b, body, now=t0 + timedelta(seconds=1))
    attempt.refresh_from_db()
    job.refresh_from_db()
    assert attempt.end_reason == "rank 3 on node-1 exited with signal 9 (SIGKILL)"
    assert job.reason.startswith("rank 3 on node-1 exited with signal 9 (SIGKILL); restart 1/2")
    (revised,) = Event.objects.filter(kind="attempt.cause_revised")
    assert "first reported: rank 0 on node-0 exited with exit code 1" in revised.message
    assert job.state == "RESTARTING"  # nothing else about the ended attempt changed


@pytest.mark.django_db
@pytest.mark.parametrize("a_down", [False, True], ids=["a-cordoned", "a-down-cordon-held"])
def test_a_revised_cause_moves_the_nodes_strike_to_the_culprits_node(
    setup, settings, django_capture_on_commit_callbacks, a_down
):
    """The attempt had trained (a failure after the first step strikes the blamed node). Node
    a was blamed first, and that strike cordoned it; once node b's report shows its rank died
    first, a's strike is withdrawn, a is back up, and b gets the strike and the cordon."""
    from datetime import timedelta

    settings.LOCKSTEP = {**settings.LOCKSTEP, "STRIKES_TO_CORDON": 2}
    (a, b), job, attempt = _running_on_two_nodes(setup)
    t0 = timezone.now()
    step = {"kind": "step", "rank": 0, "step": 1, "loss": 1.0, "time": t0.timestamp()}
    beat(a, attempt, {0: None, 1: None}, records=[step], now=t0 - timedelta(seconds=5))
    for earlier in (a, b):  # one strike each from an earlier failure
        strikes.strike_node(earlier, "an earlier failure", now=t0)
    beat(a, attempt, {0: 1, 1: None}, now=t0)
    a.refresh_from_db()
    assert node_strikes(a, t0) == 2 and a.state == "cordoned"  # blamed first
    if a_down:  # a went silent: down, its cordon held for its return
        actions.do_mark_node_lost(a, now=t0, reason="no heartbeat for 31s")
        a.refresh_from_db()
        assert (a.state, a.held_state) == ("down", "cordoned")
    body = {
        "boot_id": b.boot_id,
        "attempts": [
            {
                "attempt_id": attempt.id,
                "ranks": [
                    {
                        "rank": 3,
                        "state": "exited",
                        "exit_code": -9,
                        "exited_at": (t0 - timedelta(seconds=0.3)).timestamp(),
                    }
                ],
            }
        ],
    }
    # The move runs after the heartbeat commits, in a transaction of its own.
    with django_capture_on_commit_callbacks(execute=True):
        actions.do_heartbeat(b, body, now=t0 + timedelta(seconds=1))
    a.refresh_from_db()
    b.refresh_from_db()
    if a_down:  # the held cordon goes with the strike: a comes back up
        assert (a.state, a.held_state) == ("down", "")
        actions.do_heartbeat(a, {"boot_id": a.boot_id, "attempts": []}, now=t0)
        a.refresh_from_db()
    assert node_strikes(a, t0) == 1 and a.state == "up" and a.state_reason == ""
    assert Event.objects.filter(kind="node.uncordoned", node=a, data__automatic=True).exists()
    assert node_strikes(b, t0) == 2 and b.state == "cordoned"
    from portal.console.nodes import node_rows

    health = {row["node"].id: row["health"] for row in node_rows(t0 + timedelta(seconds=2))}
    assert health[a.id] == "1 strike(s) in the window"  # what admins see on the nodes page
    (withdrawn,) = Event.objects.filter(kind="node.strike_withdrawn")
    assert withdrawn.node_id == a.id and "failed because of rank 3 on node-1" in withdrawn.message
    # A second report of the same exit moves nothing again.
    with django_capture_on_commit_callbacks(execute=True):
        actions.do_heartbeat(b, body, now=t0 + timedelta(seconds=2))
    assert Event.objects.filter(kind="node.strike_withdrawn").count() == 1
    assert node_strikes(b, t0) == 2
