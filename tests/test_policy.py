"""The pure scheduling policy, rule by rule (no database)."""

import dataclasses
from datetime import timedelta

from jobs.scheduling.policy import plan
from jobs.scheduling.vocab import PreemptionKind, WaitReason, elastic_sizes
from tests.builders import T0, job, node, running, snapshot, team


def placed(p):
    return {pl.job_id: pl for pl in p.placements}


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


def test_blocked_head_reserves_nodes_so_small_jobs_cannot_starve_it():
    t = team()
    nodes = [node("a", 8, busy=2), node("b", 8, busy=8), node("c", 8)]
    jobs = [
        job(1, 16, team_id=t.id, submitted=0),  # needs two whole nodes: only c is idle
        job(2, 4, team_id=t.id, submitted=1),
        job(3, 1, team_id=t.id, submitted=2),
    ]
    p = plan(snapshot(nodes, jobs, [t]))
    assert p.reservation[0] == 1
    reserved = set(p.reservation[1])
    assert reserved == {nodes[0].id, nodes[2].id}
    assert "holds a reservation on a, c" in p.reasons[1]
    # Nothing may land on the reserved nodes; b is full, so the small jobs wait too.
    assert p.placements == ()
    assert "reservation held by job 1" in p.reasons[2]


def test_small_jobs_backfill_outside_the_reservation():
    t = team()
    nodes = [node("a", 8, busy=6), node("b", 8, busy=4)]
    jobs = [job(1, 8, team_id=t.id, submitted=0), job(2, 2, team_id=t.id, submitted=1)]
    p = plan(snapshot(nodes, jobs, [t]))
    assert p.reservation == (1, (nodes[1].id,))  # b has the most free GPUs: frees up first
    (placement,) = p.placements
    assert placement.job_id == 2 and placement.node_ids == (nodes[0].id,)


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


# --- quotas, fair share, backfill and preemption ------------------------------------------


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


def test_borrowing_is_paused_after_a_reclaim():
    t = team("vision", quota=4, borrow=8, used=4, paused=True)
    p = plan(snapshot([node("n1", 8, busy=4)], [job(1, 4, team_id=t.id)], [t]))
    assert p.placements == ()
    assert "borrowing paused after a reclaim" in p.reasons[1]


def _one_job_per_node(t, specs):
    """Nodes from (name, GPUs, busy, ends_in), each running one job of team `t` on its first
    `busy` GPUs (job ids 10, 11, ...)."""
    nodes = [node(name, gpus, busy=busy) for name, gpus, busy, _ in specs]
    runs = [
        running(10 + i, n, range(busy), team_id=t.id, ends_in=ends_in)
        for i, (n, (_, _, busy, ends_in)) in enumerate(zip(nodes, specs, strict=True))
    ]
    return nodes, runs


def _two_busy_nodes(t, a_busy, a_ends_in, b_busy, b_ends_in):
    """Nodes a and b of 8 GPUs, each with one running job of team `t` on its first GPUs."""
    a, b = node("a", 8, busy=a_busy), node("b", 8, busy=b_busy)
    runs = [
        running(10, a, range(a_busy), team_id=t.id, ends_in=a_ends_in),
        running(11, b, range(b_busy), team_id=t.id, ends_in=b_ends_in),
    ]
    return a, b, runs


def test_easy_backfill_uses_reserved_nodes_only_for_jobs_that_end_before_they_free_up():
    t = team()
    a, b, runs = _two_busy_nodes(t, 6, 600, 8, 3600)
    jobs = [
        job(1, 8, team_id=t.id, submitted=0, estimate=1000),  # blocked head: reserves a
        job(2, 2, team_id=t.id, submitted=1, estimate=300),  # done before a frees: ok
        job(3, 2, team_id=t.id, submitted=2, estimate=900),
    ]  # would delay the head
    p = plan(snapshot([a, b], jobs, [t], runs))
    assert p.reservation == (1, (a.id,))
    assert list(placed(p)) == [2]
    assert "reservation held by job 1" in p.reasons[3]


def test_a_job_that_would_delay_the_head_fills_its_draining_node():
    # The head (8 GPUs) waits for node a's 4-GPU job to end in an hour. Job 2 runs two
    # hours: plain EASY backfill leaves a's free GPUs idle for that hour; as a filler it
    # runs there and is stopped for the head then. So does job 3, although its minimum run
    # (restart and one checkpoint) outlasts the hour: the head then waits for that. Job 4
    # was stopped as a filler today already.
    t = team()
    a, b = node("a", 8, busy=4), node("b", 8, busy=8)
    runs = [
        running(10, a, range(4), team_id=t.id, ends_in=3600),
        running(11, b, range(8), team_id=t.id, ends_in=7200),
    ]
    jobs = [
        job(1, 8, team_id=t.id, submitted=0, estimate=1000),
        job(2, 2, team_id=t.id, submitted=1, estimate=7200),
        job(3, 1, team_id=t.id, submitted=2, estimate=7200, min_run=4000),
        dataclasses.replace(job(4, 1, team_id=t.id, submitted=3, estimate=7200), filled=True),
    ]
    p = plan(snapshot([a, b], jobs, [t], runs))
    assert p.reservation == (1, (a.id,))
    assert [(pl.job_id, pl.node_ids, pl.filler) for pl in p.placements] == [
        (2, (a.id,), True),
        (3, (a.id,), True),
    ]
    assert "reservation held by job 1" in p.reasons[4]


def test_fillers_are_admitted_against_the_drain_of_all_but_fillers_so_they_do_not_chain():
    # Node a drains of job 10 in 20 minutes, so job 2 fills it although its minimum run
    # (32 minutes) ends after that: the head then waits 12 minutes more, no longer.
    t = team()
    a, b = node("a", 8, busy=6), node("b", 8, busy=8)
    others = [running(11, b, range(8), team_id=t.id, ends_in=7200)]
    jobs = [
        job(1, 8, team_id=t.id, submitted=0, estimate=1000),
        job(2, 1, team_id=t.id, submitted=1, estimate=7200, min_run=1920),
    ]
    runs = [running(10, a, range(6), team_id=t.id, ends_in=1200), *others]
    p = plan(snapshot([a, b], jobs, [t], runs))
    assert [(pl.job_id, pl.filler) for pl in p.placements] == [(2, True)]
    # Five minutes before job 10 ends a filler started earlier holds the node for 27 more
    # minutes. Against that moving time each filler would admit the next, and the head
    # would wait for ever; against the drain of all else (5 minutes, less than the least
    # minimum run) job 2 waits behind the reservation.
    filler = _filler(20, a, [6], team_id=t.id, protected_for=1620)
    runs = [running(10, a, range(6), team_id=t.id, ends_in=300), filler, *others]
    p = plan(snapshot([a, b], jobs, [t], runs))
    assert p.placements == ()
    assert "reservation held by job 1" in p.reasons[2]
    # With job 10 still 20 minutes from its end, the same filler does not keep job 2 out.
    runs = [running(10, a, range(6), team_id=t.id, ends_in=1200), filler, *others]
    p = plan(snapshot([a, b], jobs, [t], runs))
    assert [(pl.job_id, pl.filler) for pl in p.placements] == [(2, True)]


def _filler(job_id, node_view, indices, *, team_id, protected_for=-60.0, preemptions=0):
    return dataclasses.replace(
        running(job_id, node_view, indices, team_id=team_id, ends_in=20000),
        filler=True,
        protected_until=T0 + timedelta(seconds=protected_for),
        preemptions=preemptions,
    )


def test_the_head_stops_its_fillers_checkpoint_first_once_the_rest_has_drained():
    t = team()
    a, b = node("a", 8, busy=2), node("b", 8, busy=8)
    runs = [
        _filler(20, a, [0, 1], team_id=t.id),
        running(11, b, range(8), team_id=t.id, ends_in=7200),
    ]
    p = plan(snapshot([a, b], [job(1, 8, team_id=t.id, estimate=1000)], [t], runs))
    assert [(x.victim_job_id, x.claimant_job_id, x.kind) for x in p.preemptions] == [
        (20, 1, PreemptionKind.BACKFILL)
    ]
    assert p.waits[1].code == "preempting"
    assert "its reserved nodes have drained" in p.reasons[1]


def test_a_filler_within_its_minimum_run_or_at_its_safety_stop_is_not_stopped():
    t = team()
    a = node("a", 8, busy=2)
    young = [_filler(20, a, [0, 1], team_id=t.id, protected_for=600)]
    p = plan(snapshot([a], [job(1, 8, team_id=t.id)], [t], young))
    assert p.preemptions == ()
    assert p.waits[1].code == "reserved"
    # The reservation's time is the end of the filler's minimum run, not its own end: a job
    # that would outlast it may not backfill the node's free GPUs.
    later = job(2, 2, team_id=t.id, submitted=1, estimate=1200, min_run=5000)
    p = plan(snapshot([a], [job(1, 8, team_id=t.id), later], [t], young))
    assert 2 not in placed(p)
    stopped_enough = [_filler(20, a, [0, 1], team_id=t.id, preemptions=5)]
    p = plan(snapshot([a], [job(1, 8, team_id=t.id)], [t], stopped_enough))
    assert p.preemptions == ()


def test_the_head_counts_a_fillers_gpus_as_its_own_when_it_picks_the_freest_nodes():
    # a: 6 free + a 2-GPU filler; b: 7 free beside a job of 10 hours. Freest by free GPUs
    # alone is b (the head would wait 10 hours); counting the filler it is a.
    t = team()
    a, b = node("a", 8, busy=2), node("b", 8, busy=1)
    runs = [
        _filler(20, a, [0, 1], team_id=t.id, protected_for=600),
        running(21, b, [0], team_id=t.id, ends_in=36000),
    ]
    p = plan(snapshot([a, b], [job(1, 8, team_id=t.id)], [t], runs))
    assert p.reservation == (1, (a.id,))


def test_a_starving_head_reserves_the_node_that_frees_up_first_a_young_one_the_freest():
    # a has the most free GPUs but a 2-hour job; b frees all 8 in 600 s.
    t = team()
    a, b, runs = _two_busy_nodes(t, 4, 7200, 6, 600)

    def head(waited_s):
        return [job(1, 8, team_id=t.id, submitted=-waited_s, estimate=600)]

    # Waited 5.8 times its length: where it can start first.
    assert plan(snapshot([a, b], head(3500), [t], runs)).reservation == (1, (b.id,))
    # Just queued: the freest node, where backfill has the longest window.
    assert plan(snapshot([a, b], head(0), [t], runs)).reservation == (1, (a.id,))
    # Starving, but no expected ends known: the freest.
    assert plan(snapshot([a, b], head(3500), [t])).reservation == (1, (a.id,))


def test_a_job_waiting_five_times_its_length_holds_a_reservation_of_its_own():
    # The head (job 1, young) reserves n3, the freest node. Job 2 has waited 6.7 times its
    # length (4,000 s for a 600 s job): it reserves n1, where 8 GPUs free first (1,000 s),
    # although job 1 holds a reservation. Backfill respects each by its own drain time:
    # job 3 (1,500 s) may not use n1, although n1's one free GPU is the tighter fit; job 5
    # (500 s) may.
    t = team()
    (n1, n2, n3), runs = _one_job_per_node(
        t, [("n1", 8, 7, 1000), ("n2", 8, 6, 2000), ("n3", 8, 5, 3000)]
    )

    def queue(second_waited_s):
        return [
            job(1, 8, team_id=t.id, submitted=-5000),
            job(2, 8, team_id=t.id, submitted=-second_waited_s, estimate=600),
            job(3, 1, team_id=t.id, submitted=-10, estimate=1500),
            job(4, 1, team_id=t.id, submitted=-5),
            job(5, 1, team_id=t.id, submitted=-1, estimate=500),
        ]

    def nodes_of(p):
        return {pl.job_id: {s.node_id for s in pl.slots} for pl in p.placements}

    p = plan(snapshot([n1, n2, n3], queue(4000), [t], runs))
    assert p.reservation == (1, (n3.id,))
    assert "holds a reservation of its own on n1 (beside job 1's)" in p.reasons[2]
    assert nodes_of(p) == {3: {n2.id}, 4: {n2.id}, 5: {n1.id}}
    # Waiting 4.2 times its length, job 2 holds nothing: job 3 takes n1's GPU, the tighter fit.
    p = plan(snapshot([n1, n2, n3], queue(2500), [t], runs))
    assert "reservation held by job 1" in p.reasons[2]
    assert nodes_of(p) == {3: {n1.id}, 4: {n2.id}, 5: {n2.id}}


def test_a_starving_jobs_reservation_admits_backfill_only_until_the_job_could_start():
    # Job 2 (7 GPUs, starving) can start on n1 at 100 s, when the 6-GPU job ends; the
    # 1-GPU job beside it runs until 20,000 s. A 10,000 s job may not take n1's free GPU
    # (it would hold job 2 until 10,000 s); a 50 s job may.
    t = team()
    n1, n2, n3 = node("n1", 8, busy=7), node("n2", 8, busy=8), node("n3", 8, busy=6)
    runs = [
        running(10, n1, range(6), team_id=t.id, ends_in=100),
        running(11, n1, [6], team_id=t.id, ends_in=20000),
        running(12, n2, range(8), team_id=t.id, ends_in=5000),
        running(13, n3, range(6), team_id=t.id, ends_in=9000),
    ]
    jobs = [
        job(1, 8, team_id=t.id, submitted=-5000),  # young head (no estimate): freest, n3
        job(2, 7, team_id=t.id, submitted=-4000, estimate=600),
        job(3, 1, team_id=t.id, submitted=-5, estimate=10000),
        job(4, 1, team_id=t.id, submitted=-1, estimate=50),
    ]
    p = plan(snapshot([n1, n2, n3], jobs, [t], runs))
    assert p.reservation == (1, (n3.id,))
    assert "of its own on n1" in p.reasons[2]
    # Job 3 fills the head's n3 instead (it will be stopped there at 9,000 s, long after
    # its minimum run), never n1, where nobody would stop it for job 2.
    assert [(pl.job_id, pl.node_ids, pl.filler) for pl in p.placements] == [
        (3, (n3.id,), True),
        (4, (n1.id,), False),
    ]


def test_a_starving_job_gets_no_reservation_on_nodes_too_small_for_it():
    # The head holds the one 8-GPU node; a 6-GPU job must run on one node, so two 4-GPU
    # nodes are no reservation for it (they would only sit idle).
    t = team()
    (big, s1, s2), runs = _one_job_per_node(
        t, [("big", 8, 8, 1000), ("s1", 4, 3, 500), ("s2", 4, 3, 500)]
    )
    jobs = [
        job(1, 8, team_id=t.id, submitted=-5000),
        job(2, 6, team_id=t.id, submitted=-4000, estimate=600),
        job(3, 2, team_id=t.id, submitted=-1),
    ]
    p = plan(snapshot([big, s1, s2], jobs, [t], runs))
    assert "of its own" not in p.reasons[2]
    assert p.reasons[3].startswith("waiting for 2 GPUs")  # one free GPU per small node


def _starving(job_id, gpus, team_view, waited_s, estimate=600, **kw):
    return job(job_id, gpus, team_id=team_view.id, submitted=-waited_s, estimate=estimate, **kw)


def test_a_job_waiting_six_times_its_length_stops_its_own_teams_work_beyond_the_quota():
    # A heavy borrower (quota 8, 16 in use): its 10-minute job has waited 4,000 s behind its
    # own 2-hour jobs on a full cluster. It stops one of them (checkpoint first, at once).
    heavy = team("heavy", quota=8, borrow=24, used=16)
    n1, n2 = node("n1", 8, busy=8), node("n2", 8, busy=8)
    runs = [
        running(10, n1, range(8), team_id=heavy.id, ends_in=7200, checkpoint_age=900),
        running(11, n2, range(8), team_id=heavy.id, ends_in=7200, checkpoint_age=60),
    ]
    p = plan(snapshot([n1, n2], [_starving(1, 8, heavy, 4000)], [heavy], runs))
    (pre,) = p.preemptions
    assert (pre.victim_job_id, pre.claimant_job_id, pre.kind) == (11, 1, "starvation")
    assert p.reasons[1] == (
        "waiting for job 11 to checkpoint and stop (it has waited 7 times its length); "
        "8 GPUs reserved"
    )
    # 5.8 times its length: it only holds a reservation.
    p = plan(snapshot([n1, n2], [_starving(1, 8, heavy, 3500)], [heavy], runs))
    assert p.preemptions == ()
    # Never below its team's quota: with quota 16 the team's 16 GPUs are all guaranteed.
    within = dataclasses.replace(heavy, quota=16)
    p = plan(snapshot([n1, n2], [_starving(1, 8, within, 4000)], [within], runs))
    assert p.preemptions == ()


def test_a_starvation_claim_takes_borrowed_work_of_heavier_teams_never_of_lighter_ones():
    # The claimant's team uses 3x its quota; "other" runs two 4-GPU jobs, 4 GPUs beyond its
    # quota of 4. A 4-GPU job of "other" is the cheaper victim, but only when "other" is the
    # heavier team by fair share; else the claimant stops its own team's 8-GPU job.
    mine = team("mine", quota=8, borrow=24, used=24)
    n1, n2, n3, n4 = (node(f"n{i}", 8, busy=8) for i in range(1, 5))
    runs = [
        running(10, n1, range(8), team_id=mine.id, ends_in=7200, checkpoint_age=600),
        running(11, n2, range(8), team_id=mine.id, ends_in=7200, checkpoint_age=600),
        running(12, n3, range(8), team_id=mine.id, ends_in=7200, checkpoint_age=600),
    ]

    def victims(other_weight):
        other = team("other", quota=4, borrow=8, used=8, weight=other_weight)
        jobs_of_other = [
            running(20, n4, range(4), team_id=other.id, ends_in=7200, checkpoint_age=600),
            running(21, n4, range(4, 8), team_id=other.id, ends_in=7200, checkpoint_age=60),
        ]
        queue = [_starving(1, 4, mine, 4000)]
        p = plan(snapshot([n1, n2, n3, n4], queue, [mine, other], runs + jobs_of_other))
        return {(x.victim_job_id, x.kind) for x in p.preemptions}

    # fair share: mine 24 / 8 = 3; other 8 / 4 = 2 (lighter), or 8 / (4 x 0.25) = 8 (heavier).
    (mine_stopped,) = victims(1.0)
    assert mine_stopped in {(10, "starvation"), (11, "starvation"), (12, "starvation")}
    assert victims(0.25) == {(21, "starvation")}


def test_a_starvation_claim_spares_jobs_that_end_first_just_started_or_outrank_it():
    heavy = team("heavy", quota=0, borrow=16, used=8)
    n = node("n1", 8, busy=8)

    def victims(**run):
        args = {"ends_in": 7200, "checkpoint_age": 600, "started_ago": 3600, "prio": 1} | run
        runs = [running(10, n, range(8), team_id=heavy.id, **args)]
        p = plan(snapshot([n], [_starving(1, 8, heavy, 4000)], [heavy], runs))
        return [x.victim_job_id for x in p.preemptions]

    assert victims() == [10]
    assert victims(ends_in=500) == []  # it ends before the claimant would: waiting is cheaper
    assert victims(started_ago=300) == []  # within its exempt time: no stop-restart chains
    assert victims(prio=2) == []  # higher priority


def test_guaranteed_reclaims_go_before_starvation_claims_in_a_pass():
    # The lender holds 8 GPUs beyond its quota: one job's worth may go. The starving
    # borrower is ordered first (aged), but the job queued within its team's quota reclaims
    # it; the starving job may not take the lender below its quota and claims nothing.
    lender = team("lender", quota=8, borrow=8, used=16)
    starver = team("starver", quota=0, borrow=16, used=0)
    owner = team("owner", quota=8, used=0)
    n1, n2 = node("n1", 8, busy=8), node("n2", 8, busy=8)
    runs = [
        running(10, n1, range(8), team_id=lender.id, ends_in=7200, checkpoint_age=600),
        running(11, n2, range(8), team_id=lender.id, ends_in=7200, checkpoint_age=600),
    ]
    starving = _starving(1, 8, starver, 4000)
    teams = [lender, starver, owner]
    p = plan(snapshot([n1, n2], [starving, job(2, 8, team_id=owner.id)], teams, runs))
    assert [(x.victim_job_id, x.claimant_job_id, x.kind) for x in p.preemptions] == [
        (11, 2, "reclaim")
    ]
    # Without the owner's job the starving job takes it.
    p = plan(snapshot([n1, n2], [starving], teams, runs))
    assert [(x.victim_job_id, x.claimant_job_id, x.kind) for x in p.preemptions] == [
        (11, 1, "starvation")
    ]
    # On one node the starving head reserves it. The head borrows (its team's quota is 0),
    # so its reservation does not keep the owner from its quota: the reclaim takes the lent
    # GPUs there, and the head takes nothing.
    only = [running(10, n1, range(8), team_id=lender.id, ends_in=7200, checkpoint_age=600)]
    lender = dataclasses.replace(lender, used=8, quota=0)
    teams = [lender, starver, owner]
    p = plan(snapshot([n1], [starving, job(2, 8, team_id=owner.id)], teams, only))
    assert [(x.victim_job_id, x.claimant_job_id, x.kind) for x in p.preemptions] == [
        (10, 2, "reclaim")
    ]
    p = plan(snapshot([n1], [starving], teams, only))
    assert [(x.victim_job_id, x.kind) for x in p.preemptions] == [(10, "starvation")]


def test_reclaim_takes_borrowed_gpus_lowest_priority_and_least_work_lost_first():
    owner = team("owner", quota=8, used=0)
    guest = team("guest", quota=0, borrow=16, used=8)
    n = node("n1", 8, busy=8)
    runs = [
        running(10, n, [0, 1, 2, 3], team_id=guest.id, prio=1, checkpoint_age=900),
        running(11, n, [4, 5, 6, 7], team_id=guest.id, prio=1, checkpoint_age=60),
    ]
    p = plan(snapshot([n], [job(1, 4, team_id=owner.id)], [owner, guest], runs))
    (pre,) = p.preemptions
    assert (pre.victim_job_id, pre.claimant_job_id, pre.kind) == (11, 1, "reclaim")
    assert p.placements == ()
    assert p.reasons[1].startswith("waiting for job 11 to checkpoint and stop")


def test_guaranteed_gpus_are_never_reclaimed_for_another_teams_borrowing():
    # owner runs within its own quota; the claimant would only be borrowing.
    owner = team("owner", quota=8, used=8)
    borrower = team("borrower", quota=0, borrow=8, used=0)
    n = node("n1", 8, busy=8)
    runs = [running(10, n, range(8), team_id=owner.id, prio=0)]
    p = plan(snapshot([n], [job(1, 8, team_id=borrower.id, prio=0)], [owner, borrower], runs))
    assert p.preemptions == ()
    # Not even a team under quota may take another team's guaranteed GPUs.
    claimant = team("claimant", quota=8, used=0)
    p = plan(snapshot([n], [job(2, 8, team_id=claimant.id, prio=1)], [owner, claimant], runs))
    assert [x.kind for x in p.preemptions] in ([], ["priority"])
    assert all(x.kind != "reclaim" for x in p.preemptions)


def test_higher_priority_blocked_work_proposes_priority_preemption():
    t = team(quota=16)
    n = node("n1", 8, busy=8)
    runs = [running(10, n, range(8), team_id=t.id, prio=1)]
    p = plan(snapshot([n], [job(1, 8, team_id=t.id, prio=3)], [t], runs))
    (pre,) = p.preemptions
    assert (pre.victim_job_id, pre.kind) == (10, "priority")
    # Equal priority never preempts.
    p = plan(snapshot([n], [job(2, 8, team_id=t.id, prio=1)], [t], runs))
    assert p.preemptions == ()


def test_a_team_at_its_cap_may_preempt_its_own_lower_priority_work():
    t = team("nlp", quota=8, used=8)
    n = node("n1", 8, busy=8)
    runs = [
        running(10, n, range(4), team_id=t.id, prio=0, checkpoint_age=600),
        running(11, n, range(4, 8), team_id=t.id, prio=0, checkpoint_age=30),
    ]
    p = plan(snapshot([n], [job(1, 4, team_id=t.id, prio=2)], [t], runs))
    (pre,) = p.preemptions
    assert (pre.victim_job_id, pre.kind) == (11, "priority")  # least work at risk goes first
    assert "lower priority, same team" in p.reasons[1]


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


def test_reclaim_prefers_a_victim_that_has_run_past_its_exempt_time_over_one_just_resumed():
    owner = team("owner", quota=4, used=0)
    guest = team("guest", quota=0, borrow=16, used=8)
    n = node("n1", 8, busy=8)
    runs = [
        # Just resumed from a preemption: an old checkpoint, but only 60 s of work at risk.
        running(10, n, range(4), team_id=guest.id, started_ago=60, checkpoint_age=3000),
        running(11, n, range(4, 8), team_id=guest.id, started_ago=7200, checkpoint_age=300),
    ]
    p = plan(snapshot([n], [job(1, 4, team_id=owner.id)], [owner, guest], runs))
    (pre,) = p.preemptions
    assert (pre.victim_job_id, pre.kind) == (11, "reclaim")
    # Without the exempt-time preference the least work at risk (60 s < 300 s) would win.
    bare = snapshot([n], [job(1, 4, team_id=owner.id)], [owner, guest], runs)
    from dataclasses import replace

    (pre,) = plan(replace(bare, preempt_exempt_s=0)).preemptions
    assert pre.victim_job_id == 10


def test_a_just_resumed_victim_is_still_taken_when_nothing_else_frees_enough():
    owner = team("owner", quota=8, used=0)
    guest = team("guest", quota=0, borrow=8, used=8)
    n = node("n1", 8, busy=8)
    runs = [running(10, n, range(8), team_id=guest.id, started_ago=30)]
    p = plan(snapshot([n], [job(1, 8, team_id=owner.id)], [owner, guest], runs))
    (pre,) = p.preemptions
    assert (pre.victim_job_id, pre.kind) == (10, "reclaim")  # the reclaim bound holds


def test_several_jobs_within_their_quota_reclaim_in_one_pass_without_taking_guaranteed_gpus():
    # owner's two queued jobs fit its quota together: both reclaim now (one stop grace for
    # the team, not one per job), on different nodes.
    owner = team("owner", quota=16, used=0)
    guest = team("guest", quota=4, borrow=16, used=20)
    n1, n2, n3 = node("n1", 8, busy=8), node("n2", 8, busy=8), node("n3", 8, busy=4)
    runs = [
        running(10, n1, range(8), team_id=guest.id, checkpoint_age=100),
        running(11, n2, range(8), team_id=guest.id, checkpoint_age=200),
        running(12, n3, range(4), team_id=guest.id, checkpoint_age=50),
    ]
    queue = [job(1, 8, team_id=owner.id), job(2, 8, team_id=owner.id)]
    p = plan(snapshot([n1, n2, n3], queue, [owner, guest], runs))
    by_claimant = {}
    for pre in p.preemptions:
        assert pre.kind == "reclaim"
        by_claimant.setdefault(pre.claimant_job_id, set()).add(pre.victim_job_id)
    assert set(by_claimant) == {1, 2}
    victims = set().union(*by_claimant.values())
    assert sum(v.gpus for v in runs if v.id in victims) <= guest.used - guest.quota
    assert p.reasons[2].startswith("waiting for job")
    # A third job would take the team past its quota: it borrows, so it reclaims nothing.
    queue.append(job(3, 8, team_id=owner.id))
    p = plan(snapshot([n1, n2, n3], queue, [owner, guest], runs))
    assert {pre.claimant_job_id for pre in p.preemptions} == {1, 2}


def test_reclaims_of_one_pass_never_take_the_lending_teams_guaranteed_gpus_together():
    # guest lends only 8 GPUs beyond its quota: the first claim takes them, the second none.
    owner = team("owner", quota=16, used=0)
    guest = team("guest", quota=16, borrow=16, used=24)
    nodes = [node(f"n{i}", 8, busy=8) for i in range(1, 4)]
    runs = [running(10 + i, n, range(8), team_id=guest.id) for i, n in enumerate(nodes)]
    queue = [job(1, 8, team_id=owner.id), job(2, 8, team_id=owner.id)]
    p = plan(snapshot(nodes, queue, [owner, guest], runs))
    assert [(pre.claimant_job_id, pre.kind) for pre in p.preemptions] == [(1, "reclaim")]


def elastic(job_id: int, gpus: int, min_gpus: int, **kw):
    return dataclasses.replace(job(job_id, gpus, **kw), min_gpus=min_gpus)


def test_elastic_sizes_are_the_gpu_count_then_its_divisors_down_to_min_gpus():
    assert elastic_sizes(16, 4) == (16, 8, 4)
    assert elastic_sizes(12, 3) == (12, 6, 4, 3)
    assert elastic_sizes(8, 3) == (8, 4)
    assert elastic_sizes(8, None) == (8,)
    assert elastic_sizes(8, 8) == (8,)


def test_an_elastic_job_starts_on_fewer_nodes_when_the_cluster_is_short():
    mine, other = team("mine", quota=0, borrow=64), team("other", quota=8, used=8)
    nodes = [node("a", 8), node("b", 8), node("c", 8, busy=8)]
    runs = [running(50, nodes[2], range(8), team_id=other.id)]
    rigid = plan(snapshot(nodes, [job(1, 32, team_id=mine.id)], [mine, other], runs))
    assert rigid.placements == () and "only 24 GPUs are on schedulable" in rigid.reasons[1]
    p = plan(snapshot(nodes, [elastic(1, 32, 8, team_id=mine.id)], [mine, other], runs))
    (placement,) = p.placements
    assert len(placement.slots) == 16 and set(placement.node_ids) == {nodes[0].id, nodes[1].id}
    assert [s.rank for s in placement.slots] == list(range(16))
    assert 1 not in p.reasons
    # Short of free GPUs rather than of nodes: the same.
    nodes.append(node("d", 8))
    rigid = plan(snapshot(nodes, [job(1, 32, team_id=mine.id)], [mine, other], runs))
    assert rigid.placements == () and "waiting for 32 GPUs" in rigid.reasons[1]
    p = plan(snapshot(nodes, [elastic(1, 32, 8, team_id=mine.id)], [mine, other], runs))
    assert len(p.placements[0].slots) == 16


def test_an_elastic_job_within_its_quota_reclaims_for_its_full_size_instead():
    mine, other = team("mine", quota=16), team("other", quota=0, borrow=8, used=8)
    nodes = [node("a", 8), node("b", 8, busy=8)]
    runs = [running(50, nodes[1], range(8), team_id=other.id)]
    p = plan(snapshot(nodes, [elastic(1, 16, 8, team_id=mine.id)], [mine, other], runs))
    assert p.placements == ()
    (pre,) = p.preemptions
    assert (pre.victim_job_id, pre.claimant_job_id, pre.kind) == (50, 1, "reclaim")


def test_a_shrunk_job_counts_its_smaller_size_against_its_team_and_the_free_gpus():
    t = team(quota=0, borrow=64)
    nodes = [node("a", 8), node("b", 8, busy=4)]
    jobs = [elastic(1, 16, 4, team_id=t.id, submitted=0), job(2, 4, team_id=t.id, submitted=1)]
    p = plan(snapshot(nodes, jobs, [t]))
    got = placed(p)
    assert len(got[1].slots) == 8 and got[1].node_ids == (nodes[0].id,)
    assert len(got[2].slots) == 4 and got[2].node_ids == (nodes[1].id,)


def test_an_elastic_job_never_shrinks_onto_a_higher_jobs_reservation():
    t = team()
    nodes = [node("a", 8), node("b", 8, busy=1)]
    jobs = [job(1, 16, team_id=t.id, prio=2), elastic(2, 16, 8, team_id=t.id, prio=1)]
    p = plan(snapshot(nodes, jobs, [t]))
    assert p.placements == ()
    assert p.reservation[0] == 1 and "reservation held by job 1" in p.reasons[2]


def shrunk(job_id: int, node_view, indices, full: int, **kw):
    """A running elastic job on fewer GPUs (`indices` on `node_view`) than its `full` size."""
    return dataclasses.replace(running(job_id, node_view, indices, **kw), gpus=full)


def test_a_shrunk_job_grows_back_when_nothing_waits_and_its_full_size_fits():
    t = team(quota=0, borrow=64, used=4)
    nodes = [node("a", 8, busy=4), node("b", 8)]
    run = shrunk(7, nodes[0], range(4), 8, team_id=t.id, started_ago=3600)
    p = plan(snapshot(nodes, [], [t], [run]))
    (grow,) = p.grows
    assert (grow.job_id, grow.gpus, grow.held) == (7, 8, 4)
    assert "nothing is queued and 12 GPUs are idle" in grow.reason


def test_no_grow_while_a_queued_job_waits_for_the_idle_gpus_or_a_reservation():
    t = team(quota=0, borrow=64, used=4)
    nodes = [node("a", 8, busy=4), node("b", 8)]
    run = shrunk(7, nodes[0], range(4), 8, team_id=t.id)
    # Placed this pass: the GPUs they take are no longer idle.
    p = plan(snapshot(nodes, [job(1, 8, team_id=t.id), job(3, 4, team_id=t.id)], [t], [run]))
    assert sorted(pl.job_id for pl in p.placements) == [1, 3] and p.grows == ()
    # Placed with 4 GPUs to spare, on the shrunk job's node: it grows there.
    p = plan(snapshot(nodes, [job(1, 8, team_id=t.id)], [t], [run]))
    assert [pl.job_id for pl in p.placements] == [1] and [g.job_id for g in p.grows] == [7]
    # Left waiting (more GPUs than are free): the idle GPUs are its to wait for.
    p = plan(snapshot(nodes, [job(2, 16, team_id=t.id)], [t], [run]))
    assert p.placements == () and p.grows == ()


def test_no_grow_for_a_job_that_shrank_recently_is_stopping_or_would_cross_its_cap():
    nodes = [node("a", 8, busy=4), node("b", 8)]
    t = team(quota=0, borrow=64, used=4)
    young = shrunk(7, nodes[0], range(4), 8, team_id=t.id, started_ago=60)
    assert plan(snapshot(nodes, [], [t], [young])).grows == ()
    stopping = dataclasses.replace(shrunk(7, nodes[0], range(4), 8, team_id=t.id), stopping=True)
    assert plan(snapshot(nodes, [], [t], [stopping])).grows == ()
    capped = team(quota=0, borrow=6, used=4)
    run = shrunk(7, nodes[0], range(4), 8, team_id=capped.id)
    assert plan(snapshot(nodes, [], [capped], [run])).grows == ()
    # Nor one that has not made a step at its smaller size yet (still starting or restoring).
    fresh = dataclasses.replace(shrunk(7, nodes[0], range(4), 8, team_id=t.id), stepped=False)
    assert plan(snapshot(nodes, [], [t], [fresh])).grows == ()
    assert plan(snapshot(nodes, [], [t], [dataclasses.replace(fresh, stepped=True)])).grows


def test_grows_share_the_idle_gpus_highest_priority_first():
    t = team(quota=0, borrow=64, used=6)
    nodes = [node("a", 8, busy={0, 1, 2, 3, 4, 5})]
    low = shrunk(7, nodes[0], [0, 1], 4, team_id=t.id, prio=1, started_ago=7200)
    high = shrunk(8, nodes[0], [2, 3], 4, team_id=t.id, prio=2, started_ago=3600)
    rigid = running(9, nodes[0], [4, 5], team_id=t.id)
    # 2 idle GPUs: enough for one of them to double, not both.
    p = plan(snapshot(nodes, [], [t], [low, high, rigid]))
    assert [g.job_id for g in p.grows] == [8]
    # A whole-node job grows across nodes.
    wide_team = team(quota=0, borrow=64, used=8)
    wide_nodes = [node("c", 8, busy=8), node("d", 8)]
    wide = shrunk(9, wide_nodes[0], range(8), 16, team_id=wide_team.id)
    assert [g.gpus for g in plan(snapshot(wide_nodes, [], [wide_team], [wide])).grows] == [16]


def claiming(job_view, *nodes):
    """The queued job as the claimant of preemptions executed on these nodes."""
    return dataclasses.replace(job_view, claim_nodes=tuple(n.id for n in nodes))


def stopping_for(run, claimant_id: int):
    return dataclasses.replace(run, stopping=True, claimant_id=claimant_id)


def test_a_claimant_waits_for_its_stopping_victims_and_claims_nothing_more():
    owner = team("owner", quota=8, used=0)
    guest = team("guest", quota=0, borrow=16, used=12)
    other = team("other", quota=0, borrow=8, used=0)
    n1 = node("n1", 8, busy={0, 1, 2, 3, 4, 5})
    n2 = node("n2", 8, busy=8)
    runs = [
        stopping_for(running(11, n1, [0, 1, 2, 3], team_id=guest.id), claimant_id=1),
        running(10, n1, [4, 5], team_id=guest.id, checkpoint_age=10),
        running(12, n2, [0, 1, 2, 3, 4, 5], team_id=guest.id, checkpoint_age=10),
    ]
    claimant = claiming(job(1, 6, team_id=owner.id), n1)
    squatter = job(2, 2, team_id=other.id)  # fits n1's 2 free GPUs now
    p = plan(snapshot([n1, n2], [claimant, squatter], [owner, guest, other], runs))
    # Without the claim, job 1 would have taken 2 more victims this pass (and one more in
    # every pass until job 11 exits), and job 2 the 2 GPUs job 1 needs beside job 11's 4.
    assert p.preemptions == ()
    assert p.placements == ()
    assert p.reasons[1].startswith("waiting for job 11 to checkpoint and stop")
    assert "6 GPUs held on n1" in p.reasons[1]
    # A claim needing only what its victims free holds none of the node's idle GPUs.
    p = plan(snapshot([n1, n2], [claiming(job(1, 4, team_id=owner.id), n1), squatter],
                      [owner, guest, other], runs))  # fmt: skip
    assert set(placed(p)) == {2} and p.preemptions == ()


def test_when_its_victims_have_gone_the_claimant_gets_their_gpus_before_anyone_ordered_ahead():
    owner = team("owner", quota=8, used=0)
    guest = team("guest", quota=0, borrow=16, used=4)
    rival = team("rival", quota=8, used=0)
    n1 = node("n1", 8, busy={4, 5, 6, 7})
    runs = [running(10, n1, [4, 5, 6, 7], team_id=guest.id)]
    claimant = job(1, 4, team_id=owner.id, submitted=100)
    ahead = job(2, 4, team_id=rival.id, prio=5)  # higher priority, submitted earlier
    p = plan(snapshot([n1], [claimant, ahead], [owner, guest, rival], runs))
    assert set(placed(p)) == {2}  # without a claim, order decides
    p = plan(snapshot([n1], [claiming(claimant, n1), ahead], [owner, guest, rival], runs))
    assert set(placed(p)) == {1}
    assert {s.node_id for s in placed(p)[1].slots} == {n1.id}


def test_a_claimant_gets_the_gpus_stopped_for_it_while_its_teams_borrowing_is_paused():
    # Job 1 reclaimed a GPU within its team's quota. Before its victim exited, the team's
    # later jobs filled the quota and the team's own borrowed GPUs were reclaimed (borrowing
    # paused). The GPU stopped for job 1 is still job 1's; another job of the team is not.
    owner = team("owner", quota=4, borrow=8, used=4, paused=True)
    n1 = node("n1", 8, busy={1, 2, 3, 4})
    runs = [running(20, n1, [1, 2, 3, 4], team_id=owner.id)]
    claimant = claiming(job(1, 1, team_id=owner.id), n1)
    later = job(2, 1, team_id=owner.id)
    p = plan(snapshot([n1], [claimant, later], [owner], runs))
    assert set(placed(p)) == {1}
    assert "borrowing paused after a reclaim" in p.reasons[2]
    # Up to the borrow limit only.
    capped = dataclasses.replace(owner, borrow_limit=0)
    p = plan(snapshot([n1], [claimant, later], [capped], runs))
    assert p.placements == ()


def test_a_claimant_whose_victims_are_gone_does_not_take_gpus_another_claimant_waits_for():
    # Jobs 1 and 2 each preempted a 1-GPU job on n1; job 1's victim has exited, job 2's has
    # not. Job 2 is ordered first, but the freed GPU is job 1's.
    owner = team("owner", quota=8, used=0)
    guest = team("guest", quota=0, borrow=16, used=7)
    n1 = node("n1", 8, busy={1, 2, 3, 4, 5, 6, 7})
    runs = [
        stopping_for(running(20, n1, [1], team_id=guest.id), claimant_id=2),
        running(21, n1, [2, 3, 4, 5, 6, 7], team_id=guest.id),
    ]
    first = claiming(job(2, 1, team_id=owner.id, prio=5), n1)
    second = claiming(job(1, 1, team_id=owner.id), n1)
    p = plan(snapshot([n1], [first, second], [owner, guest], runs))
    assert set(placed(p)) == {1}
    assert p.reasons[2].startswith("waiting for job 20 to checkpoint and stop")
    assert p.preemptions == ()


def test_gpus_already_stopping_are_not_reclaimed_again_from_the_lending_team():
    # guest holds 16 against a quota of 8; job 10 (its 8 borrowed GPUs) is already stopping
    # for job 1. Stopping job 11 too for job 2 would take guest's guaranteed GPUs.
    owner = team("owner", quota=16, used=0)
    guest = team("guest", quota=8, borrow=16, used=16)
    n1, n2 = node("n1", 8, busy=8), node("n2", 8, busy=8)
    runs = [
        stopping_for(running(10, n1, range(8), team_id=guest.id), claimant_id=1),
        running(11, n2, range(8), team_id=guest.id),
    ]
    queue = [claiming(job(1, 8, team_id=owner.id), n1), job(2, 8, team_id=owner.id)]
    p = plan(snapshot([n1, n2], queue, [owner, guest], runs))
    assert p.preemptions == ()
    assert p.reasons[1].startswith("waiting for job 10")


def test_a_whole_node_claimant_also_gets_the_idle_nodes_its_claim_reserved():
    owner = team("owner", quota=16, used=0)
    rival = team("rival", quota=8, used=8)
    n1, n2, n3 = node("n1", 8), node("n2", 8), node("n3", 8, busy=8)
    runs = [running(10, n3, range(8), team_id=rival.id)]
    # Job 1's victim on n1 has gone; its claim also counted on the idle n2.
    claimant = claiming(job(1, 16, team_id=owner.id, submitted=100), n1)
    ahead = job(2, 8, team_id=rival.id, prio=5)
    p = plan(snapshot([n1, n2, n3], [claimant, ahead], [owner, rival], runs))
    assert set(placed(p)) == {1}
    assert set(placed(p)[1].node_ids) == {n1.id, n2.id}


def test_a_claimant_inside_its_team_waits_for_its_victim_instead_of_taking_another():
    # lab is at its cap; job 1 (high priority) had job 10 (low) stopped for it. Job 10's GPUs
    # still count against lab until it exits, but they are job 1's: it takes nothing else.
    lab = team("lab", quota=16, used=16)
    n1, n2 = node("n1", 8, busy=8), node("n2", 8, busy=8)
    runs = [
        stopping_for(running(10, n1, range(8), team_id=lab.id, prio=0), claimant_id=1),
        running(11, n2, range(8), team_id=lab.id, prio=0),
    ]
    claimant = claiming(job(1, 8, team_id=lab.id, prio=2), n1)
    p = plan(snapshot([n1, n2], [claimant], [lab], runs))
    assert p.preemptions == ()
    assert p.reasons[1].startswith("waiting for job 10 to checkpoint and stop")


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


def test_a_borrowing_head_neither_takes_nor_admits_another_teams_guaranteed_filler():
    # Team b's 2-GPU job within b's quota may not fill the node team a's borrowing head
    # drains (the head could not stop it then: invariant 6); a borrowed one of b may.
    a, b = team("a", quota=0, borrow=16), team("b", quota=4, borrow=16)
    n = node("n", 8, busy=6)
    runs = [running(10, n, range(6), team_id=a.id, prio=2, ends_in=3600)]
    head = job(1, 8, team_id=a.id, prio=2, estimate=1000)  # ordered first by priority
    guaranteed = job(2, 2, team_id=b.id, submitted=1, estimate=7200)
    p = plan(snapshot([n], [head, guaranteed], [a, b], runs))
    assert p.placements == ()
    busy_b = dataclasses.replace(b, used=4)  # b already holds its quota elsewhere
    p = plan(snapshot([n], [head, guaranteed], [a, busy_b], runs))
    assert [(pl.job_id, pl.filler) for pl in p.placements] == [(2, True)]
    # And a filler of b's within b's quota already there is not stopped for a's head.
    n2 = node("n2", 8, busy=2)
    theirs = _filler(20, n2, [0, 1], team_id=b.id)
    b_running = dataclasses.replace(b, used=2)
    p = plan(snapshot([n2], [head], [a, b_running], [theirs]))
    assert p.preemptions == ()


def test_a_reclaims_placement_keeps_its_free_gpus_from_later_jobs_of_its_pass():
    # Team a (quota 8, nothing in use) needs 2 GPUs on one node; n1 has 1 free and 7 lent to
    # team b for hours. The reclaim stops one of b's jobs and places the claimant there and
    # on the free GPU. Job 3 (team c, 1 GPU, 10 minutes) ends long before n1 drains of b's
    # other jobs, so EASY backfill on the claim's reservation let it take that free GPU; the
    # claimant, one short when its victim exited, claimed again and waited a second grace
    # (a reclaim of 94 s on msft at 1,280 GPUs).
    a = team("a", quota=8, borrow=0, used=0)
    b = team("b", quota=0, borrow=16, used=7)
    c = team("c", quota=8, borrow=0, used=0)
    n1 = node("n1", 8, busy=7)
    runs = [running(100 + i, n1, [i], team_id=b.id, ends_in=36000) for i in range(7)]
    jobs = [
        job(1, 2, team_id=a.id, submitted=0, estimate=3600),
        job(3, 1, team_id=c.id, submitted=1, estimate=600),
    ]
    p = plan(snapshot([n1], jobs, [a, b, c], runs))
    assert [(x.claimant_job_id, x.kind) for x in p.preemptions] == [(1, PreemptionKind.RECLAIM)]
    assert 3 not in placed(p)
    assert "reservation held by job 1" in p.reasons[3]
