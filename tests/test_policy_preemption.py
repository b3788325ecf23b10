"""Whom the pure policy stops, and for whom (no database): reclaims of lent GPUs
(docs/scheduling.md, rule 5), starvation claims (rule 4) and priority preemption (rule 6).
What a claimant does while its victims stop is in test_policy_claims.py; the protections
(minimum run, weighing, safety stop) are in test_protection.py."""

import dataclasses

from jobs.scheduling.policy import plan
from tests.builders import job, node, running, snapshot, team

# --- reclaims: the victims (rule 5) ---------------------------------------------------------------


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


# --- starvation claims (rule 4) -------------------------------------------------------------------


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


# --- priority preemption (rule 6) -----------------------------------------------------------------


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
