"""Property-based tests: random clusters, queues and running jobs never make plan() break
invariants 1 (a GPU in one allocation), 2 (whole gangs) and 6 (guaranteed GPUs are never
reclaimed for another team's borrowing), nor a team's cap; every waiting job gets a reason."""

import json
from collections import Counter
from dataclasses import replace
from datetime import timedelta

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobs.scheduling.order import fair_share
from jobs.scheduling.policy import plan
from jobs.scheduling.snapshot import JobView, NodeView, RunningView, Snapshot, TeamView
from jobs.scheduling.vocab import WaitReason
from tests.builders import T0


@st.composite
def clusters(draw):
    n_nodes = draw(st.integers(1, 8))
    gpn = draw(st.sampled_from([2, 4, 8]))
    nodes = [
        NodeView(
            id=i + 1,
            name=f"n{i}",
            rack=f"r{i % 3}",
            gpu_ids=tuple((i + 1) * 100 + g for g in range(gpn)),
            free=frozenset(),
            schedulable=draw(st.booleans()) or i == 0,
        )
        for i in range(n_nodes)
    ]
    n_teams = draw(st.integers(1, 4))
    # Teams with no quota borrow everything: their work is reclaimed or starvation-claimed.
    quotas = [draw(st.sampled_from([0, 0, 1, gpn, n_nodes * gpn])) for _ in range(n_teams)]
    borrows = [draw(st.integers(0, n_nodes * gpn)) for _ in range(n_teams)]
    # Running jobs take disjoint GPUs; each team's usage is what it runs.
    free = {n.id: list(range(gpn)) for n in nodes}
    running, used = [], Counter()
    for jid in range(1000, 1000 + draw(st.integers(0, 10))):
        node = draw(st.sampled_from(nodes))
        if not free[node.id]:
            continue
        size = draw(st.integers(1, len(free[node.id])))
        take, free[node.id] = free[node.id][:size], free[node.id][size:]
        team_id = draw(st.integers(1, n_teams))
        used[team_id] += size
        running.append(
            RunningView(
                id=jid,
                team_id=team_id,
                # Some run shrunk (elastic): on fewer GPUs than their full size.
                gpus=size * draw(st.sampled_from([1, 1, 2, 4])),
                priority=draw(st.integers(0, 3)),
                slots=tuple((node.id, i) for i in take),
                started_at=T0 - timedelta(seconds=draw(st.integers(1, 10_000))),
                expected_end=draw(
                    st.sampled_from([None, T0 + timedelta(seconds=600), T0 + timedelta(days=1)])
                ),
                last_checkpoint_at=None,
                stopping=draw(st.booleans()) and draw(st.booleans()),
            )
        )
    nodes = [
        NodeView(
            id=n.id,
            name=n.name,
            rack=n.rack,
            gpu_ids=n.gpu_ids,
            free=frozenset(free[n.id]),
            schedulable=n.schedulable,
        )
        for n in nodes
    ]
    teams = [
        TeamView(
            id=t + 1,
            name=f"t{t}",
            quota=quotas[t],
            borrow_limit=borrows[t],
            used=used[t + 1],
            weight=draw(st.sampled_from([0.5, 1.0, 2.0])),
            usage_history=draw(st.floats(0, 1e6)),
            borrow_paused=draw(st.booleans()),
        )
        for t in range(n_teams)
    ]
    queued = [
        JobView(
            id=j,
            team_id=draw(st.integers(1, n_teams)),
            gpus=draw(st.sampled_from([1, 2, 3, 4, 8, 16])),
            priority=draw(st.integers(0, 3)),
            # Some have waited many times their length (aging, starvation claims).
            submitted_at=T0 + timedelta(seconds=draw(st.integers(-40_000, 1000))),
            runtime_estimate_s=draw(st.one_of(st.none(), st.integers(1, 5000))),
        )
        for j in range(1, draw(st.integers(0, 25)) + 1)
    ]
    # Claims: some stopping jobs were preempted for a queued job, which claims their nodes
    # (and sometimes nodes whose victims have already gone).
    if queued:
        claims: dict[int, list[int]] = {}
        for i, run in enumerate(running):
            if run.stopping and draw(st.booleans()):
                claimant = draw(st.sampled_from(queued)).id
                running[i] = replace(run, claimant_id=claimant)
                claims.setdefault(claimant, []).extend(node_id for node_id, _ in run.slots)
        for i, job in enumerate(queued):
            gone = draw(st.lists(st.sampled_from([n.id for n in nodes]), max_size=2))
            if job.id in claims or gone:
                queued[i] = replace(
                    job, claim_nodes=tuple(dict.fromkeys(claims.get(job.id, []) + gone))
                )
    return Snapshot(
        now=T0, nodes=tuple(nodes), queued=tuple(queued), teams=tuple(teams), running=tuple(running)
    )


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clusters())
def test_plans_never_break_the_invariants(snap):
    result = plan(snap)
    runs_by_id = {r.id: r for r in snap.running}
    nodes = {n.id: n for n in snap.nodes}
    jobs = {j.id: j for j in snap.queued}
    teams = {t.id: t for t in snap.teams}
    # 1: placements use free GPUs of schedulable nodes, each at most once.
    used_gpus = [(s.node_id, s.index) for p in result.placements for s in p.slots]
    assert len(used_gpus) == len(set(used_gpus))
    for node_id, index in used_gpus:
        assert nodes[node_id].schedulable and index in nodes[node_id].free
    # 2: whole gangs; a gang that fits a node stays on one node.
    largest = max(n.total for n in snap.nodes)
    for p in result.placements:
        assert len(p.slots) == jobs[p.job_id].gpus
        if jobs[p.job_id].gpus <= largest:
            assert len(p.node_ids) == 1
    # Caps: no team ends above quota + borrow limit; quota alone while paused, unless a
    # claimant was placed on the GPUs stopped for it (the pause keeps a team from taking more
    # of others' GPUs, not from using those its victims gave up).
    after = Counter({t.id: t.used for t in snap.teams})
    claimant_placed = Counter()
    for p in result.placements:
        after[p.team_id] += len(p.slots)
        claimant_placed[p.team_id] += bool(jobs[p.job_id].claim_nodes)
    for team_id, gpus in after.items():
        team = teams[team_id]
        if gpus > team.used:  # only teams that were given more GPUs
            assert gpus <= team.quota + team.borrow_limit
            if not claimant_placed[team_id]:
                assert gpus <= team.cap
    # Growing back (rule 8): only when every queued job was placed, only shrunk jobs that
    # are not stopping, within their team's cap, and no more GPUs than are idle.
    if result.grows:
        assert {p.job_id for p in result.placements} == set(jobs)
    idle = sum(len(n.free) for n in snap.nodes if n.schedulable) - len(used_gpus)
    for grow in result.grows:
        run = runs_by_id[grow.job_id]
        assert not run.stopping and len(run.slots) == grow.held < grow.gpus == run.gpus
        after[run.team_id] += grow.gpus - grow.held
        assert after[run.team_id] <= teams[run.team_id].cap
        idle -= grow.gpus - grow.held
        assert idle >= 0
    # 6: reclaim victims come only from teams above their quota, each taken while its team
    # still is (so a team loses less than one victim's GPUs below its quota), and only for a
    # claimant within its own quota.
    runs = {r.id: r for r in snap.running}
    # GPUs already stopping are gone for this purpose: they cannot be lent twice.
    reclaimed = Counter()
    for run in snap.running:
        if run.stopping:
            reclaimed[run.team_id] += run.gpus
    claiming = Counter()
    claimants: set[int] = set()
    for pre in result.preemptions:
        victim = runs[pre.victim_job_id]
        assert not victim.stopping
        if pre.kind == "reclaim":
            claimant = jobs[pre.claimant_job_id]
            assert victim.team_id != claimant.team_id
            # Still above its quota before this victim goes (counting this pass's placements).
            assert after[victim.team_id] - reclaimed[victim.team_id] > teams[victim.team_id].quota
            reclaimed[victim.team_id] += victim.gpus
            if claimant.id not in claimants:
                claimants.add(claimant.id)
                claiming[claimant.team_id] += claimant.gpus
        elif pre.kind == "starvation":
            # Rule 4: no higher priority, the claimant's own team or a team with at least its
            # fair share, and that team stays at or above its quota.
            claimant = jobs[pre.claimant_job_id]
            assert victim.priority <= claimant.priority
            assert victim.team_id == claimant.team_id or fair_share(
                teams[victim.team_id]
            ) >= fair_share(teams[claimant.team_id])
            reclaimed[victim.team_id] += victim.gpus
            assert after[victim.team_id] - reclaimed[victim.team_id] >= teams[victim.team_id].quota
        else:
            assert victim.priority < jobs[pre.claimant_job_id].priority
    # Claimants are within their quota, counting the team's other claims of the pass (and
    # at least the GPUs it held before the pass).
    for team_id, team in teams.items():
        if claiming[team_id]:
            assert team.used + claiming[team_id] <= team.quota
    # Every job left queued has a reason, as data whose text is the reason.
    placed = {p.job_id for p in result.placements}
    assert set(result.reasons) == set(jobs) - placed
    assert {job_id: wait.text() for job_id, wait in result.waits.items()} == result.reasons
    for wait in result.waits.values():  # stored as JSON, it reads back the same sentence
        again = WaitReason.from_json(json.loads(json.dumps(wait.to_json())))
        assert again.text() == wait.text()
