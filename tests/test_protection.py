"""What keeps preemption from thrashing (jobs.scheduling.protection): minimum run, no cross-team
priority preemption of guaranteed work for a borrower, weighing, the safety stop and no restart
into a reclaim. Pure snapshots, no database."""

from dataclasses import replace
from datetime import timedelta

from jobs.scheduling.policy import plan
from jobs.scheduling.protection import min_run_s, pays, protected_until
from jobs.scheduling.vocab import PreemptionKind
from tests.builders import T0, job, node, running, snapshot, team


def test_minimum_run_is_start_up_plus_one_checkpoint_interval_never_below_the_floor():
    assert min_run_s(1800, 120, 600) == 1920
    assert min_run_s(300, 60, 600) == 600  # the floor
    assert min_run_s(None, 120, 600) == 600  # never checkpoints: protecting longer saves nothing
    run = running(1, node("n", 8), range(8), team_id=1, started_ago=100)
    assert protected_until(run, 600) == T0 + timedelta(seconds=500)
    longer = replace(run, protected_until=T0 + timedelta(seconds=1800))
    assert protected_until(longer, 600) == T0 + timedelta(seconds=1800)


def _priority_case(started_ago: float, **victim):
    low, high = team("low", quota=8), team("high", quota=8)
    n = node("n1", 8, busy=8)
    victim = running(10, n, range(8), team_id=low.id, prio=0, started_ago=started_ago, **victim)
    urgent = job(1, 8, team_id=high.id, prio=2)
    return snapshot([n], [urgent], [low, high], [victim])


def test_a_just_started_job_is_no_priority_victim_until_its_minimum_run_is_over():
    fresh = _priority_case(started_ago=100)
    decided = plan(fresh)
    assert decided.preemptions == ()
    assert decided.waits[1].code == "reserved"
    # The reader's minimum run (start-up + interval) counts, not only the floor.
    longer = replace(
        fresh,
        running=(replace(fresh.running[0], protected_until=T0 + timedelta(seconds=60)),),
    )
    assert plan(longer).preemptions == ()
    (stop,) = plan(_priority_case(started_ago=700)).preemptions
    assert (stop.victim_job_id, stop.kind) == (10, PreemptionKind.PRIORITY)


def test_a_borrowing_claimant_takes_no_other_teams_guaranteed_work_by_priority():
    # lab borrows (quota 0): nlp's job within nlp's quota is not its victim, whatever the
    # priorities; its own borrowed job is.
    lab, nlp = team("lab", quota=0, borrow=16), team("nlp", quota=8, used=8)
    n = node("n1", 8, busy=8)
    guaranteed = running(10, n, range(8), team_id=nlp.id, prio=0)
    urgent = job(1, 8, team_id=lab.id, prio=3)
    assert plan(snapshot([n], [urgent], [lab, nlp], [guaranteed])).preemptions == ()
    # The same job beyond nlp's quota is borrowed: it may go.
    nlp_over = team("nlp", quota=0, borrow=8, used=8, team_id=nlp.id)
    (stop,) = plan(snapshot([n], [urgent], [lab, nlp_over], [guaranteed])).preemptions
    assert stop.victim_job_id == 10


def test_a_preemption_that_does_not_pay_is_not_made():
    # The victim ends in 5 minutes and has an hour of unsaved work: waiting is cheaper.
    soon = _priority_case(started_ago=4000, ends_in=300, checkpoint_age=3600)
    decided = plan(soon)
    assert decided.preemptions == ()
    victim = soon.running[0]
    assert not pays(8, [victim], T0)
    # Saved a minute ago and hours to go: it pays.
    assert plan(_priority_case(started_ago=4000, ends_in=7200, checkpoint_age=60)).preemptions


def test_the_safety_stop_keeps_a_job_from_every_claim_even_a_reclaim():
    owner, guest = team("owner", quota=8), team("guest", quota=0, borrow=8, used=8)
    n = node("n1", 8, busy=8)
    borrowed = running(10, n, range(8), team_id=guest.id)
    claimant = job(1, 8, team_id=owner.id)
    (stop,) = plan(snapshot([n], [claimant], [owner, guest], [borrowed])).preemptions
    assert stop.kind == PreemptionKind.RECLAIM
    looped = snapshot([n], [claimant], [owner, guest], [replace(borrowed, preemptions=5)])
    assert plan(looped).preemptions == ()
    assert plan(replace(looped, max_preemptions=6)).preemptions


def test_a_reclaim_still_takes_a_protected_borrower_when_no_other_will_do():
    # The quota's bound holds: a borrower that just started is reclaimed if it is the only
    # borrowed work (what it risks is known when it borrows).
    owner, guest = team("owner", quota=8), team("guest", quota=0, borrow=8, used=8)
    n = node("n1", 8, busy=8)
    fresh = running(10, n, range(8), team_id=guest.id, started_ago=30)
    (stop,) = plan(
        snapshot([n], [job(1, 8, team_id=owner.id)], [owner, guest], [fresh])
    ).preemptions
    assert (stop.victim_job_id, stop.kind) == (10, PreemptionKind.RECLAIM)


def _gang_case(started_ago: float, gang_gpus: int = 16, gang_quota: int = 8):
    # `gang` (team big, quota `gang_quota`) runs on two whole nodes, mostly on GPUs lent by
    # team owner, whose 8-GPU job now fits its quota.
    owner = team("owner", quota=8)
    big = team("big", quota=gang_quota, borrow=16, used=gang_gpus)
    nodes = [node("n1", 8, busy=8), node("n2", 8, busy=8)]
    slots = [(n, range(8)) for n in nodes][: gang_gpus // 8]
    gang = running(10, nodes[0], range(8), team_id=big.id, started_ago=started_ago)
    gang = replace(gang, gpus=gang_gpus, slots=tuple((n.id, i) for n, r in slots for i in r))
    return snapshot(nodes, [job(1, 8, team_id=owner.id)], [owner, big], [gang])


def test_a_young_gang_beyond_its_teams_quota_is_not_reclaimed_until_its_exemption_ends():
    young = _gang_case(started_ago=3600)
    p = plan(young)
    assert p.preemptions == () and p.waits[1].code in ("reserved", "behind_reservation")
    # Past the exemption (4 h by default), or with it turned off, the reclaim is made.
    for case in (_gang_case(started_ago=4 * 3600 + 1), replace(young, gang_reclaim_exempt_s=0)):
        (stop,) = plan(case).preemptions
        assert (stop.victim_job_id, stop.kind) == (10, PreemptionKind.RECLAIM)
    # A job of one node has no such exemption: it needs no drain to restart.
    one_node = _gang_case(started_ago=3600, gang_gpus=8, gang_quota=0)
    assert [s.victim_job_id for s in plan(one_node).preemptions] == [10]


def test_a_job_reclaimed_lately_does_not_borrow_again_while_a_guaranteed_job_waits():
    owner, guest = team("owner", quota=8, used=8), team("guest", quota=0, borrow=16)
    n1, n2 = node("n1", 8, busy=8), node("n2", 8)
    owners_run = running(10, n1, range(8), team_id=owner.id)
    reclaimed = replace(
        job(1, 8, team_id=guest.id, prio=2), reclaimed_at=T0 - timedelta(seconds=600)
    )
    waiting = job(2, 8, team_id=owner.id, submitted=5)  # owner's, over its quota: borrowed
    # Nobody guaranteed waits: the reclaimed job borrows n2.
    decided = plan(snapshot([n1, n2], [reclaimed, waiting], [owner, guest], [owners_run]))
    assert [p.job_id for p in decided.placements] == [1]
    # A third team's job within its quota waits: the reclaimed job leaves n2 to it.
    third = team("third", quota=8)
    guaranteed = job(3, 8, team_id=third.id, submitted=9)
    decided = plan(snapshot([n1, n2], [reclaimed, guaranteed], [owner, guest, third], [owners_run]))
    assert [p.job_id for p in decided.placements] == [3]
    assert decided.waits[1].code == "reclaim_risk"
    assert "third" in decided.reasons[1]
    # An hour after the reclaim it borrows again like anyone.
    later = replace(reclaimed, reclaimed_at=T0 - timedelta(seconds=3600))
    decided = plan(snapshot([n1, n2], [later, guaranteed], [owner, guest, third], [owners_run]))
    assert [p.job_id for p in decided.placements] == [1]
