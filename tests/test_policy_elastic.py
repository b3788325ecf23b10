"""Elastic jobs (min_gpus) in the pure policy (no database): the sizes they may start at, and
growing back to their full size (docs/scheduling.md, rule 8)."""

import dataclasses

from jobs.scheduling.policy import plan
from jobs.scheduling.vocab import elastic_sizes
from tests.builders import job, node, placed, running, snapshot, team

# --- starting smaller -----------------------------------------------------------------------------


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


# --- growing back (rule 8) ------------------------------------------------------------------------


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
