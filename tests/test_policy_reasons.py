"""What the pure policy tells a waiting job (docs/scheduling.md, rule 7; no database): its wait
reason, as data whose text is the reason, and its estimated start, from plan() run forward on
a virtual clock (jobs/scheduling/estimate.py)."""

from jobs.scheduling.policy import plan
from jobs.scheduling.vocab import WaitReason
from tests.builders import job, node, running, snapshot, team

# --- wait reasons ---------------------------------------------------------------------------------


def test_the_free_gpus_a_wait_reason_counts_are_outside_every_reservation():
    # Job 2 takes n0 for a priority preemption, starving job 1 holds n1 of its own. Job 4
    # may backfill n1 (it ends before job 1 could start there); job 3, with no estimate, may
    # use neither (n0 drains in less than the least minimum run: no filler either). Its count
    # was cached by the id() of a list of nodes the pass had dropped, and a later list at the
    # same address read that list's count (7).
    a, b = team("a", quota=8, borrow=32, used=1), team("b", quota=8, borrow=32, used=4)
    n0, n1 = node("n0", busy=4), node("n1", busy=1)
    runs = [
        running(1000, n0, range(4), team_id=b.id, prio=0, ends_in=500),
        running(1001, n1, [0], team_id=a.id, prio=2, ends_in=7200),
    ]
    jobs = [
        job(1, 8, team_id=a.id, prio=2, submitted=-35725),
        job(2, 8, team_id=b.id, prio=2, submitted=-41870, estimate=300),
        job(3, 1, team_id=b.id, prio=1, submitted=-9044),
        job(4, 8, team_id=b.id, prio=2, submitted=-27240, estimate=7200),
    ]
    p = plan(snapshot([n0, n1], jobs, [a, b], runs))
    assert p.reservation == (2, (n0.id,))
    assert "of its own on n1" in p.reasons[1]
    assert "; 7 free outside the reservations held by job 2 and others" in p.reasons[4]
    assert "; 0 free outside the reservations held by job 2 and others" in p.reasons[3]


def test_wait_reasons_are_data_whose_text_is_the_reason():
    # The reservation's nodes and a claim's victims are in the data: pages need not parse
    # the sentence.
    t = team()
    nodes = [node("a", 8, busy=2), node("b", 8, busy=8), node("c", 8)]
    jobs = [job(1, 16, team_id=t.id), job(2, 4, team_id=t.id, submitted=1)]
    p = plan(snapshot(nodes, jobs, [t]))
    assert p.waits[1] == WaitReason(
        "reserved", {"gpus": 16, "free": 14, "nodes": ("a", "c"), "ahead": 0}
    )
    assert p.waits[1].reserved_nodes == ("a", "c")
    assert p.waits[2] == WaitReason(
        "behind_reservation", {"gpus": 4, "free": 0, "job": 1, "others": False, "ahead": 1}
    )
    assert {i: w.text() for i, w in p.waits.items()} == p.reasons

    owner, guest = team("owner", quota=8), team("guest", quota=0, borrow=16, used=8)
    n = node("n1", 8, busy=8)
    runs = [running(10, n, range(8), team_id=guest.id)]
    p = plan(snapshot([n], [job(1, 4, team_id=owner.id)], [owner, guest], runs))
    assert p.waits[1].code == "preempting"
    assert (p.waits[1].data["kind"], p.waits[1].victims) == ("reclaim", (10,))
    assert (
        p.reasons[1]
        == p.waits[1].text()
        == (
            "waiting for job 10 to checkpoint and stop (reclaiming its team's quota); "
            "4 GPUs reserved"
        )
    )


# --- estimated starts -----------------------------------------------------------------------------


def test_estimated_starts_run_the_policy_forward_on_a_virtual_clock():
    from datetime import timedelta

    from jobs.scheduling.estimate import estimate_starts
    from tests.builders import T0

    t = team()
    n = node("n1", 8, busy=8)
    runs = [running(10, n, range(8), team_id=t.id, ends_in=600)]
    jobs = [
        job(1, 8, team_id=t.id, submitted=0, estimate=1200),
        job(2, 4, team_id=t.id, submitted=1, estimate=60),
    ]
    starts = estimate_starts(snapshot([n], jobs, [t], runs))
    assert starts[1] == T0 + timedelta(seconds=600)  # when the running job ends
    assert starts[2] == T0 + timedelta(seconds=1800)  # after job 1 (it holds the node)


def test_estimated_starts_expect_a_planned_preemption_to_free_its_gpus_after_the_grace():
    # A reclaim's claimant starts one stop grace from now, not when its victim would have
    # ended (here: never told, so an hour); a priority claimant waits for the approval delay
    # too. Each victim is taken once: the estimate does not stop it again later on.
    from datetime import timedelta

    from jobs.scheduling.estimate import estimate_starts
    from tests.builders import T0

    owner, guest = team("owner", quota=8), team("guest", quota=0, borrow=8, used=8)
    n = node("n1", 8, busy=8)
    borrowed = running(10, n, range(8), team_id=guest.id, ends_in=None, started_ago=700)
    claimant = job(1, 8, team_id=owner.id, estimate=600)
    starts = estimate_starts(
        snapshot([n], [claimant], [owner, guest], [borrowed]),
        stop_grace_s=60,
        approval_delay_s=300,
    )
    assert starts == {1: T0 + timedelta(seconds=60)}

    low, high = team("low"), team("high")
    m = node("n2", 8, busy=8)
    victim = running(20, m, range(8), team_id=low.id, ends_in=5000, started_ago=700)
    urgent = job(2, 8, team_id=high.id, prio=2, estimate=600)
    later = job(3, 8, team_id=high.id, prio=2, submitted=5, estimate=600)
    starts = estimate_starts(
        snapshot([m], [urgent, later], [low, high], [victim]),
        stop_grace_s=60,
        approval_delay_s=300,
    )
    assert starts == {2: T0 + timedelta(seconds=360), 3: T0 + timedelta(seconds=960)}


def test_estimated_starts_reclaim_once_for_a_claimant_and_keep_its_gpus_for_it():
    # The replay links a planned victim to its claimant, as the live system does: when a
    # job elsewhere ends (at 10 s) before the victim has stopped (60 s), the replay must not
    # reclaim a second borrowed job for the same claimant, which would free GPUs for job 2
    # at 70 s. Job 2 starts when the claimant's own 600 s run ends on that node.
    from datetime import timedelta

    from jobs.scheduling.estimate import estimate_starts
    from tests.builders import T0

    owner, guest = team("owner", quota=8), team("guest", quota=0, borrow=8, used=8)
    steady, other = team("steady", quota=8, used=8), team("other", quota=0, borrow=4)
    n1, n2 = node("n1", 8, busy=8), node("n2", 8, busy=8)
    runs = [
        running(10, n1, range(4), team_id=guest.id, ends_in=3600),
        running(11, n1, range(4, 8), team_id=guest.id, ends_in=5000),
        running(12, n2, range(2), team_id=steady.id, ends_in=10),
        running(13, n2, range(2, 8), team_id=steady.id, ends_in=9000),
    ]
    jobs = [
        job(1, 4, team_id=owner.id, estimate=600),
        job(2, 4, team_id=other.id, submitted=1, estimate=100),
    ]
    starts = estimate_starts(
        snapshot([n1, n2], jobs, [owner, guest, steady, other], runs),
        stop_grace_s=60,
        approval_delay_s=300,
    )
    assert starts == {1: T0 + timedelta(seconds=60), 2: T0 + timedelta(seconds=660)}
