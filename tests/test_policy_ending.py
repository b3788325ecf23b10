"""A claim that jobs ending anyway would meet within a stop's grace waits for them instead of
stopping a job (docs/scheduling.md, rule 5; pure policy, no database). The claim waits the
grace for its victims in any case, and each stop costs its victim a restart."""

import dataclasses
from datetime import timedelta

from jobs.scheduling.policy import SchedulingPass, plan
from jobs.scheduling.simulate import SimConfig, run
from jobs.scheduling.trace import TeamQuota, TraceJob
from jobs.scheduling.vocab import PreemptionKind
from tests.builders import T0, job, node, placed, running, snapshot, team


def ends(run, in_s: float):
    """The running job's GPUs are free `in_s` from now at the latest (time limit + grace)."""
    return dataclasses.replace(run, frees_by=T0 + timedelta(seconds=in_s))


def _borrowed_cluster(ending_in: float | None):
    """owner (quota 8) needs 4 GPUs; guest borrows both nodes: job 10 (4 GPUs on n1) frees
    its GPUs `ending_in` seconds from now, the others run for hours."""
    owner = team("owner", quota=8, used=0)
    guest = team("guest", quota=0, borrow=16, used=16)
    n1, n2 = node("n1", 8, busy=8), node("n2", 8, busy=8)
    soon = running(10, n1, [0, 1, 2, 3], team_id=guest.id, checkpoint_age=10)
    runs = [
        soon if ending_in is None else ends(soon, ending_in),
        running(11, n1, [4, 5, 6, 7], team_id=guest.id, checkpoint_age=5),
        running(12, n2, range(8), team_id=guest.id, checkpoint_age=5),
    ]
    return owner, guest, [n1, n2], runs


def test_a_reclaim_met_by_a_job_ending_within_the_grace_stops_nobody_and_holds_its_gpus():
    owner, guest, nodes, runs = _borrowed_cluster(ending_in=40)
    claimant = job(1, 4, team_id=owner.id)
    p = plan(snapshot(nodes, [claimant], [owner, guest], runs))
    assert p.preemptions == () and p.placements == ()
    wait = p.waits[1]
    assert wait.code == "ending" and wait.data["ending"] == (10,)
    assert wait.reserved_nodes == ("n1",)
    assert wait.data["until"] == (T0 + timedelta(seconds=40)).timestamp()
    assert p.reasons[1].startswith("waiting for job 10 to end by 12:00:40 UTC")
    assert "nothing is stopped for it" in p.reasons[1]
    assert p.reservation == (1, (nodes[0].id,))


def test_without_such_an_end_the_same_claim_reclaims():
    # The baseline the rule is measured against: no end known, or one past the grace.
    for ending_in in (None, 61.0):
        owner, guest, nodes, runs = _borrowed_cluster(ending_in)
        p = plan(snapshot(nodes, [job(1, 4, team_id=owner.id)], [owner, guest], runs))
        assert [pr.kind for pr in p.preemptions] == [PreemptionKind.RECLAIM], ending_in
        assert p.waits[1].code == "preempting"


def test_an_end_already_past_is_not_waited_for():
    # Its time limit and grace have passed and it still holds its GPUs (a late exit report):
    # waiting again would have no bound, so the reclaim goes ahead.
    owner, guest, nodes, runs = _borrowed_cluster(ending_in=-5)
    p = plan(snapshot(nodes, [job(1, 4, team_id=owner.id)], [owner, guest], runs))
    assert [pr.kind for pr in p.preemptions] == [PreemptionKind.RECLAIM]


def test_a_job_stopping_for_another_claimant_is_not_waited_for():
    owner, guest, nodes, runs = _borrowed_cluster(ending_in=None)
    runs[0] = dataclasses.replace(
        ends(runs[0], 30), stopping=True, claimant_id=99
    )  # its GPUs are job 99's
    p = plan(snapshot(nodes, [job(1, 4, team_id=owner.id)], [owner, guest], runs))
    assert p.waits[1].code == "preempting"
    assert 10 not in {pr.victim_job_id for pr in p.preemptions}


def test_the_held_gpus_are_not_given_to_a_later_job_of_the_pass():
    # n1 has 2 free GPUs and job 10's 2 end within the grace; the claimant needs 4 on one
    # node. A later small job would take the 2 free ones and leave it short.
    owner = team("owner", quota=8, used=0)
    guest = team("guest", quota=0, borrow=16, used=14)
    other = team("other", quota=0, borrow=4, used=0)  # borrows: may not claim
    n1, n2 = node("n1", 8, busy={0, 1, 2, 3, 4, 5}), node("n2", 8, busy=8)
    runs = [
        ends(running(10, n1, [0, 1], team_id=guest.id), 20),
        running(11, n1, [2, 3, 4, 5], team_id=guest.id),
        running(12, n2, range(8), team_id=guest.id),
    ]
    queue = [job(1, 4, team_id=owner.id), job(2, 2, team_id=other.id, submitted=50)]
    p = plan(snapshot([n1, n2], queue, [owner, guest, other], runs))
    assert p.waits[1].code == "ending" and p.preemptions == ()
    assert 2 not in placed(p) and p.waits[2].code == "behind_reservation"


def test_a_job_behind_the_reservation_that_may_not_claim_does_not_wait_for_ends():
    # Two borrowing jobs; the first waits for job 11's end and holds the reservation. The
    # second may not claim behind it, so it holds no nodes for job 12's end either (it would
    # be passing the head by holding GPUs before the head has its own).
    owner = team("owner", quota=0, borrow=16, used=0)
    borrower = team("borrower", quota=0, borrow=16, used=0)
    guest = team("guest", quota=24, used=24)
    n1, n2, n3 = node("n1", 8, busy=8), node("n2", 8, busy=8), node("n3", 8, busy=8)
    runs = [
        running(10, n1, range(8), team_id=guest.id, ends_in=3000),
        ends(running(11, n2, range(8), team_id=guest.id, ends_in=30), 30),
        ends(running(12, n3, range(8), team_id=guest.id, ends_in=40), 40),
    ]
    head = job(1, 8, team_id=owner.id, prio=2)
    later = job(2, 8, team_id=borrower.id)
    p = plan(snapshot([n1, n2, n3], [head, later], [owner, borrower, guest], runs))
    assert p.waits[1].code == "ending" and p.reservation == (1, (n2.id,))
    assert p.waits[2].code == "behind_reservation"


def test_in_the_simulator_a_borrower_ending_within_the_grace_frees_the_gpus_for_a_reclaim(
    monkeypatch,
):
    # b borrows the whole node: b1 until 5,000 s, b2 for hours. a's 4-GPU job (within a's
    # quota) arrives 40 s before b1 ends.
    q = {"a": TeamQuota(8, 0), "b": TeamQuota(0, 8)}
    config = SimConfig(gpus=8, quotas=q, checkpoint_on_stop=True)

    def replay(arrival: float):
        trace = [
            TraceJob("b1", 0, 4, 5000, "b"),
            TraceJob("b2", 10, 4, 20_000, "b"),
            TraceJob("a1", arrival, 4, 1000, "a"),
        ]
        result = run(trace, "lockstep", config)
        ends = {r[0]: r[4] for r in result.records}
        return ends, result.metrics["preemptions"]["executed"], result.metrics["teams"]["a"]

    ends, stops, a = replay(4960)
    assert stops == 0 and ends["b2"] == 20_010  # nobody stopped; b2 ran on untouched
    assert a["reclaim_max_s"] == 40  # within the 60 s grace, as a reclaim would be
    # 100 s before b1's end is past the grace: a reclaim, and its victim pays a restart.
    ends, stops, a = replay(4900)
    assert stops == 1 and ends["b2"] > 20_010 and a["reclaim_max_s"] == 60
    # Without the rule the 40 s case stops b2 too (the victim order's pick, not b1).
    monkeypatch.setattr(SchedulingPass, "_wait_for_ends", lambda self, *args: False)
    ends, stops, _ = replay(4960)
    assert stops == 1 and ends["b2"] > 20_010
