"""Heartbeats of one gang's nodes arriving at the same moment, each on its own database
connection: the attempt must still move on (RUNNING when every rank is up, ended when every
rank has exited). Meaningful on PostgreSQL (the .ci/run leg), where transactions overlap; SQLite
serializes writers, so there it only checks the outcome."""

import threading
import time
from functools import partial

import pytest
from django.db import connection, connections, transaction
from django.utils import timezone

from jobs import actions
from jobs.actions import preemption as preemption_actions
from jobs.models import GPU, Attempt, Job, MetricPoint, PreemptionRequest
from jobs.scheduling.apply import apply_plan
from jobs.scheduling.loop import run_pass
from jobs.scheduling.vocab import Plan
from tests.claims import placement_on
from tests.heartbeats import beat, live_attempt, past_protection, submit

ROUNDS = 12


def _together(calls) -> None:
    """Run the calls in threads released at once; each thread uses its own connection."""
    barrier = threading.Barrier(len(calls))
    errors = []

    def run(call):
        try:
            barrier.wait(timeout=30)
            call()
        except Exception as exc:  # reported below, with the thread's cause
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=run, args=(call,)) for call in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors


@pytest.mark.django_db(transaction=True)
def test_simultaneous_reports_from_every_node_of_a_gang_start_and_end_it(setup):
    team, user, (a, b), _ = setup
    for round_ in range(ROUNDS):
        job = submit(team, user)
        run_pass()
        attempt = live_attempt(job)
        _together(
            [
                partial(beat, a, attempt, {0: None, 1: None}),
                partial(beat, b, attempt, {2: None, 3: None}),
            ]
        )
        assert Attempt.objects.get(pk=attempt.pk).state == Attempt.State.RUNNING, (
            f"round {round_}: every rank reported running, the attempt stayed "
            f"{Attempt.objects.get(pk=attempt.pk).state}"
        )
        if round_ % 2:  # half the rounds end in a stop (a preemption or cancel), half by exit
            actions.do_cancel_job(Job.objects.get(pk=job.pk), actor=user, now=timezone.now())
        _together(
            [partial(beat, a, attempt, {0: 0, 1: 0}), partial(beat, b, attempt, {2: 0, 3: 0})]
        )
        ended = Attempt.objects.get(pk=attempt.pk)
        assert ended.ended_at is not None, (
            f"round {round_}: every rank exited, the attempt stayed {ended.state} on "
            f"{connection.vendor}"
        )


def _waiting_on_a_lock() -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        return cursor.fetchone()[0]


def _preempt(job, user):
    request = PreemptionRequest.objects.create(
        victim=job,
        claimant=submit(job.team, user),
        kind=PreemptionRequest.Kind.RECLAIM,
        reason="reclaiming its team's quota",
        created_at=timezone.now(),
    )
    actions.do_decide_preemption(request, approve=True, actor=None, now=timezone.now())


def _cancel(job, user):
    actions.do_cancel_job(job, actor=user, now=timezone.now())


_POSTGRES_ONLY = pytest.mark.skipif(
    connection.vendor != "postgresql",
    reason="needs row locks held across connections: SQLite serializes writers, so the "
    "stop cannot start while the heartbeat's transaction is open (the PostgreSQL leg runs it)",
)


def _race(stop, job, user, heartbeat_opens, heartbeat_finishes) -> list[Exception]:
    """The heartbeat's transaction opens (`heartbeat_opens`, taking its locks); the stop
    starts and is seen waiting on a lock; then the heartbeat finishes and commits. Errors of
    either side are returned."""
    in_heartbeat, commit = threading.Event(), threading.Event()
    errors = []

    def heartbeat():
        try:
            with transaction.atomic():
                heartbeat_opens()
                in_heartbeat.set()
                assert commit.wait(timeout=30)
                heartbeat_finishes()
        except Exception as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    def stopper():
        try:
            stop(Job.objects.get(pk=job.pk), user)
        except Exception as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    beating = threading.Thread(target=heartbeat)
    beating.start()
    assert in_heartbeat.wait(timeout=30), errors
    stopping = threading.Thread(target=stopper)
    stopping.start()
    deadline = time.monotonic() + 20
    while _waiting_on_a_lock() == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _waiting_on_a_lock() > 0, "the stop never waited for the heartbeat's attempt lock"
    commit.set()
    beating.join(timeout=60)
    stopping.join(timeout=60)
    return errors


@_POSTGRES_ONLY
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("stop", [_preempt, _cancel], ids=["reclaim", "cancel"])
def test_a_stop_waiting_on_a_heartbeat_does_not_deadlock_with_its_commit(setup, stop):
    """A heartbeat holds its attempt's row lock and stores step records, whose foreign key to
    the job PostgreSQL checks at COMMIT with a KEY SHARE lock on the job row. A stop
    (a reclaim, a cancel) that locked the job row meanwhile and waits for the attempt row
    must not hold a lock that this check waits for: with FOR UPDATE both waited on each
    other, PostgreSQL killed one (CI: the reclaim's approval died, the borrower never
    stopped). The stop must end up applied and the heartbeat's steps stored."""
    team, user, (a, b), _ = setup
    job, attempt = _running(team, user, a, b)
    errors = _race(
        stop,
        job,
        user,
        lambda: beat(a, attempt, {0: None, 1: None}, records=_steps(1, 5)),
        lambda: None,
    )
    assert not errors, errors
    assert Attempt.objects.get(pk=attempt.pk).state == Attempt.State.STOPPING
    assert MetricPoint.objects.filter(attempt=attempt, name="loss").count() == 5


@_POSTGRES_ONLY
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("stop", [_preempt, _cancel], ids=["reclaim", "cancel"])
def test_a_stop_takes_the_attempt_before_the_job_as_the_heartbeat_does(setup, stop):
    """The heartbeat that reports a gang's last rank up locks the attempt, then marks it and
    its job running (an UPDATE of the job row). A stop that locked the job first and then
    waited for the attempt deadlocked with it (found in review); stops now lock the live
    attempt first. Here the heartbeat's transaction holds the attempt while the stop starts,
    then marks the attempt running and commits."""
    team, user, (a, b), _ = setup
    job = submit(team, user)
    run_pass()
    attempt = live_attempt(job)
    beat(a, attempt, {0: None, 1: None})  # half the gang up: still STARTING
    errors = _race(
        stop,
        Job.objects.get(pk=job.pk),
        user,
        lambda: Attempt.objects.select_for_update(no_key=True).get(pk=attempt.pk),
        lambda: actions.do_mark_attempt_running(attempt, now=timezone.now()),
    )
    assert not errors, errors
    assert Attempt.objects.get(pk=attempt.pk).state == Attempt.State.STOPPING


def _running(team, user, a, b):
    job = submit(team, user)
    run_pass()
    attempt = live_attempt(job)
    beat(a, attempt, {0: None, 1: None})
    beat(b, attempt, {2: None, 3: None})
    return Job.objects.get(pk=job.pk), attempt


def _steps(first, last):
    return [
        {"kind": "step", "rank": 0, "step": s, "loss": 1.0, "tokens_per_s": 1.0}
        for s in range(first, last + 1)
    ]


@_POSTGRES_ONLY
@pytest.mark.django_db(transaction=True)
def test_a_claim_waits_for_a_drain_of_its_node_and_then_refuses_it(setup, make_user):
    """The claim read its nodes' state unlocked: a drain committing between that read and
    the claim's commit did not see the new attempt, which stayed on the draining node. The
    claim now takes a share lock on its nodes, waits for the drain, and finds the node
    draining."""
    team, user, (a, b), _ = setup
    admin = make_user("root", staff=True)
    job = submit(team, user, gpus=2)
    placement = placement_on(job, list(GPU.objects.filter(node=a).order_by("index")))
    results = []
    errors = _race(
        lambda *_: results.append(apply_plan(Plan(placements=(placement,)), now=timezone.now())),
        job,
        user,
        lambda: actions.do_cordon_node(
            a, actor=admin, reason="firmware", drain=True, now=timezone.now()
        ),
        lambda: None,
    )
    assert not errors, errors
    assert not Attempt.objects.filter(job=job).exists()
    assert Job.objects.get(pk=job.pk).state == Job.State.QUEUED
    (applied,) = results
    assert "no longer up" in applied.rejected[job.id]


@_POSTGRES_ONLY
@pytest.mark.django_db(transaction=True)
def test_a_cancel_while_its_preemption_is_being_approved_neither_waits_nor_deadlocks(
    make_team, make_user, make_nodes, settings, tmp_path
):
    """An approval locks its request, then the victim's attempt and job; a cancel locks the
    attempt and job, then withdraws the job's open requests. Waiting for the request there
    deadlocked with the approval (PostgreSQL killed one: a user's cancel got a 500). The
    cancel now skips a request being decided, and the approval, once it has the job, finds
    it cancelled and withdraws itself."""
    settings.LOCKSTEP = {
        **settings.LOCKSTEP,
        "CHECKPOINT_ROOT": str(tmp_path),
        "PREEMPTION_APPROVAL_DELAY_S": 120.0,
    }
    owner = make_team("owner", quota=4)
    olga = make_user("olga", team=owner)
    (node,) = make_nodes(1, 2)
    low = submit(owner, olga, gpus=2, priority="low")
    run_pass()
    beat(node, live_attempt(low), {0: None, 1: None})
    past_protection()
    submit(owner, olga, gpus=2, priority="high")
    run_pass()
    (request,) = PreemptionRequest.objects.all()
    errors, locked, go = [], threading.Event(), threading.Event()

    def approve():
        try:
            with transaction.atomic():
                held = PreemptionRequest.objects.select_for_update(no_key=True).get(pk=request.pk)
                locked.set()
                assert go.wait(30)
                held.state = PreemptionRequest.State.APPROVED
                held.save(update_fields=["state"])
                preemption_actions._execute_preemption(held, now=timezone.now())
        except Exception as exc:
            errors.append(("approve", exc))
        finally:
            connections.close_all()

    def cancel():
        try:
            actions.do_cancel_job(Job.objects.get(pk=low.pk), actor=olga, now=timezone.now())
        except Exception as exc:
            errors.append(("cancel", exc))
        finally:
            connections.close_all()

    approving = threading.Thread(target=approve)
    approving.start()
    assert locked.wait(30)
    cancelling = threading.Thread(target=cancel)
    cancelling.start()
    cancelling.join(timeout=15)
    assert not cancelling.is_alive(), "the cancel waited for the request being approved"
    go.set()
    approving.join(timeout=60)
    assert not errors, errors
    assert Job.objects.get(pk=low.pk).state == Job.State.CANCELLED
    assert PreemptionRequest.objects.get(pk=request.pk).state == "withdrawn"
