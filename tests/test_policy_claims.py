"""The victims' GPUs go to their claimant (docs/scheduling.md, rule 5; pure policy, no
database): while its victims stop, a claimant claims nothing more and the GPUs it needs are
held from everyone else; once they have gone it is placed there before anyone; GPUs already
stopping are not lent again."""

import dataclasses

from jobs.scheduling.policy import plan
from jobs.scheduling.vocab import PreemptionKind
from tests.builders import job, node, placed, running, snapshot, team


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
