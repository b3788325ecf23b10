"""The pure scheduling policy's core rules, one test per rule (no database): order (priority,
guaranteed before borrowed, aging, fair share), quotas and borrowing, placement and isolated
nodes (docs/scheduling.md, rules 1-3 and 9). The other rules have files of their own:
test_policy_backfill.py (4: reservations, EASY backfill, fillers), test_policy_preemption.py
(5, 6 and starvation claims: whom a claim stops), test_policy_claims.py (5: a claimant and its
victims' GPUs), test_policy_reasons.py (7: wait reasons, start estimates) and
test_policy_elastic.py (8: elastic jobs, growing back). Builders: tests/builders.py."""

import dataclasses
from datetime import timedelta

from jobs.scheduling.policy import plan
from jobs.scheduling.vocab import WaitReason
from tests.builders import job, node, placed, running, snapshot, team

# --- priority and submit order, the team's cap, placement -----------------------------------------


def test_priority_then_submit_order_decides_who_gets_scarce_gpus():
    t = team()
    n = node("n1", 8)
    jobs = [
        job(1, 8, team_id=t.id, prio=1, submitted=0),
        job(2, 8, team_id=t.id, prio=2, submitted=10),
        job(3, 8, team_id=t.id, prio=2, submitted=5),
    ]
    p = plan(snapshot([n], jobs, [t]))
    assert list(placed(p)) == [3]
    assert "waiting for 8 GPUs" in p.reasons[2]
    assert set(p.reasons) == {1, 2}


def test_team_is_capped_at_quota_plus_borrow_limit_with_a_readable_reason():
    t = team("vision", quota=8, borrow=4, used=8)
    p = plan(snapshot([node("n1", 8)], [job(1, 8, team_id=t.id)], [t]))
    assert p.placements == ()
    assert p.reasons[1] == (
        "team vision at its limit: 8/12 GPUs in use (quota 8 + borrow limit 4); needs 8"
    )


def test_quota_counts_gpus_placed_earlier_in_the_same_pass():
    t = team(quota=8)
    nodes = [node("n1", 8), node("n2", 8)]
    p = plan(snapshot(nodes, [job(1, 8, team_id=t.id), job(2, 8, team_id=t.id)], [t]))
    assert list(placed(p)) == [1]
    assert "at its limit" in p.reasons[2]


def test_small_job_goes_to_the_fullest_node_it_fits_on():
    t = team()
    nodes = [node("empty", 8), node("half", 8, busy=4), node("nearly", 8, busy=7)]
    p = plan(snapshot(nodes, [job(1, 2, team_id=t.id)], [t]))
    (placement,) = p.placements
    assert {s.node_id for s in placement.slots} == {nodes[1].id}


def test_job_that_fits_a_node_never_spans_nodes():
    t = team()
    nodes = [node("a", 8, busy=4), node("b", 8, busy=4)]
    p = plan(snapshot(nodes, [job(1, 8, team_id=t.id)], [t]))
    assert p.placements == ()
    assert "8 GPUs on one node" in p.reasons[1]


def test_large_job_takes_whole_nodes_in_one_rack_when_it_can():
    t = team()
    nodes = [
        node("r1a", 8, rack="r1"),
        node("r2a", 8, rack="r2"),
        node("r2b", 8, rack="r2"),
        node("r1b", 8, rack="r1", busy=1),
    ]
    p = plan(snapshot(nodes, [job(1, 16, team_id=t.id)], [t]))
    (placement,) = p.placements
    assert set(placement.node_ids) == {nodes[1].id, nodes[2].id}
    assert [s.rank for s in placement.slots] == list(range(16))
    assert [s.group_rank for s in placement.slots] == [0] * 8 + [1] * 8
    assert [s.local_rank for s in placement.slots] == list(range(8)) * 2


def test_gang_spans_small_nodes_with_ranks_in_node_order():
    t = team()
    nodes = [node("local-a", 2), node("local-b", 2)]
    p = plan(snapshot(nodes, [job(1, 4, team_id=t.id)], [t]))
    (placement,) = p.placements
    assert [(s.group_rank, s.local_rank, s.rank) for s in placement.slots] == [
        (0, 0, 0),
        (0, 1, 1),
        (1, 0, 2),
        (1, 1, 3),
    ]


def test_nodes_that_are_down_or_cordoned_get_no_work_and_reasons_say_capacity():
    t = team()
    nodes = [node("up", 8, busy=8), node("down", 8, up=False)]
    p = plan(snapshot(nodes, [job(1, 16, team_id=t.id)], [t]))
    assert p.placements == ()
    assert p.reasons[1] == "needs 16 GPUs but only 8 GPUs are on schedulable nodes"


def test_every_job_left_queued_has_a_reason_and_plan_is_deterministic():
    t1, t2 = team("a", quota=10), team("b", quota=3)
    nodes = [node(f"n{i}", 8, busy=i % 8, rack=f"r{i % 3}") for i in range(20)]
    jobs = [
        job(i, [1, 2, 4, 8, 16][i % 5], team_id=(t1, t2)[i % 2].id, prio=i % 3, submitted=i)
        for i in range(60)
    ]
    snap = snapshot(nodes, jobs, [t1, t2])
    first, second = plan(snap), plan(snap)
    assert first == second
    queued = {j.id for j in jobs} - set(placed(first))
    assert set(first.reasons) == queued
    assert all(first.reasons[j] for j in queued)
    # No GPU twice and every gang whole.
    seen = [(s.node_id, s.index) for pl in first.placements for s in pl.slots]
    assert len(seen) == len(set(seen))
    sizes = {j.id: j.gpus for j in jobs}
    assert all(len(pl.slots) == sizes[pl.job_id] for pl in first.placements)


# --- guaranteed before borrowed, aging, fair share (rule 1) ---------------------------------------


def test_guaranteed_work_goes_before_borrowed_work_of_the_same_priority():
    lender, borrower = team("lender", quota=8, used=0), team("borrower", quota=8, used=8, borrow=8)
    n = node("n1", 8)
    jobs = [job(1, 8, team_id=borrower.id, submitted=0), job(2, 8, team_id=lender.id, submitted=60)]
    p = plan(snapshot([n], jobs, [lender, borrower]))
    assert list(placed(p)) == [2]


def test_aging_puts_borrowed_work_that_waited_long_before_newer_guaranteed_work():
    lender, borrower = team("lender", quota=8, used=0), team("borrower", quota=8, used=8, borrow=8)
    n = node("n1", 8)
    # The borrowed job (estimate 10 min) was submitted 31 min ago: past max(30 min, 3 x 10).
    old = job(1, 8, team_id=borrower.id, submitted=-31 * 60, estimate=600)
    new = job(2, 8, team_id=lender.id, submitted=-60)
    assert list(placed(plan(snapshot([n], [old, new], [lender, borrower])))) == [1]
    # Not yet aged: 29 min, or 31 min for a job of an hour (3 h to age), or no estimate (4 h).
    for submitted, estimate in ((-29 * 60, 600), (-31 * 60, 3600), (-3 * 3600, None)):
        young = job(1, 8, team_id=borrower.id, submitted=submitted, estimate=estimate)
        assert list(placed(plan(snapshot([n], [young, new], [lender, borrower])))) == [2]
    aged_unknown = job(1, 8, team_id=borrower.id, submitted=-5 * 3600)
    assert list(placed(plan(snapshot([n], [aged_unknown, new], [lender, borrower])))) == [1]
    # Aging never lifts a job above a higher priority class.
    urgent = job(3, 8, team_id=lender.id, submitted=-60, prio=2)
    assert list(placed(plan(snapshot([n], [old, urgent], [lender, borrower])))) == [3]


def test_with_aged_borrowed_first_off_aged_borrowed_work_waits_for_guaranteed_work_only():
    lender, borrower = team("lender", quota=8, used=0), team("borrower", quota=8, used=8, borrow=8)
    n = node("n1", 8)
    old = job(1, 8, team_id=borrower.id, submitted=-31 * 60, estimate=600)  # aged
    new = job(2, 8, team_id=lender.id, submitted=-60)  # guaranteed
    newer = job(3, 8, team_id=borrower.id, submitted=-120, estimate=600)  # borrowed, not aged
    off = dataclasses.replace(
        snapshot([n], [old, new], [lender, borrower]), aged_borrowed_first=False
    )
    assert list(placed(plan(off))) == [2]  # the team within its quota first
    # Still ahead of borrowed work that has not aged.
    only_borrowed = dataclasses.replace(
        snapshot([n], [newer, old], [lender, borrower]), aged_borrowed_first=False
    )
    assert list(placed(plan(only_borrowed))) == [1]


def test_aged_jobs_go_by_stretch_so_a_short_job_is_not_kept_behind_an_older_long_one():
    lender, borrower = team("lender", quota=8, used=0), team("borrower", quota=8, used=8, borrow=8)
    n = node("n1", 8)
    # Both aged. The long job (4 h) waited 13 h, 3.3 times its length; the short one (10 min)
    # waited 2 h, 12 times its length: it goes first although it came later.
    long_job = job(1, 8, team_id=borrower.id, submitted=-13 * 3600, estimate=4 * 3600)
    short_job = job(2, 8, team_id=borrower.id, submitted=-2 * 3600, estimate=600)
    p = plan(snapshot([n], [long_job, short_job], [lender, borrower]))
    assert list(placed(p)) == [2]
    # Once the long job has waited longer for its length, it is first again.
    long_job = dataclasses.replace(
        long_job, submitted_at=short_job.submitted_at - timedelta(hours=47)
    )
    p = plan(snapshot([n], [long_job, short_job], [lender, borrower]))
    assert list(placed(p)) == [1]
    # Without an estimate a job counts as AGING_NO_ESTIMATE_S / AGING_FACTOR (80 min) long:
    # 5 h waited is a stretch of 3.75, behind the short job's 12.
    unknown = job(3, 8, team_id=borrower.id, submitted=-5 * 3600)
    p = plan(snapshot([n], [unknown, short_job], [lender, borrower]))
    assert list(placed(p)) == [2]
    # Every job ages at stretch 3: a 1-minute job that just aged (31 min, counted as 10 min
    # long: 3.1) does not pass a 4-hour job aged before it (13 h: 3.25).
    long_job = job(1, 8, team_id=borrower.id, submitted=-13 * 3600, estimate=4 * 3600)
    minute = job(4, 8, team_id=borrower.id, submitted=-31 * 60, estimate=60)
    p = plan(snapshot([n], [long_job, minute], [lender, borrower]))
    assert list(placed(p)) == [1]


def test_fair_share_orders_teams_by_weighted_usage_with_history():
    busy = team("busy", quota=8, used=4, history=86400 * 4)
    idle = team("idle", quota=8, used=4)
    heavy = team("heavy", quota=8, used=4, history=86400 * 4, weight=4)
    n = node("n1", 8, busy=6)
    jobs = [
        job(1, 2, team_id=busy.id, submitted=0),
        job(2, 2, team_id=idle.id, submitted=10),
        job(3, 2, team_id=heavy.id, submitted=5),
    ]
    p = plan(snapshot([n], jobs, [busy, idle, heavy]))
    # idle: 4/8 = 0.5; heavy: (4 + 4) / (8 x 4) = 0.25; busy: (4 + 4) / 8 = 1.0
    assert list(placed(p)) == [3]
    assert sorted(p.reasons) == [1, 2]


# --- quotas and borrowing (rule 2): the borrowing pause, a team's cap hold ------------------------


def test_borrowing_is_paused_after_a_reclaim():
    t = team("vision", quota=4, borrow=8, used=4, paused=True)
    p = plan(snapshot([node("n1", 8, busy=4)], [job(1, 4, team_id=t.id)], [t]))
    assert p.placements == ()
    assert "borrowing paused after a reclaim" in p.reasons[1]


def test_a_job_blocked_by_its_teams_cap_is_not_overtaken_by_the_teams_later_jobs():
    # The simulator's case: quota 8 on one 8-GPU node, a 4-GPU job runs for 100 more seconds;
    # b (8 GPUs) is blocked by the cap; c (2 GPUs, 50 s) may pass because it ends before the
    # team's GPUs free up; d (2 GPUs, 500 s) and e (no estimate) may not.
    t = team("nlp", quota=8, used=4)
    n = node("n1", 8, busy=4)
    runs = [running(10, n, range(4), team_id=t.id, ends_in=100)]
    jobs = [
        job(2, 8, team_id=t.id, submitted=1),
        job(3, 2, team_id=t.id, submitted=2, estimate=50),
        job(4, 2, team_id=t.id, submitted=3, estimate=500),
        job(5, 2, team_id=t.id, submitted=4),
    ]
    p = plan(snapshot([n], jobs, [t], runs))
    assert list(placed(p)) == [3]
    assert "at its limit" in p.reasons[2]
    for waiting in (4, 5):
        assert p.reasons[waiting].startswith("behind job 2 of team nlp"), p.reasons[waiting]


def test_a_cap_hold_never_blocks_other_teams():
    nlp = team("nlp", quota=8, used=8)
    vision = team("vision", quota=8, used=0)
    n1, n2 = node("n1", 8, busy=8), node("n2", 8)
    runs = [running(10, n1, range(8), team_id=nlp.id)]
    jobs = [job(1, 8, team_id=nlp.id, submitted=0), job(2, 4, team_id=vision.id, submitted=5)]
    p = plan(snapshot([n1, n2], jobs, [nlp, vision], runs))
    assert list(placed(p)) == [2]
    assert "at its limit" in p.reasons[1]


def test_a_job_larger_than_its_teams_cap_holds_nothing():
    # It can never run under today's limits, so it must not block the team's other work.
    t = team("nlp", quota=4, used=0)
    p = plan(snapshot([node("n1", 8)], [job(1, 8, team_id=t.id), job(2, 2, team_id=t.id)], [t]))
    assert list(placed(p)) == [2]


# --- isolated nodes only (rule 9) -----------------------------------------------------------------


def test_an_isolated_only_team_runs_on_container_nodes_and_others_still_use_process_nodes():
    # Best fit would put both 2-GPU jobs on the fuller process node ("laptop"); the team that
    # refused process-runtime nodes goes to the container node, the other team does not care.
    strict, relaxed = team("strict", isolated_only=True), team("relaxed")
    laptop, box = node("laptop", 8, busy=5, isolated=False), node("box", 8, busy=2)
    p = plan(
        snapshot(
            [laptop, box],
            [job(1, 2, team_id=strict.id), job(2, 2, team_id=relaxed.id, submitted=1)],
            [strict, relaxed],
        )
    )
    where = {pl.job_id: {s.node_id for s in pl.slots} for pl in p.placements}
    assert where == {1: {box.id}, 2: {laptop.id}}


def test_an_isolated_only_team_waits_with_its_reason_when_only_process_nodes_are_up():
    strict = team("strict", isolated_only=True)
    nodes = [node("laptop-a", 8, isolated=False), node("laptop-b", 8, isolated=False)]
    p = plan(snapshot(nodes, [job(1, 4, team_id=strict.id)], [strict]))
    assert p.placements == ()
    assert p.waits[1] == WaitReason("isolation", {"team": "strict", "gpus": 4, "capacity": 0})
    assert p.reasons[1] == (
        "team strict runs on isolated (container) nodes only; those have 0 GPUs schedulable "
        "and it needs 4"
    )


def test_an_isolated_only_teams_reservation_and_reclaim_stay_on_container_nodes():
    # The freest node is the process node: a reservation there could never be used. And the
    # team's guaranteed job reclaims a borrower on the container node, not the idler laptop's.
    strict = team("strict", quota=8, isolated_only=True)
    lender = team("lender", quota=0, borrow=16, used=12)
    laptop, box = node("laptop", 8, busy=4, isolated=False), node("box", 8, busy=8)
    runs = [
        running(10, laptop, range(4), team_id=lender.id, ends_in=9000),
        running(11, box, range(8), team_id=lender.id, ends_in=9000),
    ]
    p = plan(snapshot([laptop, box], [job(1, 8, team_id=strict.id)], [strict, lender], runs))
    assert [pr.victim_job_id for pr in p.preemptions] == [11]
    assert p.reservation == (1, (box.id,))
    # Without a victim to take (the box's job is the team's own) it reserves the box, still.
    own = [running(12, box, range(8), team_id=strict.id, ends_in=600)]
    busy = team("strict", quota=16, used=8, isolated_only=True, team_id=strict.id)
    p = plan(snapshot([laptop, box], [job(2, 8, team_id=strict.id)], [busy], own))
    assert p.placements == () and p.reservation == (2, (box.id,))
