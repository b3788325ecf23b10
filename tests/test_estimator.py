"""The leader's start estimates (jobs/scheduling/estimator.py): in the pass while they are
cheap; once one took longer than the budget, in a process beside the leader, at most once per
interval, each pass writing the latest finished ones for the jobs still queued. Real worker
processes (spawned), the real estimate."""

from dataclasses import replace
from datetime import timedelta

import pytest

from jobs.models import Job
from jobs.scheduling.estimate import estimate_starts, head_of_queue
from jobs.scheduling.estimator import Estimator
from jobs.scheduling.loop import run_pass
from jobs.scheduling.policy import plan
from tests.builders import T0, job, node, running, snapshot, team
from tests.heartbeats import submit

pytestmark = pytest.mark.timeout(120)


def _busy_cluster(queued: int = 6):
    """Two full nodes whose jobs end at known times, and `queued` jobs behind them."""
    t = team("a", quota=16, used=16)
    nodes = [node("n1"), node("n2")]
    runs = [
        running(900 + i, n, range(8), team_id=t.id, ends_in=600.0 * (i + 1))
        for i, n in enumerate(nodes)
    ]
    nodes = [replace(n, free=frozenset()) for n in nodes]
    jobs = [job(i + 1, 8, team_id=t.id, submitted=i, estimate=1800.0) for i in range(queued)]
    return snapshot(nodes, jobs, [t], runs)


def _expected(snap):
    return estimate_starts(head_of_queue(snap), stop_grace_s=60.0, approval_delay_s=0.0)


def _ask(estimator, snap):
    return estimator.estimates(snap, stop_grace_s=60.0, approval_delay_s=0.0)


def test_cheap_estimates_are_worked_out_in_the_pass_every_time():
    estimator = Estimator(inline_s=60.0, every_s=3600.0)
    try:
        snap = _busy_cluster()
        first = _ask(estimator, snap)
        assert first == _expected(snap) and len(first) == 6
        later = replace(snap, now=T0 + timedelta(seconds=30))
        assert _ask(estimator, later) == _expected(later)  # fresh, not the interval's
        assert estimator.background == 0 and estimator._pool is None
    finally:
        estimator.close()


def test_slow_estimates_move_beside_the_pass_and_refresh_at_most_every_interval():
    ready = []
    # Any real estimate takes longer than 0 s: the first runs in the pass and is measured,
    # every later one runs in the worker process.
    estimator = Estimator(inline_s=0.0, every_s=0.0, on_ready=lambda: ready.append(1))
    try:
        snap = _busy_cluster()
        first = _ask(estimator, snap)
        assert first == _expected(snap) and estimator.background == 0
        # One job started meanwhile and the clock moved: the pass gets the last estimates,
        # for the jobs still queued, and a background estimate of its own snapshot starts.
        later = replace(snap, now=T0 + timedelta(seconds=30), queued=snap.queued[1:])
        stale = _ask(estimator, later)
        assert stale == {k: v for k, v in first.items() if k != 1}
        assert estimator.background == 1
        assert estimator.wait(90) and ready == [1]
        # Within the interval no second one starts; the finished ones are used and reused.
        estimator.every_s = 3600.0
        fresh = _ask(estimator, later)
        assert fresh == _expected(later) and fresh != stale  # made at the later clock
        assert _ask(estimator, later) == fresh and estimator.background == 1
        # Past it, the next one does.
        estimator.every_s = 0.0
        _ask(estimator, later)
        assert estimator.background == 2 and estimator.wait(90)
    finally:
        estimator.close()


def test_a_leader_whose_plan_is_slow_sends_even_its_first_estimate_beside_the_pass():
    # A leader starting on a large queue: plan() alone took longer than the budget, and the
    # estimate replays plan() many times, so it is not run in the pass to learn its cost.
    estimator = Estimator(inline_s=0.2, every_s=3600.0)
    try:
        snap = _busy_cluster()
        assert (
            estimator.estimates(snap, stop_grace_s=60.0, approval_delay_s=0.0, plan_s=0.35) == {}
        )  # nothing known yet: the pass writes no estimate rather than wait for one
        assert estimator.background == 1 and estimator.wait(90)
        assert _ask(estimator, snap) == _expected(snap)  # the next pass has them
        # Measured cheap, the later ones stay beside the pass all the same (within the
        # interval, the last ones are reused): a pass's cost does not swing with them.
        assert estimator.cost_s < estimator.inline_s
        later = replace(snap, now=T0 + timedelta(seconds=30))
        assert _ask(estimator, later) == _expected(snap)  # made at the earlier clock
        assert estimator.background == 1
    finally:
        estimator.close()


def test_an_estimate_that_fails_beside_the_pass_keeps_the_last_ones(caplog):
    estimator = Estimator(inline_s=0.0, every_s=0.0)
    try:
        snap = _busy_cluster()
        first = _ask(estimator, snap)
        # Cannot be sent to the worker (a node's rack the head's order never reads).
        unsendable = replace(snap.nodes[0], rack=lambda: "r1")
        broken = replace(snap, nodes=(unsendable, *snap.nodes[1:]))
        assert _ask(estimator, broken) == first
        assert estimator.wait(90)
        assert _ask(estimator, snap) == first  # the last ones kept
        assert "start estimate failed" in caplog.text
    finally:
        estimator.close()


@pytest.mark.django_db
def test_the_loops_estimator_writes_background_estimates_at_the_next_pass(
    make_team, make_user, make_nodes
):
    team_ = make_team("lab", quota=8)
    user = make_user("ann", team=team_)
    make_nodes(1, 4)
    submit(team_, user, gpus=4, time_limit_s=3600)
    run_pass()
    waiting = submit(team_, user, gpus=4)
    estimator = Estimator(inline_s=-1.0, every_s=0.0)  # always beside the pass
    try:
        report, _ = run_pass(estimator=estimator)
        # The pass says where its time went, phase by phase.
        assert list(report.phases) == [
            "housekeeping",
            "snapshot",
            "plan",
            "estimates",
            "apply",
            "reasons",
        ]
        assert 0 < sum(report.phases.values()) <= report.seconds + 0.01
        waiting.refresh_from_db()
        assert waiting.reason and waiting.estimated_start_at is None  # not in yet
        assert estimator.background == 1 and estimator.wait(90)
        run_pass(estimator=estimator)
        waiting.refresh_from_db()
        assert waiting.estimated_start_at is not None
        assert waiting.promised_start_at == waiting.estimated_start_at
        inline = Job.objects.get(pk=waiting.pk)
        run_pass()  # the pass's own estimate of the same state agrees
        inline.refresh_from_db()
        assert inline.estimated_start_at == waiting.estimated_start_at
    finally:
        estimator.close()


def test_closing_ends_the_worker_even_with_an_estimate_in_flight():
    import multiprocessing

    estimator = Estimator(inline_s=-1.0, every_s=0.0)  # always beside the pass
    _ask(estimator, _busy_cluster(queued=40))
    assert estimator.background == 1 and multiprocessing.active_children()
    estimator.close()
    assert not multiprocessing.active_children()
    assert estimator._pool is None and estimator.wait(0)


def test_a_worker_that_dies_is_replaced_and_no_pass_fails(caplog):
    estimator = Estimator(inline_s=-1.0, every_s=0.0)
    try:
        snap = _busy_cluster()
        _ask(estimator, snap)
        (worker,) = estimator._pool._processes.values()
        worker.kill()  # as the kernel's OOM killer would
        assert estimator.wait(90)
        assert _ask(estimator, snap) == {}  # no estimate yet; the pass goes on
        assert "start estimate failed" in caplog.text
        # The next one runs in a new worker and arrives.
        _ask(estimator, snap)
        assert estimator.background == 2 and estimator.wait(90)
        assert _ask(estimator, snap) == _expected(snap)
    finally:
        estimator.close()


def test_the_head_of_the_queue_taken_from_the_plans_order_is_the_same_as_sorting_again():
    # Teams of different usage, priorities and submit times: the policy's order is not the ids'.
    heavy = team("heavy", quota=8, used=8)
    light = team("light", quota=8)
    nodes = [replace(node("n1"), free=frozenset())]
    queued = [
        job(i, 1 + i % 4, team_id=(heavy, light)[i % 2].id, prio=i % 3, submitted=(97 * i) % 50)
        for i in range(1, 41)
    ]
    snap = snapshot(nodes, queued, [heavy, light])
    order = plan(snap).order
    assert sorted(order) == list(range(1, 41)) and list(order) != sorted(order)
    for head in (5, 40, 100):
        assert head_of_queue(snap, head, order=order) == head_of_queue(snap, head)
