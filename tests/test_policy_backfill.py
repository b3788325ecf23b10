"""The pure policy's reservations and backfill (docs/scheduling.md, rule 4; no database): the
blocked head's reservation, EASY backfill around it, fillers on its draining nodes and their
stop, and starving jobs' reservations of their own. Starvation claims are in
test_policy_preemption.py."""

import dataclasses
from datetime import timedelta

from jobs.scheduling.policy import plan
from jobs.scheduling.vocab import PreemptionKind
from tests.builders import T0, job, node, placed, running, snapshot, team

# --- the head's reservation and EASY backfill -----------------------------------------------------


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


# --- fillers on the head's draining nodes ---------------------------------------------------------


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


def test_quota_before_drain_starts_a_guaranteed_job_on_a_borrowing_heads_draining_nodes():
    # QUOTA_BEFORE_DRAIN: team b's 2-GPU job within b's quota starts on the free GPUs of the
    # node team a's borrowing head drains, as a job of its own (not a filler: the head may
    # not stop it). Not for a borrowed job of b's, nor when the head is within its quota.
    a, b = team("a", quota=0, borrow=16), team("b", quota=4, borrow=16)
    n = node("n", 8, busy=6)
    runs = [running(10, n, range(6), team_id=a.id, prio=2, ends_in=3600)]
    head = job(1, 8, team_id=a.id, prio=2, estimate=1000)  # ordered first by priority
    guaranteed = job(2, 2, team_id=b.id, submitted=1, estimate=7200)
    snap = snapshot([n], [head, guaranteed], [a, b], runs)
    assert plan(snap).placements == ()  # the default: b waits behind the drain
    p = plan(dataclasses.replace(snap, quota_before_drain=True))
    assert [(pl.job_id, pl.filler) for pl in p.placements] == [(2, False)]
    assert p.preemptions == () and p.waits[1].code == "reserved"
    over = dataclasses.replace(b, used=4)  # b holds its quota elsewhere: this one borrows
    p = plan(dataclasses.replace(snap, teams=(a, over), quota_before_drain=True))
    assert [(pl.job_id, pl.filler) for pl in p.placements] == [(2, True)]  # a filler, as ever
    # The head within a's quota: the setting changes nothing (b's job may fill, stoppable).
    own = dataclasses.replace(snap, teams=(dataclasses.replace(a, quota=16), b))
    p = plan(dataclasses.replace(own, quota_before_drain=True))
    assert p.placements == plan(own).placements
    assert [(pl.job_id, pl.filler) for pl in p.placements] == [(2, True)]


# --- starving jobs' reservations ------------------------------------------------------------------


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
