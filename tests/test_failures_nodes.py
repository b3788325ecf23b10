"""Failures and the nodes they happen on (DESIGN.md section 8), through the real actions
and scheduler pass: whose fault a failure is (a straggler's node gets a strike, repeated
failures cordon a node and restarts avoid it, failures before the first step are a user
error and strike nobody), nodes lost (a portal outage is not every node dying; an agent
restart is timed from its last heartbeat and strikes its node), planned restarts (no strike,
no restart counted), admins' cordon, drain and uncordon, and rendezvous ports per master."""

from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from jobs import actions, queries
from jobs.actions.nodes import cordoned_automatically
from jobs.actions.strikes import strike_node
from jobs.health import find_stragglers
from jobs.models import Attempt, Event, Job, Node
from jobs.scheduling.loop import housekeeping, run_pass
from tests.failures_helpers import _run, _steps
from tests.heartbeats import beat, commit_checkpoint, live_attempt, submit


def test_stragglers_are_ranks_slower_than_the_rest_of_the_gang():
    gang = {0: [0.010] * 20, 1: [0.011] * 20, 2: [0.060] * 20, 3: [0.009] * 20}
    assert find_stragglers(gang, factor=1.5, min_excess=0.01) == [(2, 0.060, 0.010)]
    # Noise on tiny steps is not a straggler.
    tiny = {0: [0.001] * 20, 1: [0.0025] * 20}
    assert find_stragglers(tiny, factor=1.5, min_excess=0.01) == []


def _computing(setup, settings, rank_2_s: float, rank_3_s: float):
    """A 4-rank job on node-0 (ranks 0, 1: 10 ms of compute a step) and node-1 (ranks 2, 3 at
    the given seconds), 25 steps each reported, then a scheduler pass."""
    settings.LOCKSTEP = {**settings.LOCKSTEP, "STRAGGLER_WINDOW_STEPS": 20}
    job, attempt, a, b, _ = _run(setup)
    records = [r for rank in (0, 1) for r in _steps(1, 25, rank=rank, compute=0.01)]
    beat(a, attempt, {0: None, 1: None}, records=records)
    records = _steps(1, 25, rank=2, compute=rank_2_s) + _steps(1, 25, rank=3, compute=rank_3_s)
    beat(b, attempt, {2: None, 3: None}, records=records)
    run_pass()
    return attempt, b


@pytest.mark.django_db
def test_a_straggler_is_flagged_with_its_node_and_gets_a_strike(setup, settings):
    attempt, b = _computing(setup, settings, 0.01, 0.08)
    event = Event.objects.get(attempt=attempt, kind="attempt.straggler")
    assert event.node == b and event.message.startswith("rank 3 on node-1 is a straggler: 80 ms")
    assert Event.objects.filter(node=b, kind="node.strike").count() == 1
    run_pass(now=timezone.now() + timedelta(minutes=5))  # flagged once per attempt and rank
    assert Event.objects.filter(attempt=attempt, kind="attempt.straggler").count() == 1
    # Later rank 2 is the slow one: the same slow node, already flagged for this attempt.
    a = next(al.node for al in attempt.allocations.all() if al.rank == 0)
    fast = [r for rank in (0, 1) for r in _steps(26, 60, rank=rank, compute=0.01)]
    beat(a, attempt, {0: None, 1: None}, records=fast)
    slow = _steps(26, 60, rank=2, compute=0.07) + _steps(26, 60, rank=3, compute=0.01)
    beat(b, attempt, {2: None, 3: None}, records=slow)
    run_pass(now=timezone.now() + timedelta(minutes=10))
    assert Event.objects.filter(attempt=attempt, kind="attempt.straggler").count() == 1
    assert Event.objects.filter(node=b, kind="node.strike").count() == 1


@pytest.mark.django_db
def test_every_rank_of_one_node_slow_is_one_slow_node_with_one_strike(setup, settings):
    attempt, b = _computing(setup, settings, 0.06, 0.08)
    (event,) = Event.objects.filter(attempt=attempt, kind="attempt.straggler")
    assert event.node == b and event.message.startswith(
        "ranks 2, 3 on node-1 are stragglers (every rank on node-1: the node is slow, not a "
        "rank): rank 3 at 80 ms/step"
    )
    assert event.data["ranks"] == [2, 3] and event.data["rank"] == 3
    assert event.data["compute_s"] == pytest.approx(0.08)
    assert Event.objects.filter(node=b, kind="node.strike").count() == 1
    assert sorted(Attempt.objects.get(pk=attempt.pk).stragglers) == [2, 3]
    run_pass(now=timezone.now() + timedelta(minutes=5))  # flagged once per attempt and rank
    assert Event.objects.filter(attempt=attempt, kind="attempt.straggler").count() == 1
    assert Event.objects.filter(node=b, kind="node.strike").count() == 1


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


@pytest.mark.django_db
def test_a_cordoned_node_restarting_as_planned_while_its_job_runs_takes_no_strike(setup, make_user):
    """Cordoned for maintenance, then its agent is upgraded while a job still runs there: the
    leave takes the node down at once (holding the cordon), so its silence is not a loss,
    the job is requeued without a strike or a restart, and the cordon is back with it."""
    job, attempt, a, b, _ = _run(setup)
    beat(a, attempt, {0: None, 1: None}, records=_steps(1, 3))
    admin = make_user("root", staff=True)
    t0 = timezone.now()
    actions.do_cordon_node(a, actor=admin, reason="maintenance", now=t0)
    actions.do_node_leaving(a, reason="upgrade", now=t0)
    later = t0 + timedelta(seconds=40)  # past the heartbeat timeout, b still beating
    actions.do_heartbeat(b, {"boot_id": b.boot_id, "attempts": []}, now=later)
    housekeeping(later)
    a, _ = actions.do_register_node(
        name=a.name, gpus=2, address="127.0.0.1", boot_id="upgraded", now=later
    )
    attempt.refresh_from_db()
    job.refresh_from_db()
    assert attempt.state == "preempted" and job.restart_count == 0
    assert not Event.objects.filter(kind="node.strike").exists()
    assert (a.state, a.state_reason, a.held_state) == ("cordoned", "maintenance", "")


@pytest.mark.django_db
@pytest.mark.parametrize("state", ["cordoned", "draining"])
def test_a_cordon_or_drain_outlives_the_node_going_silent_and_coming_back(setup, make_user, state):
    """Liveness is not an admin's decision: a cordoned (or draining) node lost for a while
    used to come back up, taking work in the middle of its maintenance."""
    team, user, (a, b), _ = setup
    admin = make_user("root", staff=True)
    t0 = timezone.now()
    actions.do_cordon_node(a, actor=admin, reason="bad DIMM", drain=state == "draining", now=t0)
    later = t0 + timedelta(seconds=40)
    actions.do_heartbeat(b, {"boot_id": b.boot_id, "attempts": []}, now=later)
    housekeeping(later)
    a.refresh_from_db()
    assert (a.state, a.held_state) == ("down", state)
    actions.do_heartbeat(a, {"boot_id": a.boot_id, "attempts": []}, now=later)
    a.refresh_from_db()
    assert (a.state, a.state_reason) == (state, "bad DIMM")
    back = Event.objects.filter(node=a, kind="node.up").latest("id")
    assert back.message.endswith(f"still {state}: bad DIMM")
    # Cordoned while down, then uncordoned while still down: it comes back up.
    actions.do_mark_node_lost(a, now=later, reason="test")
    actions.do_uncordon_node(a, actor=admin)
    actions.do_register_node(name=a.name, gpus=2, address="127.0.0.1", boot_id="new", now=later)
    a.refresh_from_db()
    assert a.state == "up"


@pytest.mark.django_db
def test_the_strike_that_loses_a_node_cordons_it_when_it_is_back(setup):
    """Two strikes, then the node is lost with a job on it: the third strike came while it
    was down, and the conditional cordon (up nodes only) skipped it, so the node came back
    up, uncordoned by its own crash."""
    job, attempt, a, b, _ = _run(setup)
    for n in range(2):
        _strike(a, n)
    beat(a, attempt, {0: None, 1: None}, records=_steps(1, 3))
    actions.do_mark_node_lost(a, now=timezone.now(), reason="no heartbeat for 31s")
    assert Event.objects.filter(node=a, kind="node.strike").count() == 3
    a.refresh_from_db()
    assert (a.state, a.held_state) == ("down", "cordoned")
    actions.do_heartbeat(a, {"boot_id": a.boot_id, "attempts": []}, now=timezone.now())
    a.refresh_from_db()
    assert a.state == "cordoned" and "3 failures in 24h" in a.state_reason
    assert cordoned_automatically(a)  # so `make up` may release its own demo nodes


def _strike(node, n):
    strike_node(node, f"test failure {n}", now=timezone.now())


@pytest.mark.django_db
def test_a_heartbeat_that_says_leaving_applies_the_leave_before_the_exits(setup):
    """The agent is leaving but its leaving/ call failed (a 5xx): its heartbeats say
    `leaving`, and the ranks' exit 0 after their checkpoint is a stop, not a finished job."""
    job, attempt, a, b, _ = _run(setup, max_restarts=2)
    beat(a, attempt, {0: None, 1: None}, records=_steps(1, 5))
    body = {
        "boot_id": a.boot_id,
        "leaving": True,
        "attempts": [
            {
                "attempt_id": attempt.id,
                "ranks": [
                    {"rank": r, "pid": 100 + r, "state": "exited", "exit_code": 0} for r in (0, 1)
                ],
            }
        ],
    }
    actions.do_heartbeat(a, body, now=timezone.now())
    attempt.refresh_from_db()
    job.refresh_from_db()
    a.refresh_from_db()
    assert attempt.state == "stopping" and job.state == "PREEMPTING"
    assert a.state == "down" and a.leaving_at is not None
    beat(b, attempt, {2: 0, 3: 0})
    attempt.refresh_from_db()
    job.refresh_from_db()
    assert attempt.state == "preempted" and job.state == "QUEUED" and job.restart_count == 0
    assert not Event.objects.filter(kind="node.strike").exists()


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
    job.refresh_from_db()  # the job says it is being stopped, as for any preemption
    assert job.state == "PREEMPTING" and job.reason.endswith("draining: bad fan")
    assert Event.objects.filter(job=job, kind="job.preempting", data__drain=True).exists()
    beat(node, attempt, {0: 0, 1: 0})
    job.refresh_from_db()
    assert job.state == "QUEUED" and "requeued" in job.reason
    assert admin.post(f"/api/v1/nodes/{node.id}/uncordon/").json()["state"] == "up"


@pytest.mark.django_db
def test_rendezvous_ports_of_live_attempts_on_one_master_differ(setup, make_nodes):
    team, user, _, _ = setup
    jobs = [submit(team, user, gpus=1) for _ in range(4)]
    run_pass()
    ports = [live_attempt(j).master_port for j in jobs]
    assert len(set(ports)) == 4
