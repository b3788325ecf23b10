"""Moving a job off a straggler when the arithmetic says so (jobs/health.straggler_verdict,
jobs/scheduling/detect.py, jobs/actions/failures.do_flag_straggler): the pure rule, then the
real scheduler pass on the test database with step records as agents send them. Live, the
e2e test (tests/test_e2e_faults.py) keeps a straggler whose gang has no free node to go to."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from jobs.actions.node_health import held_for_health, wants_check
from jobs.health import straggler_verdict
from jobs.models import Attempt, Event, Job, Node
from jobs.scheduling.loop import run_pass
from tests.heartbeats import beat, live_attempt, submit
from tests.live import Api, LiveCluster, wait_for


def _verdict(**overrides):
    args = {
        "excess_s": 0.07,
        "step_time_s": 0.1,
        "remaining_s": 3600.0,
        "restart_s": 30.0,
        "spare": True,
        "moves_left": True,
    }
    return straggler_verdict(**{**args, **overrides})


def test_moving_pays_when_the_slowdown_left_costs_more_than_a_restart():
    verdict = _verdict()
    # 3600 s at 0.1 s a step is 36,000 steps, each 70 ms longer: 2,520 s against 30 s.
    assert verdict.move and verdict.slowdown_s == pytest.approx(2520.0)
    assert verdict.text("n1") == (
        "staying costs ~2520 s (70 ms on each 100 ms step over the ~3600 s left) against "
        "~30 s for a restart: moving the job off n1"
    )
    near_end = _verdict(remaining_s=30.0)  # 21 s of slowdown left < a 30 s restart
    assert not near_end.move and near_end.text("n1").endswith(": keeping it")


@pytest.mark.parametrize(
    ("blocked", "why"),
    [({"spare": False}, "no free node to move to"), ({"moves_left": False}, "moved off a")],
)
def test_a_move_that_would_pay_is_not_made_without_a_node_or_a_second_time(blocked, why):
    verdict = _verdict(**blocked)
    assert not verdict.move and why in verdict.text("n1")


def _steps(first, last, rank, compute, step_time=0.1):
    return [
        {
            "kind": "step",
            "rank": rank,
            "step": s,
            "loss": 1.0,
            "step_time_s": step_time,
            "compute_s": compute,
        }
        for s in range(first, last + 1)
    ]


def _straggling(setup, make_nodes, settings, startup_s=0.0, **fields):
    """A 4-GPU job on node-0 and node-1 whose rank 3 (on node-1) computes 8x slower; a third
    node is free. `startup_s`: how long its attempt took to its first step (the job's
    measured restart cost)."""
    settings.LOCKSTEP = {**settings.LOCKSTEP, "STRAGGLER_WINDOW_STEPS": 20}
    team, user, (a, b), _ = setup
    (spare,) = make_nodes(1, 2, prefix="spare")
    job = submit(team, user, **fields)
    run_pass()
    attempt = live_attempt(job)
    assert {al.node_id for al in attempt.allocations.all()} == {a.id, b.id}
    Attempt.objects.filter(pk=attempt.pk).update(
        created_at=attempt.created_at - timedelta(seconds=startup_s)
    )
    fast = [r for rank in (0, 1) for r in _steps(1, 30, rank, compute=0.01)]
    beat(a, attempt, {0: None, 1: None}, records=fast)
    slow = _steps(1, 30, 2, compute=0.01) + _steps(1, 30, 3, compute=0.08)
    beat(b, attempt, {2: None, 3: None}, records=slow)
    beat(spare, attempt, {})
    run_pass()
    return job, attempt, a, b, spare


@pytest.mark.django_db
def test_a_straggler_that_costs_more_than_a_restart_moves_the_job_off_its_node(
    setup, make_nodes, settings
):
    job, attempt, a, b, spare = _straggling(setup, make_nodes, settings, time_limit_s=36000)
    event = Event.objects.get(attempt=attempt, kind="attempt.straggler")
    assert event.data["moved"] and event.data["slowdown_s"] > event.data["restart_s"]
    assert "moving the job off node-1" in event.message
    b.refresh_from_db()
    # Held out of scheduling; asked for a check only after HEALTH_RECHECK_S.
    assert b.state == Node.State.CORDONED and held_for_health(b)
    assert not wants_check(b, timezone.now()) and wants_check(
        b, timezone.now() + timedelta(hours=1)
    )
    job.refresh_from_db()
    assert job.state == Job.State.PREEMPTING
    # The ranks checkpoint and exit: requeued with no restart used, then started without node-1.
    beat(a, attempt, {0: 0, 1: 0})
    beat(b, attempt, {2: 0, 3: 0})
    job.refresh_from_db()
    assert job.state == Job.State.QUEUED and job.restart_count == 0, job.reason
    assert job.reason.startswith("requeued: moving off the straggler's node node-1")
    assert Attempt.objects.get(pk=attempt.pk).state == Attempt.State.PREEMPTED
    run_pass()
    second = live_attempt(job)
    assert b.id not in {al.node_id for al in second.allocations.all()}
    assert spare.id in {al.node_id for al in second.allocations.all()}


@pytest.mark.django_db
def test_a_straggler_near_the_end_of_its_job_is_left_where_it_is(setup, make_nodes, settings):
    # 60 s to start; 10 s left of its time limit: ~7 s of slowdown, less than a restart.
    job, attempt, a, b, _ = _straggling(setup, make_nodes, settings, startup_s=60, time_limit_s=70)
    event = Event.objects.get(attempt=attempt, kind="attempt.straggler")
    assert not event.data["moved"] and event.message.endswith(": keeping it")
    b.refresh_from_db()
    job.refresh_from_db()
    assert b.state == Node.State.UP and job.state == Job.State.RUNNING


@pytest.mark.e2e
def test_live_a_slowed_rank_moves_the_job_off_its_node_once_and_the_node_comes_back(tmp_path):
    """Three agents of 2 GPUs, a 4-GPU reference-trainer job whose rank 3 sleeps 150 ms a
    step, a long time limit: the straggler costs more than a restart, so its node is held and
    the job checkpoint-stops and restarts on the other two. The slowness follows rank 3 (it is
    injected by rank), so in the second attempt it straggles again and is kept (moved once
    already; and while the first node is held there is no free node). The held node passes
    the health check it is then asked for and schedules again."""
    live = LiveCluster(
        tmp_path / "cluster",
        agents=3,
        gpus_per_agent=2,
        env={"LOCKSTEP_HEALTH_RECHECK_S": "10", "LOCKSTEP_STRAGGLER_MAX_MOVES": "1"},
    )
    try:
        live.start()
        api = Api(live.url, live.token("alice", "--team", "slow", "--quota", "6"))
        wait_for(lambda: len(api.get("/api/v1/nodes/").json()["results"]) == 3, 60, "agents")
        command = [
            *("python", "-m", "trainer", "--steps", "150", "--checkpoint-every", "10"),
            *("--fault-slow-rank", "3", "--fault-slow-ms", "150"),
        ]
        response = api.post(
            "/api/v1/jobs/",
            {
                "name": "slowpoke",
                "team": "slow",
                "image": "lockstep/trainer:latest",
                "command": command,
                "gpus": 4,
                "time_limit_s": 36000,
            },
        )
        job = response.json()["id"]

        def ended():
            live.check_alive()
            detail = api.get(f"/api/v1/jobs/{job}/").json()
            return detail if detail["state"] in ("SUCCEEDED", "FAILED") else None

        done = wait_for(ended, 400, "the job to end")
        assert done["state"] == "SUCCEEDED", done["reason"]
        events = api.get(f"/api/v1/jobs/{job}/events/").json()
        flagged = [e for e in events if e["kind"] == "attempt.straggler"]
        assert len(flagged) == 2, [e["message"] for e in flagged]
        first, second = flagged
        moved_off = first["node"]
        assert first["data"]["moved"] and "moving the job off" in first["message"]
        # Kept: moved once already, and (while its node is held) no free node to go to.
        assert not second["data"]["moved"] and ": keeping it (" in second["message"]
        one, two = done["attempts"][:2]
        assert one["state"] == "preempted" and moved_off in one["nodes"]
        assert moved_off not in two["nodes"] and len(done["attempts"]) == 2
        assert two["resumed_from_step"] > 0
        # Held, asked for a check after HEALTH_RECHECK_S, passed, back in scheduling.
        node = wait_for(
            lambda: (
                (
                    n := next(
                        x
                        for x in api.get("/api/v1/nodes/").json()["results"]
                        if x["name"] == moved_off
                    )
                )["state"]
                == "up"
                and n
            ),
            120,
            "the held node to pass its health check",
        )
        assert node["health"]["ok"] and node["health"]["kind"] == "full"
    finally:
        live.stop()
