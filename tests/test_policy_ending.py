"""A claim that jobs ending anyway would meet within a stop's grace waits for them instead of
stopping a job (docs/scheduling.md, rule 5; the policy and the simulator without a database, the
live reader with one). The claim waits the grace for its victims in any case, and each stop
costs its victim a restart."""

import dataclasses
from datetime import timedelta

import pytest

from jobs.scheduling import policy
from jobs.scheduling.policy import plan
from jobs.scheduling.simulate import EPOCH, SimConfig, run
from jobs.scheduling.trace import TeamQuota, TraceJob
from jobs.scheduling.vocab import PreemptionKind
from tests.builders import T0, job, node, placed, running, team
from tests.builders import snapshot as plain_snapshot


def snapshot(*args):
    """The rule is the setting WAIT_FOR_ENDING_JOBS, off by default (its text says why)."""
    return dataclasses.replace(plain_snapshot(*args), wait_for_ending=True)


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


def test_without_such_an_end_or_the_setting_the_same_claim_reclaims():
    # The baseline the rule is measured against: no end known, or one past the grace, or the
    # setting off (the default).
    for ending_in in (None, 61.0):
        owner, guest, nodes, runs = _borrowed_cluster(ending_in)
        p = plan(snapshot(nodes, [job(1, 4, team_id=owner.id)], [owner, guest], runs))
        assert [pr.kind for pr in p.preemptions] == [PreemptionKind.RECLAIM], ending_in
        assert p.waits[1].code == "preempting"
    owner, guest, nodes, runs = _borrowed_cluster(ending_in=40)
    p = plan(plain_snapshot(nodes, [job(1, 4, team_id=owner.id)], [owner, guest], runs))
    assert [pr.kind for pr in p.preemptions] == [PreemptionKind.RECLAIM]


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
    config = SimConfig(gpus=8, quotas=q, checkpoint_on_stop=True, wait_for_ending=True)

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
    monkeypatch.setattr(policy, "wait_for_ends", lambda *args: False)
    ends, stops, _ = replay(4960)
    assert stops == 1 and ends["b2"] > 20_010


def test_a_team_at_its_cap_waits_for_its_own_job_ending_rather_than_stopping_one():
    # lab is at its cap with two low-priority jobs; its high-priority job would stop one of
    # them (rule 6, inside the team), but job 10 frees its 4 GPUs within the grace anyway.
    lab = team("lab", quota=8, used=8)
    n1 = node("n1", 8, busy=8)
    low_ending = running(10, n1, [0, 1, 2, 3], team_id=lab.id, prio=0, checkpoint_age=5)
    low_long = running(11, n1, [4, 5, 6, 7], team_id=lab.id, prio=0, checkpoint_age=5)
    urgent = job(1, 4, team_id=lab.id, prio=2)
    p = plan(snapshot([n1], [urgent], [lab], [low_ending, low_long]))
    assert [pr.kind for pr in p.preemptions] == [PreemptionKind.PRIORITY]  # without an end
    p = plan(snapshot([n1], [urgent], [lab], [ends(low_ending, 25), low_long]))
    assert p.preemptions == ()
    assert p.waits[1].code == "ending" and p.waits[1].data["ending"] == (10,)
    # Another team's job ending there frees nothing of lab's cap: the claim goes ahead.
    other = team("other", quota=8, used=4)
    theirs = ends(running(12, n1, [0, 1, 2, 3], team_id=other.id), 25)
    lab_half = team("lab", quota=4, used=4, team_id=lab.id)
    p = plan(snapshot([n1], [urgent], [lab_half, other], [theirs, low_long]))
    assert [(pr.victim_job_id, pr.kind) for pr in p.preemptions] == [(11, PreemptionKind.PRIORITY)]


def test_once_they_have_ended_the_gpus_go_to_the_job_that_waited_for_them():
    # Pass 1: job 1 (owner, within quota) waits for job 10's end on n1. Pass 2, job 10 gone:
    # job 2, arrived meanwhile with a higher priority and so ordered first, would take n1's
    # GPUs and job 1 would reclaim after all (a second grace). The hold is job 1's claim for
    # the next pass.
    owner = team("owner", quota=8, used=0)
    guest = team("guest", quota=0, borrow=16, used=16)
    rival = team("rival", quota=0, borrow=8, used=0)
    n1, n2 = node("n1", 8, busy=8), node("n2", 8, busy=8)
    soon = ends(running(10, n1, range(8), team_id=guest.id), 30)
    other = running(11, n2, range(8), team_id=guest.id, started_ago=60)  # protected
    claimant = job(1, 8, team_id=owner.id, submitted=10)
    ahead = job(2, 8, team_id=rival.id, prio=3)
    first = plan(snapshot([n1, n2], [claimant], [owner, guest, rival], [soon, other]))
    by = T0 + timedelta(seconds=30)
    assert first.waits[1].code == "ending" and first.ending_holds == {1: ((n1.id,), by)}
    assert first.waits[1].data["node_ids"] == (n1.id,)
    # Job 10 has ended: n1 is free.
    freed = dataclasses.replace(n1, free=frozenset(range(8)))
    guest_after = dataclasses.replace(guest, used=8)
    teams = [owner, guest_after, rival]
    held = dataclasses.replace(claimant, claim_nodes=first.ending_holds[1][0])
    assert set(placed(plan(snapshot([freed, n2], [claimant, ahead], teams, [other])))) == {2}
    assert set(placed(plan(snapshot([freed, n2], [held, ahead], teams, [other])))) == {1}


def test_the_simulator_gives_the_held_nodes_to_the_waiting_job_in_the_next_pass():
    seen, by_seen = [], []

    def recording(snap):
        seen.append({j.name: j.claim_nodes for j in snap.queued})
        by_seen.extend(j.ending_by for j in snap.queued if j.name == "a1")
        return plan(snap)

    q = {"a": TeamQuota(8, 0), "b": TeamQuota(0, 8)}
    trace = [
        TraceJob("b1", 0, 4, 5000, "b"),
        TraceJob("b2", 10, 4, 20_000, "b"),
        TraceJob("a1", 4960, 4, 1000, "a"),
    ]
    config = SimConfig(gpus=8, quotas=q, checkpoint_on_stop=True, wait_for_ending=True)
    run(trace, recording, config)
    # The pass at a1's arrival holds b1's node for it; the pass at b1's end sees the claim.
    assert [s["a1"] for s in seen if "a1" in s] == [(), (1,)]
    # ... and its first wait's deadline, which a later wait may not pass.
    assert [b for b in by_seen if b is not None] == [EPOCH + timedelta(seconds=5000)]


@pytest.mark.django_db
def test_the_live_reader_gives_a_job_the_nodes_its_last_pass_held_for_ending_jobs(
    make_team, make_user, make_nodes, settings
):
    """The hold is read back from the job's stored wait (Job.wait), for the next pass only:
    not once the jobs it waited for were due to be gone CLAIM_AFTER_EXIT_S ago."""
    from django.utils import timezone

    from jobs.models import Job
    from jobs.scheduling.reader import CLAIM_AFTER_EXIT_S, take_snapshot
    from jobs.scheduling.vocab import WaitReason
    from tests.heartbeats import submit

    lab = make_team("lab", quota=8)
    ann = make_user("ann", team=lab)
    n1, n2 = make_nodes(2, 8)
    fresh, stale, other = (submit(lab, ann, gpus=8) for _ in range(3))
    now = timezone.now()

    def held(job, until_s: float):
        until = now.timestamp() + until_s
        data = {"ending": [99], "gpus": 8, "until": until, "by": until - 5}
        data |= {"nodes": [n2.name], "node_ids": [n2.id]}
        Job.objects.filter(pk=job.pk).update(wait=WaitReason("ending", data).to_json())

    held(fresh, 20)
    held(stale, -CLAIM_AFTER_EXIT_S - 1)
    Job.objects.filter(pk=other.pk).update(wait={"code": "reserved", "data": {"gpus": 8}})
    assert all(not j.claim_nodes for j in take_snapshot(now).queued)  # the setting off
    settings.LOCKSTEP = {**settings.LOCKSTEP, "WAIT_FOR_ENDING_JOBS": True}
    queued = {j.id: j for j in take_snapshot(now).queued}
    claims = {i: j.claim_nodes for i, j in queued.items()}
    assert claims == {fresh.id: (n2.id,), stale.id: (), other.id: ()}
    assert queued[fresh.id].ending_by.timestamp() == now.timestamp() + 15
    assert queued[stale.id].ending_by is None


def test_while_it_still_waits_the_free_gpus_beside_the_ending_job_stay_held():
    # Pass 2 of a hold: job 1 needs all of n1, where job 10 ends within the grace and 4 GPUs
    # are free. Job 2, arrived since with a higher priority, fits those 4: left to the main
    # pass, it took them, and job 1 had to reclaim after all when job 10 ended.
    owner = team("owner", quota=8, used=0)
    guest = team("guest", quota=0, borrow=16, used=12)
    rival = team("rival", quota=0, borrow=8, used=0)
    n1, n2 = node("n1", 8, busy={0, 1, 2, 3}), node("n2", 8, busy=8)
    soon = ends(running(10, n1, [0, 1, 2, 3], team_id=guest.id), 20)
    other = running(11, n2, range(8), team_id=guest.id, started_ago=60)
    claimant = dataclasses.replace(job(1, 8, team_id=owner.id), claim_nodes=(n1.id,))
    ahead = job(2, 4, team_id=rival.id, prio=3)
    p = plan(snapshot([n1, n2], [claimant, ahead], [owner, guest, rival], [soon, other]))
    assert 2 not in placed(p) and p.preemptions == ()
    assert p.waits[1].code == "ending" and p.ending_holds == {1: ((n1.id,), soon.frees_by)}
    # Without the hold from the last pass, job 2 takes n1's free GPUs first.
    bare = dataclasses.replace(claimant, claim_nodes=())
    p = plan(snapshot([n1, n2], [bare, ahead], [owner, guest, rival], [soon, other]))
    assert {s.node_id for s in placed(p)[2].slots} == {n1.id}


def test_a_job_whose_ending_jobs_gpus_went_elsewhere_does_not_wait_again_past_its_deadline():
    # Job 1 first waited for an end due at +20 s (ending_by); that wait is over and it still
    # waits. Job 12 ends at +40 s: waiting for it would chain a second wait past the first's
    # deadline (90 s on msft), so it reclaims. An end by the deadline is still waited for.
    owner, guest, nodes, runs = _borrowed_cluster(ending_in=40)
    waited = dataclasses.replace(job(1, 4, team_id=owner.id), ending_by=T0 + timedelta(seconds=20))
    p = plan(snapshot(nodes, [waited], [owner, guest], runs))
    assert [pr.kind for pr in p.preemptions] == [PreemptionKind.RECLAIM]
    runs[0] = ends(runs[0], 15)
    p = plan(snapshot(nodes, [waited], [owner, guest], runs))
    assert p.waits[1].code == "ending" and p.preemptions == ()
    assert p.waits[1].data["by"] == (T0 + timedelta(seconds=20)).timestamp()


def test_two_jobs_waiting_on_one_node_each_keep_the_ending_job_they_need():
    # Jobs 1 and 2 each hold n1 from the last pass (claim_nodes), for jobs 10 and 11, which
    # end within the grace. The first one looked at takes only what it needs, so the second
    # still waits for its own and nobody reclaims (taking both made job 2 reclaim: msft).
    owner = team("owner", quota=8, used=0)
    guest = team("guest", quota=0, borrow=16, used=16)
    n1, n2 = node("n1", 8, busy=8), node("n2", 8, busy=8)
    runs = [
        ends(running(10, n1, [0], team_id=guest.id), 20),
        ends(running(11, n1, [1], team_id=guest.id), 30),
        running(12, n1, [2, 3, 4, 5, 6, 7], team_id=guest.id),
        running(13, n2, range(8), team_id=guest.id),
    ]
    by = T0 + timedelta(seconds=40)
    queue = [
        dataclasses.replace(job(i, 1, team_id=owner.id), claim_nodes=(n1.id,), ending_by=by)
        for i in (1, 2)
    ]
    p = plan(snapshot([n1, n2], queue, [owner, guest], runs))
    assert p.preemptions == ()
    assert {p.waits[1].data["ending"], p.waits[2].data["ending"]} == {(10,), (11,)}
