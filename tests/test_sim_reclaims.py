"""The simulator's reclaim clocks (jobs.scheduling.sim_reclaims): when a team's wait for its lent
GPUs starts and stops, and the bound each wait is held to (no database)."""

import itertools
import random
from dataclasses import replace

from jobs.scheduling.baselines import fifo
from jobs.scheduling.sim_reclaims import ReclaimClocks
from jobs.scheduling.simulate import SimConfig, run
from jobs.scheduling.trace import TeamQuota, TraceJob


def jobs(*rows) -> list[TraceJob]:
    return [
        TraceJob(job_id, submit, gpus, duration, team)
        for job_id, submit, gpus, duration, team in rows
    ]


def latest_first(snapshot):
    """FIFO with submit times mirrored (the latest submitted first), and no preemption: a
    planner under which lent GPUs come back only as the borrowers end."""
    flipped = (
        replace(j, submitted_at=snapshot.now + (snapshot.now - j.submitted_at))
        for j in snapshot.queued
    )
    return fifo(replace(snapshot, queued=tuple(flipped)))


def test_a_clock_stops_when_the_teams_own_work_takes_its_room():
    # Four nodes of 8; a (quota 16) borrows all of b's 16 GPUs. b1 (16 GPUs, whole b quota)
    # asks at 100 s, b2 (8 GPUs) at 200 s. a2 ends at 1,000 s and b's own b2 takes that node:
    # b's room (16 - 8) no longer fits b1, which now waits behind its own team's b2, not for a
    # reclaim. Its clock stops at 900 s. It used to run on until b1 started at 6,000 s.
    trace = jobs(
        ("a1", 0, 16, 20_000, "a"),
        ("a2", 0, 8, 1_000, "a"),
        ("a3", 0, 8, 3_000, "a"),
        ("b1", 100, 16, 100, "b"),
        ("b2", 200, 8, 5_000, "b"),
    )
    quotas = {"a": TeamQuota(16, 16), "b": TeamQuota(16, 16)}
    result = run(trace, latest_first, SimConfig(gpus=32, quotas=quotas))
    starts = {r[0]: r[3] for r in result.records}
    assert starts["b2"] == 1_000 and starts["b1"] == 6_000  # the scenario happened
    b = result.metrics["teams"]["b"]
    # b1's clock, stopped when b2 took the room (b2 had none: b1 ahead of it filled the room).
    assert b["reclaims"] == 1 and b["reclaim_max_s"] == 900


def clocks(quota: dict[int, int], queue: dict[int, list[tuple[int, int]]], exempt_s=14_400.0):
    """ReclaimClocks over hand-made team queues: per team, its (job id, GPUs) in order."""
    team_queue = {tid: [(0, float(jid), jid, g) for jid, g in queue.get(tid, [])] for tid in quota}
    sizes = {tid: {g: 1 for _, _, _, g in members} for tid, members in team_queue.items()}
    return ReclaimClocks(
        quota, 10, team_queue, sizes, grace_s=60.0, gang_exempt_s=exempt_s, largest_node=8
    )


def test_a_clock_is_held_to_the_grace_when_a_reclaim_could_take_enough_gpus():
    # Team 1 (quota 64) borrows 64 of team 2's GPUs with 8-GPU jobs; team 2's 16-GPU job waits.
    c = clocks({1: 64, 2: 64}, {2: [(5, 16)]})
    c.tick(0.0, {1: 128, 2: 0}, free=0)
    assert c.start[4] == 0.0 and c.bound[4] == 60.0
    c.started(5, 2, 200.0, {1: 112, 2: 16})
    assert c.lengths()[2] == [200.0]
    assert c.over_their_bound() == 1 and c.gang_bounded() == 0


def test_gpus_lent_to_a_drained_for_gang_extend_the_bound_to_its_exemption():
    # Team 1 (quota 64) runs a 112-GPU gang (beyond its quota, whole nodes) started at 1,000 s
    # plus 8 GPUs of small jobs; team 2 holds 8 and wants 32 more. A reclaim could take only
    # team 1's 8 non-gang GPUs: the clock may run until the gang's exemption ends (1,000 +
    # 14,400) plus the grace.
    c = clocks({1: 64, 2: 64}, {2: [(5, 32)]})
    c.gang_started(1, 1, 112, 1_000.0)
    c.tick(2_000.0, {1: 120, 2: 8}, free=0)
    assert c.bound[4] == 60.0 + 15_400.0 - 2_000.0
    c.started(5, 2, 2_000.0 + 5_000.0, {1: 88, 2: 40})
    assert c.over_their_bound() == 0 and c.gang_bounded() == 1
    # Without the gang (it ended), the same wait is over the grace.
    c.released(1)
    c.team_queue[2].append((0, 6.0, 6, 32))
    c.team_sizes[2][32] = 1
    c.tick(8_000.0, {1: 120, 2: 8}, free=0)
    assert c.bound[5] == 60.0
    # Its team holds its whole quota again: the clock stops though the job has not started.
    c.started(7, 2, 9_000.0, {1: 64, 2: 64})
    assert sorted(c.lengths()[2]) == [1_000.0, 5_000.0]
    assert c.over_their_bound() == 1


def test_a_job_straddling_its_teams_quota_counts_whole_toward_what_a_reclaim_could_take():
    # Team 1 runs a drained-for 112-GPU gang (exempt) and an 8-GPU job; team 3 (quota 70)
    # runs five 16-GPU jobs, 10 GPUs beyond its quota. Team 2 wants 24 with nothing free. A
    # reclaim takes team 1's 8-GPU job and one of team 3's 16-GPU jobs whole (it straddles
    # the quota: victims.Victims.claim), 24 in all, so the clock is held to the grace. Counting
    # only team 3's 10 GPUs beyond its quota (before) found 18 and held it to the gang's bound.
    c = clocks({1: 64, 2: 64, 3: 70}, {2: [(5, 24)]})
    c.gang_started(1, 1, 112, 1_000.0)
    c.gang_started(2, 1, 8, 1_000.0)
    for jid in (3, 4, 6, 7, 8):
        c.gang_started(jid, 3, 16, 1_000.0)
    assert set(c.gangs) == {1}
    c.tick(2_000.0, {1: 120, 2: 0, 3: 80}, free=0)
    assert c.bound[4] == 60.0
    # With team 3 within its quota it lends nothing: only team 1's 8 are takable.
    c.released(8)
    c.team_queue[2].append((0, 9.0, 9, 24))
    c.team_sizes[2][24] = 2
    c.tick(3_000.0, {1: 120, 2: 0, 3: 64}, free=0)
    assert c.bound[8] == 60.0 + 15_400.0 - 3_000.0


def test_a_gang_within_its_teams_quota_or_on_one_node_is_not_exempt():
    c = clocks({1: 64, 2: 64}, {2: [(5, 16)]})
    c.gang_started(1, 1, 64, 0.0)  # within the quota
    c.gang_started(2, 1, 8, 0.0)  # one node
    assert c.gangs == {}
    c = clocks({1: 64, 2: 64}, {2: [(5, 16)]}, exempt_s=0)  # rule 5 off
    c.gang_started(1, 1, 128, 0.0)
    assert c.gangs == {}


def test_a_pass_when_a_gangs_exemption_ends_lets_the_reclaim_go_ahead_then():
    # Four nodes of 8. a (quota 8) runs a 24-GPU gang on lent GPUs: rule 5 keeps reclaims
    # off it for 4 h. b (quota 24) asks for 16 at 100 s; only 8 are free, so its clock is
    # held to the gang's exemption plus the grace (14,360 s). With passes at events only
    # nothing happens between 100 s and the gang's end at 20,000 s, so b waits for it. With a
    # pass at the exemption's end (the default, as the live scheduler's tick) the reclaim
    # stops the gang then and b starts within its bound.
    trace = jobs(("gang", 0, 24, 20_000, "a"), ("b1", 100, 16, 100, "b"))
    quotas = {"a": TeamQuota(8, 24), "b": TeamQuota(24, 0)}
    config = SimConfig(gpus=32, quotas=quotas, checkpoint_on_stop=True)
    assert config.pass_at_protection_end
    events_only = run(trace, "lockstep", replace(config, pass_at_protection_end=False))
    assert {r[0]: r[3] for r in events_only.records}["b1"] == 20_000
    m = events_only.metrics
    assert (m["reclaims_gang_bounded"], m["reclaims_over_their_bound"]) == (1, 1)
    ticking = run(trace, "lockstep", config)
    assert {r[0]: r[3] for r in ticking.records}["b1"] == 14_400 + 60
    m = ticking.metrics
    assert (m["reclaims_gang_bounded"], m["reclaims_over_their_bound"]) == (1, 0)
    assert m["reclaim_max_s"] == 14_360


def test_what_a_reclaim_could_take_is_the_most_any_order_of_victims_gives():
    """Against every order of taking a lender's jobs (each taken while the lender is still
    beyond its quota), on random teams; and the hand case where taking the largest first
    falls short: 10 GPUs over with jobs of 8, 8, 3 and 1 lends 1 + 8 + 8 = 17, not 16."""

    def most(jobs, spare):
        best = 0
        for r in range(len(jobs) + 1):
            for order in itertools.permutations(jobs, r):
                left, taken = spare, 0
                for g in order:
                    if left <= 0:
                        break
                    left, taken = left - g, taken + g
                else:
                    best = max(best, taken)
        return best

    def takable(jobs, quota):
        c = clocks({1: quota, 2: 10}, {})
        for jid, g in enumerate(jobs, start=100):
            c.gang_started(jid, 1, g, 0.0)
        return c._takable(2, {1: sum(jobs), 2: 0}, exempt=set())

    assert takable([8, 8, 3, 1], quota=10) == 17
    rng = random.Random(7)
    for _ in range(200):
        jobs = [rng.choice([1, 2, 3, 4, 8, 16, 32]) for _ in range(rng.randint(0, 5))]
        quota = rng.randint(0, 40)
        assert takable(jobs, quota) == most(jobs, sum(jobs) - quota), (jobs, quota)
