"""The scheduling policy: a pure function from a Snapshot to a Plan.

Rules (DESIGN.md section 6):
1. Order: priority class; then guaranteed (the job fits within its team's quota) before
   borrowed; then the team's fair share (GPUs in use plus decayed history, per quota and
   weight); then submit time. Aging: a borrowed job that has waited more than
   max(30 min, 3 x its runtime estimate), or 4 h without one, goes first among the
   guaranteed work of its priority, so borrowed work too gets its turn at a reservation.
2. A team holds at most quota + borrow limit (quota only while its borrowing is paused after a
   reclaim). Idle GPUs are lent this way to teams with queued work.
3. Placement: a job that fits on one node goes on one node (best fit: the fullest node it fits
   on); a larger job takes whole nodes, racks with the most idle nodes first.
4. No starvation: the highest-ordered job that cannot fit reserves the nodes it will need;
   later jobs may use them only if their runtime estimate ends before those nodes free up
   (EASY backfill); elsewhere they start freely. Likewise inside a team: its first job blocked
   by the team's cap holds the team's next freed GPUs, and the team's later jobs start only
   if they end before then.
5. Reclaim: a guaranteed job that cannot fit takes back GPUs lent to other teams: victims on
   borrowed GPUs, lowest priority first, then those that did not just (re)start, then least
   work lost since their last checkpoint.
   Higher-priority jobs blocked by lower-priority ones get priority preemption proposals.
   The victims' GPUs go to their claimant: while they checkpoint it claims nothing more and
   their nodes are held for it; when they exit it is placed there before anyone else.
6. Elastic jobs (min_gpus below gpus) that cannot start at full size, and get no reclaim or
   priority preemption for it, start now on fewer GPUs where that fits: the largest divisor of
   their GPU count not below min_gpus (so the global batch splits evenly over the ranks; the
   trainer keeps it by gradient accumulation and resumes by resharding). A job within its
   team's quota reclaims for its full size instead.
7. Every job left queued gets a reason a person can read.
8. Growing back: when every queued job has been placed and idle GPUs remain, a shrunk elastic
   job that has run `grow_after_s` at its smaller size, and whose full size fits on its own
   GPUs plus idle ones under its team's cap, is checkpointed and stopped; requeued, it starts
   again at full size (rule 3) and resumes resharded. Never while anyone waits: the idle GPUs
   are theirs first, and a grow would delay them by a restart.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field, replace

from jobs.scheduling.snapshot import JobView, NodeView, RunningView, Snapshot, TeamView
from jobs.scheduling.vocab import (
    Grow,
    Placement,
    Plan,
    Preemption,
    PreemptionKind,
    Slot,
    elastic_sizes,
)


def fair_share(team: TeamView) -> float:
    """Lower runs first: GPUs in use plus a day's worth of decayed history, per weighted quota."""
    return (team.used + team.usage_history / 86400.0) / (
        max(team.quota, 1) * max(team.weight, 1e-6)
    )


# Aging (rule 1): borrowed work that has waited this long is ordered as guaranteed work.
AGING_FACTOR = 3.0  # times the job's runtime estimate
AGING_MIN_S = 1800.0
AGING_NO_ESTIMATE_S = 4 * 3600.0


def aged(job: JobView, now) -> bool:
    """Has the job waited since submission longer than max(AGING_MIN_S, AGING_FACTOR x its
    runtime estimate), or AGING_NO_ESTIMATE_S without an estimate?"""
    if now is None:
        return False
    limit = (
        AGING_NO_ESTIMATE_S
        if job.runtime_estimate_s is None
        else max(AGING_MIN_S, AGING_FACTOR * job.runtime_estimate_s)
    )
    return (now - job.submitted_at).total_seconds() > limit


# A stretch's denominator is at least this, so that every job ages at the same stretch
# (AGING_FACTOR): with a smaller floor a stream of newly aged short jobs (stretch up to
# AGING_MIN_S / floor) could keep an aged long job from the front for days.
STRETCH_MIN_ESTIMATE_S = AGING_MIN_S / AGING_FACTOR


def stretch(job: JobView, now) -> float:
    """Time waited over the job's runtime estimate, at least STRETCH_MIN_ESTIMATE_S (an
    estimate-less job counts as AGING_NO_ESTIMATE_S / AGING_FACTOR long): every job ages at
    a stretch of AGING_FACTOR, and an aged job is never passed by one aged after it that
    has waited less for its length."""
    estimate = (
        AGING_NO_ESTIMATE_S / AGING_FACTOR
        if job.runtime_estimate_s is None
        else max(STRETCH_MIN_ESTIMATE_S, job.runtime_estimate_s)
    )
    return (now - job.submitted_at).total_seconds() / estimate


# Starvation guard (rule 4): a job that has waited this many times its length (stretch)
# reserves the nodes that free up first (not the freest), and gets a reservation of its own
# even when another job holds one (conservative backfill for the few that need it, as Slurm
# reserves for every job it tests); at most MAX_STARVING_HOLDS such extra reservations.
# With one reservation on the freest nodes, 16-32-GPU jobs of the heaviest teams waited
# 10-30 times their length (the simulator's starved jobs).
STARVING_STRETCH = 5.0
MAX_STARVING_HOLDS = 4
# A job that has waited this many times its length may also stop running work for its
# GPUs (rule 4, a "starvation" claim): work of its own team beyond the team's quota, or
# borrowed work of a team whose fair share is at least its team's, never below either team's
# quota and never a job that ends before this one would. Only after every guaranteed claim
# of the pass, on what those left. Reservations alone left 8-32-GPU jobs of 10-20 minutes
# of the heaviest borrowers waiting 10-12 times their length on the msft trace at 1,280
# GPUs: the nodes that free first held jobs hours long.
STARVING_CLAIM_STRETCH = 6.0
# Victim searches for starvation claims per pass, the most starved first: each scans the
# running jobs, and a synthetic 10,000-job queue with half of it starving doubled the pass.
MAX_STARVATION_SEARCHES = 8


def job_order_key(job: JobView, teams: dict[int, TeamView] | None = None, now=None):
    """Rule 1's order. With `now`, an aged borrowed job goes first among the guaranteed work
    of its priority: without it a heavy team's borrowed jobs, ordered after everyone's
    guaranteed work that keeps arriving, waited hours for a reservation that never came to
    them. Aged jobs go by stretch, the longest wait for their length first (as Maui's
    expansion factor): oldest first gave the one reservation to long jobs while short ones
    behind it waited 10-40 times their length (most of the simulator's starved jobs)."""
    team = (teams or {}).get(job.team_id)
    if team is None:
        return (-job.priority, 0, 0.0, job.submitted_at, job.id)
    borrowed = int(team.used + job.gpus > team.quota)
    if borrowed and aged(job, now):
        return (-job.priority, 0, -1.0 - stretch(job, now), job.submitted_at, job.id)
    return (-job.priority, borrowed, fair_share(team), job.submitted_at, job.id)


def _single_node(gpus: int, free: dict[int, list[int]], nodes: list[NodeView]):
    """Best fit: the fullest node that still has room, so big holes stay whole."""
    fits = [n for n in nodes if len(free[n.id]) >= gpus]
    if not fits:
        return None
    best = min(fits, key=lambda n: (len(free[n.id]), n.name))
    return [(best, free[best.id][:gpus])]


def _whole_nodes(gpus: int, free: dict[int, list[int]], nodes: list[NodeView]):
    """Whole idle nodes, taken rack by rack (racks with the most idle nodes first)."""
    idle = [n for n in nodes if n.total > 0 and len(free[n.id]) == n.total]
    by_rack: dict[str, list[NodeView]] = defaultdict(list)
    for node in idle:
        by_rack[node.rack].append(node)
    racks = sorted(by_rack.values(), key=lambda ns: (-sum(n.total for n in ns), ns[0].rack))
    chosen, need = [], gpus
    for rack_nodes in racks:
        for node in sorted(rack_nodes, key=lambda n: (-n.total, n.name)):
            if need <= 0:
                break
            take = min(need, node.total)
            chosen.append((node, free[node.id][:take]))
            need -= take
    return chosen if need <= 0 else None


def place(
    job: JobView | RunningView, free: dict[int, list[int]], nodes: list[NodeView], largest=None
):
    """[(node, [gpu indices])] for `job.gpus` GPUs, or None if they do not fit now."""
    if largest is None:
        largest = max((n.total for n in nodes), default=0)
    if job.gpus <= largest:
        return _single_node(job.gpus, free, nodes)
    return _whole_nodes(job.gpus, free, nodes)


def _shrunk(job: JobView, free, usable, largest):
    """(GPU count, placement) of the largest smaller size that fits now, or None."""
    for size in elastic_sizes(job.gpus, job.min_gpus)[1:]:
        choice = place(replace(job, gpus=size), free, usable, largest)
        if choice is not None:
            return size, choice
    return None


def _to_slots(choice) -> tuple[Slot, ...]:
    slots, rank = [], 0
    for group_rank, (node, indices) in enumerate(choice):
        for local_rank, index in enumerate(indices):
            slots.append(Slot(node.id, node.gpu_ids[index], index, rank, local_rank, group_rank))
            rank += 1
    return tuple(slots)


def _victims(
    job: JobView,
    candidates: list[RunningView],
    free: dict[int, list[int]],
    nodes: list[NodeView],
    may_take,
    order,
    enough=None,
) -> tuple[list[RunningView], list] | None:
    """Victims (candidates are in victim `order`) whose GPUs make `job` fit, and the
    placement; None if even all of them would not. `may_take(victim, chosen)` says whether one
    more may go given those already chosen. `enough(chosen)`, where given, must also hold (a
    team making room under its own cap: any of its GPUs count, wherever they are).

    Node by node, not in one global order: a job of one node needs its victims on one node,
    and the cheapest node to clear is rarely where the globally cheapest victims are (taking
    those first would stop jobs all over the cluster, or run out of lendable GPUs before any
    node is clear). Whole-node jobs clear the cheapest nodes first."""
    if enough is None:
        largest = max((n.total for n in nodes), default=0)
        found = (
            _victims_one_node(job, candidates, free, nodes, may_take, order)
            if job.gpus <= largest
            else _victims_whole_nodes(job, candidates, free, nodes, may_take, order)
        )
        if found is not None:
            return found
    trial = {n: list(v) for n, v in free.items()}
    chosen = []
    for victim in candidates:
        if not may_take(victim, chosen):
            continue
        chosen.append(victim)
        _release(trial, victim)
        choice = place(job, trial, nodes)
        if choice is not None and (enough is None or enough(chosen)):
            return chosen, choice
    return None


def _release(free: dict[int, list[int]], run: RunningView) -> None:
    """Count the running job's GPUs as free in `free` (a trial copy), on the nodes it has."""
    for node_id, index in run.slots:
        if node_id in free:
            free[node_id] = sorted({*free[node_id], index})


def _cost(victims: list[RunningView], order) -> tuple:
    """Worst priority stopped, then victims that just (re)started, then GPU-seconds of work
    thrown away, then how many jobs stop."""
    keys = [order(v) for v in victims]
    return (
        max((k[0] for k in keys), default=-(1 << 30)),
        sum(k[1] for k in keys),
        sum(k[2] * v.gpus for k, v in zip(keys, victims, strict=True)),
        len(victims),
    )


def _on_nodes(candidates: list[RunningView]) -> dict[int, list[RunningView]]:
    by_node: dict[int, list[RunningView]] = defaultdict(list)
    for victim in candidates:
        for node_id in dict.fromkeys(node_id for node_id, _ in victim.slots):
            by_node[node_id].append(victim)
    return by_node


def _victims_one_node(job, candidates, free, nodes, may_take, order):
    """The node where the cheapest in-order prefix of its victims makes room."""
    by_node = _on_nodes(candidates)
    best = None
    for node in nodes:
        if node.total < job.gpus or node.id not in by_node:
            continue
        have = set(free[node.id])
        chosen = []
        for victim in by_node[node.id]:
            if len(have) >= job.gpus:
                break
            if not may_take(victim, chosen):
                continue
            chosen.append(victim)
            have.update(index for node_id, index in victim.slots if node_id == node.id)
        if len(have) < job.gpus or not chosen:
            continue
        key = (_cost(chosen, order), node.name)
        if best is None or key < best[0]:
            best = (key, chosen, node, sorted(have))
    if best is None:
        return None
    _, chosen, node, have = best
    return chosen, place(job, {node.id: have}, [node])


def _victims_whole_nodes(job, candidates, free, nodes, may_take, order):
    """Whole nodes, the cheapest to clear first (idle ones cost nothing); None if the nodes
    that can be cleared do not add up."""
    by_node = _on_nodes(candidates)
    options = []
    for node in nodes:
        if node.total == 0:
            continue
        on = by_node.get(node.id, [])
        cleared = set(free[node.id]).union(
            index for victim in on for node_id, index in victim.slots if node_id == node.id
        )
        if len(cleared) == node.total:
            options.append(((_cost(on, order), node.name), node, on))
    options.sort(key=lambda option: option[0])
    chosen: list[RunningView] = []
    trial = {n: list(v) for n, v in free.items()}
    need = job.gpus
    for _, node, on in options:
        if need <= 0:
            break
        extra = [v for v in on if v not in chosen]
        taken_here = []
        for victim in extra:
            if not may_take(victim, chosen + taken_here):
                break
            taken_here.append(victim)
        else:
            chosen.extend(taken_here)
            for victim in taken_here:
                _release(trial, victim)
            need -= node.total
    if need > 0 or not chosen:
        return None
    choice = place(job, trial, nodes)
    return (chosen, choice) if choice is not None else None


def _work_at_risk(run: RunningView, now) -> float:
    """Seconds of work a stop now would throw away: since the last checkpoint, or since this
    attempt started if it resumed from an older one (nothing before the resume is at risk)."""
    since = max(run.last_checkpoint_at or run.started_at, run.started_at)
    return (now - since).total_seconds()


def _victim_order(now, exempt_s: float):
    """Lowest priority first; then victims past their exempt time before those that just
    (re)started; then least work at risk; then the most recently started."""

    def key(run: RunningView):
        fresh = (now - run.started_at).total_seconds() < exempt_s
        return (run.priority, fresh, _work_at_risk(run, now), -run.started_at.timestamp())

    return key


def _fifo_key(job: JobView):
    return (-job.priority, job.submitted_at, job.id)


def _team_holds(snapshot: Snapshot, runs_by_team) -> dict[int, tuple[int, float | None, tuple]]:
    """team id -> (job id, shadow, its FIFO key) for each team whose first job in priority and
    submit order is blocked by the team's cap (and could fit under it). That job holds the
    team's next freed GPUs: the team's later jobs start only if they end before then (EASY
    backfill inside the team), so a stream of small jobs cannot starve a large one. Without
    it, "guaranteed before borrowed" would let any job small enough to fit under the quota
    now go first, forever."""
    by_team: dict[int, list[JobView]] = defaultdict(list)
    for job in snapshot.queued:
        by_team[job.team_id].append(job)
    holds = {}
    for team in snapshot.teams:
        if team.borrow_paused:  # its cap is lowered for a short while; no hold on that basis
            continue
        for job in sorted(by_team.get(team.id, ()), key=_fifo_key):
            if team.used + job.gpus > team.cap and job.gpus <= team.cap:
                shadow = _team_shadow(team, job, team.used, runs_by_team.get(team.id, []))
                holds[team.id] = (job.id, shadow, _fifo_key(job))
                break
    return holds


def _team_shadow(team: TeamView, job: JobView, held: int, runs: list[RunningView]):
    """When enough of the team's running jobs are expected to end for `job` to fit under the
    team's cap (epoch seconds), or None if that is unknown."""
    need = held + job.gpus - team.cap
    freed = 0
    for run in sorted(runs, key=lambda r: r.expected_end.timestamp() if r.expected_end else 1e18):
        if run.expected_end is None:
            return None
        freed += run.gpus
        if freed >= need:
            return run.expected_end.timestamp()
    return None


def plan(snapshot: Snapshot) -> Plan:
    now = snapshot.now
    nodes = [n for n in snapshot.nodes if n.schedulable]
    by_id = {n.id: n for n in nodes}
    free = {n.id: sorted(n.free) for n in nodes}
    names = {n.id: n.name for n in nodes}
    capacity = sum(n.total for n in nodes)
    used = {t.id: t.used for t in snapshot.teams}
    teams = {t.id: t for t in snapshot.teams}
    running = [r for r in snapshot.running if not r.stopping]

    placements: list[Placement] = []
    preemptions: list[Preemption] = []
    reasons: dict[int, str] = {}
    reservation: tuple[int, tuple[int, ...]] | None = None
    reserved: set[int] = set()
    shadow = None  # when the reserved nodes are expected to be free (None: unknown)
    ahead = 0  # queued jobs ordered before this one that are still waiting
    taken: set[int] = set()  # running jobs already chosen as victims this pass
    lent: dict[int, int] = defaultdict(int)  # team id -> its lent GPUs reclaimed this pass
    claiming: dict[int, int] = defaultdict(int)  # team id -> GPUs its reclaims of this pass free
    claim_failed: set[tuple] = set()
    shrunk: dict[int, int] = {}  # elastic job id -> the smaller GPU count it starts on
    largest = max((n.total for n in nodes), default=0)
    # GPUs of jobs already told to stop are as good as gone: a reclaim must not count them
    # again as the owner's lent GPUs (it would take the owner below its quota).
    for run in snapshot.running:
        if run.stopping:
            lent[run.team_id] += run.gpus
    settled = _honour_claims(snapshot, teams, used, free, nodes, largest, claiming, reasons)
    placements.extend(settled.placed)
    nodes = [n for n in nodes if n.id not in settled.held]
    unreserved = nodes  # outside every reservation
    # Outside the first blocked job's reservation: where later claims may look for victims.
    # Guaranteed work outranks a starving borrowed job, so claims may stop jobs on a starving
    # job's reserved nodes; the reclaim bound would otherwise grow with every such reservation.
    claimable = nodes
    # Reservations of starving jobs (STARVING_STRETCH), beside the first blocked job's:
    # (their nodes, when those are expected to drain).
    starving_holds: list[tuple[frozenset[int], float | None]] = []
    usable_cache: dict[tuple, list[NodeView]] = {}
    hold_failed_from: dict[bool, int] = {}  # one node or whole nodes -> smallest job refused
    starving: list[tuple[JobView, TeamView]] = []  # blocked at STARVING_CLAIM_STRETCH or more
    head_nodes: frozenset[int] = frozenset()  # the first blocked job's own reservation
    guaranteed_waiting = False  # a job within its team's quota found no victims this pass
    smallest_failed: dict[tuple, int] = {}

    def usable_for(job: JobView) -> tuple[tuple, list[NodeView]]:
        """The nodes `job` may take now: outside every reservation, or inside one whose
        nodes it leaves before they drain (EASY backfill, per reservation). Jobs that may
        use the same reservations share a key (at most one per reservation plus one, as a
        reservation admits a job exactly when the job ends before the reservation's time)."""
        end = None if job.runtime_estimate_s is None else now.timestamp() + job.runtime_estimate_s

        def before(drained: float | None) -> bool:
            return end is not None and drained is not None and end <= drained

        key = (before(shadow), tuple(before(drained) for _, drained in starving_holds))
        usable = usable_cache.get(key)
        if usable is None:
            blocked = set() if key[0] else set(reserved)
            for (held, _), admitted in zip(starving_holds, key[1], strict=True):
                if not admitted:
                    blocked |= held
            usable = usable_cache[key] = [n for n in nodes if n.id not in blocked]
        return key, usable

    def reservations_changed() -> None:
        nonlocal unreserved, claimable
        claimable = [n for n in nodes if n.id not in reserved]
        held = set(reserved).union(*(nodes_ for nodes_, _ in starving_holds))
        unreserved = [n for n in claimable if n.id not in held]
        usable_cache.clear()
        smallest_failed.clear()
        free_cache.clear()

    # Per team, its running jobs in victim order, built once: the in-team priority search
    # runs for every job blocked by its team's cap (it was 56 % of a pass in the simulator).
    victim_key = _victim_order(now, snapshot.preempt_exempt_s)
    team_runs: dict[int, list[RunningView]] = defaultdict(list)
    # In victim order once per pass: every claim filters this list instead of sorting the
    # running jobs again (135 claims of one 10,000-job pass spent 0.25 s in the sort keys).
    by_victim_order = sorted(running, key=victim_key)
    for run in by_victim_order:
        team_runs[run.team_id].append(run)
    team_all_runs: dict[int, list[RunningView]] = defaultdict(list)
    for run in snapshot.running:
        team_all_runs[run.team_id].append(run)
    team_hold = _team_holds(snapshot, team_all_runs)
    # usable_for's key -> (placements so far, free GPUs on those nodes then): the count holds
    # until the next placement or reservation. (Keyed by id() of the node list it was, a list
    # the pass had dropped when reservations changed and a new one at the same address read
    # the old count.)
    free_cache: dict[tuple, tuple[int, int]] = {}
    version = [0]  # bumped on every placement

    def free_in(usable_key: tuple, usable: list[NodeView]) -> int:
        cached = free_cache.get(usable_key)
        if cached is None or cached[0] != version[0]:
            cached = free_cache[usable_key] = (version[0], sum(len(free[n.id]) for n in usable))
        return cached[1]

    for job in sorted(snapshot.queued, key=lambda j: job_order_key(j, teams, now)):
        if job.id in settled.jobs:
            continue
        team = teams.get(job.team_id)
        if team is None:
            reasons[job.id] = "team not found"
            ahead += 1
            continue
        hold = team_hold.get(team.id)
        if hold is not None and _fifo_key(job) > hold[2]:
            held_by, team_shadow, _ = hold
            if not (
                team_shadow is not None
                and job.runtime_estimate_s is not None
                and now.timestamp() + job.runtime_estimate_s <= team_shadow
            ):
                reasons[job.id] = (
                    f"behind job {held_by} of team {team.name}, which waits for the team's "
                    f"GPUs to free up under its limit ({team.cap} GPUs)"
                    + ("" if team_shadow is None else "; only jobs that end before then may pass")
                )
                ahead += 1
                continue
        if used[team.id] + job.gpus > team.cap:
            # Priority inside a team: its own lower-priority jobs may make room (a proposal).
            own = [
                r
                for r in team_runs.get(team.id, ())
                if r.priority < job.priority and r.id not in taken
            ]
            over = used[team.id] + job.gpus - team.cap
            found = (
                _victims(
                    job,
                    own,
                    free,
                    nodes,
                    lambda victim, chosen: True,
                    victim_key,
                    enough=lambda chosen, over=over: sum(v.gpus for v in chosen) >= over,
                )
                if reservation is None and own
                else None
            )
            if found is not None:
                victims, choice = found
                taken.update(v.id for v in victims)
                reserved.update(node.id for node, _ in choice)
                reservation = (job.id, tuple(sorted(reserved)))
                reservations_changed()
                preemptions.extend(
                    Preemption(
                        v.id,
                        job.id,
                        PreemptionKind.PRIORITY,
                        f"priority over lower-priority work of team {team.name}",
                    )
                    for v in victims
                )
                reasons[job.id] = (
                    "waiting for "
                    + ", ".join(f"job {v.id}" for v in victims)
                    + f" (lower priority, same team) to checkpoint and stop; {job.gpus} GPUs "
                    "reserved"
                )
                ahead += 1
                continue
            paused = " (borrowing paused after a reclaim)" if team.borrow_paused else ""
            reasons[job.id] = (
                f"team {team.name} at its limit: {used[team.id]}/{team.cap} GPUs in use "
                f"(quota {team.quota} + borrow limit {team.borrow_limit}{paused}); "
                f"needs {job.gpus}"
            )
            ahead += 1
            continue
        # An elastic job may still start smaller on what is left (nodes down or cordoned).
        if min(job.min_gpus or job.gpus, job.gpus) > capacity:
            reasons[job.id] = (
                f"needs {job.gpus} GPUs but only {capacity} GPUs are on schedulable nodes"
            )
            ahead += 1
            continue
        # EASY backfill: a job may use reserved nodes only if it is done before they free up.
        usable_key, usable = usable_for(job)
        # Within one pass free GPUs only shrink, so a shape that did not fit will not fit
        # later in the pass either: with 10,000 queued jobs most are answered here at once.
        key = (usable_key, job.gpus <= largest)
        if job.gpus >= smallest_failed.get(key, 1 << 30):
            choice = None
        else:
            choice = place(job, free, usable, largest)
            if choice is None:
                smallest_failed[key] = min(job.gpus, smallest_failed.get(key, 1 << 30))
        if choice is None:
            free_now = free_in(usable_key, usable)
            # Within its team's quota counting the team's other claims of this pass: each such
            # job may reclaim in the same pass (on nodes no earlier claim reserved), so a
            # team's reclaim takes one stop grace, not one grace per queued job. A priority
            # preemption or a plain reservation stays one per pass.
            guaranteed = used[team.id] + claiming[team.id] + job.gpus <= team.quota
            claimed = None
            # A claim that failed fails again for the same team and size later in the pass:
            # victims and lendable GPUs only shrink within a pass.
            attempt_key = (team.id, job.gpus, guaranteed, reservation is None)
            if (reservation is None or guaranteed) and attempt_key not in claim_failed:
                claimed = _claim(
                    job,
                    team,
                    guaranteed,
                    by_victim_order,
                    taken,
                    teams,
                    used,
                    free,
                    claimable,
                    victim_key,
                    lent,
                    allow_priority=reservation is None,
                )
                if claimed is None:
                    claim_failed.add(attempt_key)
            if claimed is None and guaranteed:
                guaranteed_waiting = True
            elastic = _shrunk(job, free, usable, largest) if claimed is None else None
            if elastic is not None:
                size, choice = elastic
                shrunk[job.id] = size
            elif reservation is None or claimed is not None:
                if claimed is not None:
                    victims, choice, kind = claimed
                    taken.update(v.id for v in victims)
                    if kind == PreemptionKind.RECLAIM:
                        claiming[team.id] += job.gpus
                    # The victims keep their GPUs (and count against their teams) until they
                    # exit; the claimant is placed by a later pass.
                    reserved.update(node.id for node, _ in choice)
                    names_of = ", ".join(f"job {v.id}" for v in victims)
                    why = (
                        "reclaiming its team's quota"
                        if kind == PreemptionKind.RECLAIM
                        else f"priority {job.priority} over lower-priority work"
                    )
                    preemptions.extend(
                        Preemption(v.id, job.id, kind, f"{why} for job {job.id}") for v in victims
                    )
                    reasons[job.id] = (
                        f"waiting for {names_of} to checkpoint and stop ({why}); "
                        f"{job.gpus} GPUs reserved"
                    )
                else:
                    reserved.update(
                        _soonest_nodes(job, nodes, free, snapshot.running, taken, largest)[0]
                        if stretch(job, now) >= STARVING_STRETCH
                        else _freest_nodes(job, nodes, free, largest)
                    )
                    head_nodes = frozenset(reserved)
                    held = ", ".join(names[i] for i in sorted(reserved, key=names.get))
                    shape = "on one node" if len(reserved) <= 1 else "on whole nodes"
                    reasons[job.id] = (
                        f"waiting for {job.gpus} GPUs {shape}; {free_now} free now; "
                        f"holds a reservation on {held}"
                        + (f"; {ahead} job(s) ahead" if ahead else "")
                    )
                # The first blocked job keeps the reservation; reclaims after it add nodes.
                reservation = (
                    job.id if reservation is None else reservation[0],
                    tuple(sorted(reserved)),
                )
                shadow = _shadow_time(reserved, running, taken, by_id)
                reservations_changed()
            else:
                shape = job.gpus <= largest
                hold, starts_at = (
                    _soonest_nodes(job, unreserved, free, snapshot.running, taken, largest)
                    if len(starving_holds) < MAX_STARVING_HOLDS
                    and job.gpus < hold_failed_from.get(shape, 1 << 30)
                    and stretch(job, now) >= STARVING_STRETCH
                    else ((), math.inf)
                )
                if not hold or starts_at == math.inf:
                    # Unreserved nodes and free GPUs only shrink within a pass: a larger job
                    # of this shape finds no reservation either (without this, every starving
                    # job of a long queue searched again: 0.13 -> 1.1 s for 10,000 jobs).
                    hold_failed_from[shape] = min(job.gpus, hold_failed_from.get(shape, 1 << 30))
                # Its nodes admit backfill that ends before the job could start there (not
                # before they drain: a long job on the node's other GPUs would let backfill
                # delay it); none if that time is unknown, as a hold would then block them
                # for good.
                if hold and starts_at < math.inf and sum(by_id[n].total for n in hold) >= job.gpus:
                    starving_holds.append((frozenset(hold), starts_at))
                    reservations_changed()
                    held = ", ".join(names[i] for i in sorted(hold, key=names.get))
                    reasons[job.id] = (
                        f"waiting for {job.gpus} GPUs; it has waited "
                        f"{stretch(job, now):.0f} times its length, so it holds a "
                        f"reservation of its own on {held} (beside job {reservation[0]}'s); "
                        f"{ahead} job(s) ahead"
                    )
                else:
                    held_by = (
                        f"reservations held by job {reservation[0]} and others"
                        if starving_holds
                        else f"reservation held by job {reservation[0]}"
                    )
                    reasons[job.id] = (
                        f"waiting for {job.gpus} GPUs; {free_now} free outside the {held_by}; "
                        f"{ahead} job(s) ahead"
                    )
            if elastic is None:
                if claimed is None and stretch(job, now) >= STARVING_CLAIM_STRETCH:
                    starving.append((job, team))
                ahead += 1
                continue
        for node, indices in choice:
            free[node.id] = [i for i in free[node.id] if i not in set(indices)]
        version[0] += 1
        used[team.id] += shrunk.get(job.id, job.gpus)
        placements.append(Placement(job.id, job.team_id, _to_slots(choice)))

    # Rule 4's starvation claims come last: a guaranteed job's reclaim must not find its
    # victims taken or their nodes reserved by a borrower (that ran reclaim clocks past the
    # bound in the simulator).
    searches = 0
    refused: dict[tuple[int, bool], int] = {}  # (team id, head) -> smallest job that found none
    for job, team in starving:
        head = reservation is not None and reservation[0] == job.id
        # Victims and free GPUs only shrink within a pass: a larger job of the team fails too.
        if job.gpus >= refused.get((team.id, head), 1 << 30):
            continue
        if searches == MAX_STARVATION_SEARCHES:
            break
        searches += 1
        claimed = None
        # Outside the head's reservation first; the head itself, failing that, on its own
        # reserved nodes (where it would otherwise wait for them to drain), unless a
        # guaranteed job waits: reclaims may not stop jobs there, so the head would take the
        # victims a reclaim could not (a reclaim clock past its bound).
        own = [n for n in nodes if n.id in head_nodes] if head and not guaranteed_waiting else []
        for claim_nodes in (claimable, own):
            if claimed is None and claim_nodes:
                claimed = _starvation_claim(
                    job,
                    team,
                    by_victim_order,
                    taken,
                    teams,
                    used,
                    free,
                    claim_nodes,
                    victim_key,
                    lent,
                    now,
                    snapshot.preempt_exempt_s,
                )
        if claimed is None:
            refused[(team.id, head)] = job.gpus
            continue
        victims, choice = claimed
        taken.update(v.id for v in victims)
        reserved.update(node.id for node, _ in choice)
        claimable = [n for n in claimable if n.id not in reserved]
        why = f"job {job.id} has waited {stretch(job, now):.0f} times its length"
        preemptions.extend(
            Preemption(v.id, job.id, PreemptionKind.STARVATION, why) for v in victims
        )
        reasons[job.id] = (
            "waiting for " + ", ".join(f"job {v.id}" for v in victims) + " to checkpoint and "
            f"stop (it has waited {stretch(job, now):.0f} times its length); {job.gpus} GPUs "
            "reserved"
        )
    placed = {p.job_id for p in placements}
    everyone_placed = all(job.id in placed for job in snapshot.queued)
    return Plan(
        placements=tuple(placements),
        reasons=reasons,
        reservation=reservation,
        preemptions=tuple(preemptions),
        grows=tuple(_grow_back(snapshot, teams, used, free, nodes, largest))
        if everyone_placed
        else (),
    )


def _grow_back(snapshot, teams, used, free, nodes, largest) -> list[Grow]:
    """Rule 8, after every queued job is placed: shrunk elastic jobs whose full size fits on
    their own GPUs plus the idle ones, highest priority and longest shrunk first. Updates
    `free` and `used` as if each grown job were already placed there."""
    grows = []
    by_order = sorted(snapshot.running, key=lambda r: (-r.priority, r.started_at, r.id))
    for run in by_order:
        held = len(run.slots)
        if run.stopping or held >= run.gpus:
            continue
        if (snapshot.now - run.started_at).total_seconds() < snapshot.grow_after_s:
            continue
        team = teams.get(run.team_id)
        if team is None or used[team.id] - held + run.gpus > team.cap:
            continue
        trial = {node_id: list(indices) for node_id, indices in free.items()}
        _release(trial, run)
        choice = place(run, trial, nodes, largest)  # its full size: run.gpus
        if choice is None:
            continue
        idle = sum(len(free[n.id]) for n in nodes)
        for node, indices in choice:
            trial[node.id] = [i for i in trial[node.id] if i not in set(indices)]
        free.update(trial)
        used[team.id] += run.gpus - held
        grows.append(
            Grow(
                run.id,
                run.gpus,
                held,
                f"it runs on {held}; nothing is queued and {idle} GPUs are idle",
            )
        )
    return grows


def _place_on_claim(job, free, claimed, nodes, largest):
    """Place a claimant on its claimed nodes; a whole-node job also on idle nodes elsewhere
    for what its victims' nodes do not cover (its claim reserved those too)."""
    if job.gpus <= largest:
        return place(job, free, claimed, largest)
    idle = [n for n in claimed if n.total > 0 and len(free[n.id]) == n.total]
    chosen, need = [], job.gpus
    for node in idle:
        if need <= 0:
            break
        take = min(need, node.total)
        chosen.append((node, free[node.id][:take]))
        need -= take
    if need > 0:
        mine = {n.id for n in claimed}
        extra = _whole_nodes(need, free, [n for n in nodes if n.id not in mine])
        if extra is None:
            return None
        chosen.extend(extra)
    return chosen


@dataclass
class _Settled:
    placed: list[Placement] = field(default_factory=list)
    held: set[int] = field(default_factory=set)  # node ids kept for claimants this pass
    jobs: set[int] = field(default_factory=set)  # claimants placed or waiting on their claim


def _honour_claims(snapshot, teams, used, free, nodes, largest, claiming, reasons) -> _Settled:
    """Rule 5 carried through: a claimant gets the GPUs its victims free. Updates `used`,
    `free`, `claiming` and `reasons` in place.

    Before the main pass, in the usual order, each queued job with a claim (`claim_nodes`)
    that fits under its team's cap is placed on its claimed nodes if it fits there now. If it
    does not yet, and some of its victims are still checkpointing, it waits for them: it
    claims nothing more (without this each pass stopped yet another victim for the same job)
    the free GPUs it needs beyond what its victims will free are held from everyone else
    for this pass (for a whole-node job: its claimed nodes and the idle nodes it needs
    beyond them). A claim whose victims are all gone and that still does
    not fit is spent: the job goes through the main pass like any other."""
    out = _Settled()
    pending: dict[int, list[RunningView]] = defaultdict(list)
    for run in snapshot.running:
        if run.stopping and run.claimant_id is not None:
            pending[run.claimant_id].append(run)
    by_id = {n.id: n for n in nodes}
    # Those whose victims are all gone first: the GPUs just freed are theirs, not those of a
    # claimant whose own victims on the same node are still stopping.
    claimants = sorted(
        (j for j in snapshot.queued if j.claim_nodes),
        key=lambda j: (j.id in pending, job_order_key(j, teams, snapshot.now)),
    )
    for job in claimants:
        team = teams.get(job.team_id)
        victims = pending.get(job.id, [])
        # A priority claim inside the team: its victims' GPUs still count against the team
        # until they exit, and then make the room under its cap.
        leaving = sum(v.gpus for v in victims if v.team_id == job.team_id)
        if team is None:
            continue
        # The borrowing pause after a reclaim does not apply: it keeps a team from taking
        # more of others' GPUs, while these are GPUs another job was already stopped for. Its
        # team's later jobs may have filled its quota in the meantime (on the msft trace at
        # 4,096 GPUs and 3.5 times the load, reclaims waited out the pause: 240 s, not 60).
        cap = team.quota + team.borrow_limit
        if used[team.id] - leaving + job.gpus > cap:
            continue
        claimed = [by_id[i] for i in dict.fromkeys(job.claim_nodes) if i in by_id]
        claimed = [n for n in claimed if n.id not in out.held]
        fits_cap = used[team.id] + job.gpus <= cap
        choice = (
            _place_on_claim(job, free, claimed, nodes, largest) if claimed and fits_cap else None
        )
        if choice is not None:
            for node, indices in choice:
                free[node.id] = [i for i in free[node.id] if i not in set(indices)]
            used[team.id] += job.gpus
            out.placed.append(Placement(job.id, job.team_id, _to_slots(choice)))
            out.jobs.add(job.id)
            continue
        if not victims or not claimed:
            continue
        if job.gpus <= largest:
            # One node: the claimed node closest to fitting keeps back only the free GPUs the
            # job needs beyond its victims' there; the rest of the node stays usable.
            stopping = defaultdict(int)
            for victim in victims:
                for node_id, _ in victim.slots:
                    stopping[node_id] += 1
            node = max(claimed, key=lambda n: (len(free[n.id]) + stopping[n.id], n.name))
            keep = max(0, job.gpus - stopping[node.id])
            free[node.id] = free[node.id][keep:]
            hold = {node.id}
        else:  # whole nodes: its victims' and the idle ones it needs beyond them
            hold = {n.id for n in claimed}
            need = job.gpus - sum(n.total for n in claimed)
            if need > 0:
                rest = [n for n in nodes if n.id not in out.held and n.id not in hold]
                hold.update(node.id for node, _ in _whole_nodes(need, free, rest) or ())
            out.held |= hold
        out.jobs.add(job.id)
        if used[team.id] + claiming[team.id] + job.gpus <= team.quota:
            claiming[team.id] += job.gpus
        names = ", ".join(n.name for n in sorted((by_id[i] for i in hold), key=lambda n: n.name))
        reasons[job.id] = (
            "waiting for "
            + ", ".join(f"job {v.id}" for v in sorted(victims, key=lambda v: v.id))
            + f" to checkpoint and stop (preempted for it); {job.gpus} GPUs held on {names}"
        )
    return out


def _claim(
    job, team, guaranteed, running, taken, teams, used, free, nodes, order, lent, allow_priority
):
    """Victims for a blocked job: a reclaim if it is within its team's quota, else (where
    `allow_priority`) a priority preemption of strictly lower-priority work (`running` is in
    victim `order` already). (victims, placement, kind) or None. `lent` (team id -> lent GPUs
    already reclaimed this pass) grows by what a reclaim takes, so several claims of one pass
    never reach a team's guarantee."""
    if guaranteed:

        def lendable(victim: RunningView, chosen: list[RunningView]) -> int | None:
            """GPUs the victim's team still holds beyond its quota, None if it may not lose
            this victim at all."""
            owner = teams.get(victim.team_id)
            if owner is None or victim.team_id == team.id:
                return None
            gone = lent.get(owner.id, 0) + sum(v.gpus for v in chosen if v.team_id == owner.id)
            return used[owner.id] - gone - owner.quota

        def wholly_borrowed(victim: RunningView, chosen: list[RunningView]) -> bool:
            spare = lendable(victim, chosen)
            return spare is not None and spare >= victim.gpus

        def straddling(victim: RunningView, chosen: list[RunningView]) -> bool:
            # A job that took its team over its quota, only part of it borrowed: a team 2 GPUs
            # over with 8-GPU jobs lends nothing that could be taken wholly, and the claimant
            # would wait for a job to end, not for a grace. The claimant is not borrowing (it
            # is within its own quota), so DESIGN's invariant 6 holds; the victim's team may
            # drop below its quota by less than this one job, and its own queued work is then
            # guaranteed again. Only when no wholly borrowed victims do.
            spare = lendable(victim, chosen)
            return spare is not None and spare > 0

        # Only victims with GPUs on the nodes this claim may use: stopping others frees
        # nothing for it (a later claim of a pass sees only nodes no earlier one reserved).
        usable = {n.id for n in nodes}
        candidates = [
            r
            for r in running
            if r.id not in taken and any(node_id in usable for node_id, _ in r.slots)
        ]
        found = _victims(job, candidates, free, nodes, wholly_borrowed, order) or _victims(
            job, candidates, free, nodes, straddling, order
        )
        if found:
            for victim in found[0]:
                lent[victim.team_id] = lent.get(victim.team_id, 0) + victim.gpus
            return (*found, PreemptionKind.RECLAIM)
    if not allow_priority:
        return None
    lower = [r for r in running if r.id not in taken and r.priority < job.priority]
    found = _victims(job, lower, free, nodes, lambda victim, chosen: True, order)
    return (*found, PreemptionKind.PRIORITY) if found else None


def _starvation_claim(
    job, team, running, taken, teams, used, free, nodes, order, lent, now, exempt_s
):
    """Victims for a starving job (rule 4) and its placement, or None. A victim is not
    taken, has no higher priority than the job, ran past its exempt time (no stop-restart
    chains), is expected to run on after the job would end (else waiting is cheaper), and
    runs on `nodes`. It belongs to the job's team, which stays at or above its quota (its own
    queued work must not become guaranteed and reclaim from others), or is borrowed work of
    a team with at least the job's team's fair share that stays at or above its quota
    (taking from lighter teams would undo fair share). `lent` grows as in `_claim`."""
    share = fair_share(team)
    usable = {n.id for n in nodes}
    end = None if job.runtime_estimate_s is None else now.timestamp() + job.runtime_estimate_s

    def candidate(run: RunningView) -> bool:
        return (
            run.id not in taken
            and run.priority <= job.priority
            and (now - run.started_at).total_seconds() >= exempt_s
            and (end is None or run.expected_end is None or run.expected_end.timestamp() > end)
            and any(node_id in usable for node_id, _ in run.slots)
        )

    def may_take(victim: RunningView, chosen: list[RunningView]) -> bool:
        owner = teams.get(victim.team_id)
        if owner is None or (owner.id != team.id and fair_share(owner) < share):
            return False
        gone = lent.get(owner.id, 0) + sum(v.gpus for v in chosen if v.team_id == owner.id)
        return used[owner.id] - gone - victim.gpus >= owner.quota

    found = _victims(job, [r for r in running if candidate(r)], free, nodes, may_take, order)
    if found is None:
        return None
    for victim in found[0]:
        lent[victim.team_id] = lent.get(victim.team_id, 0) + victim.gpus
    return found


def _soonest_nodes(job, nodes, free, running, taken, largest) -> tuple[tuple[int, ...], float]:
    """The nodes where `job` could start soonest from the running jobs' expected ends (a
    job with none never ends; a victim chosen this pass ends first): the one node with
    `job.gpus` GPUs free first, or the whole nodes that drain first (`largest`: the
    cluster's largest node, which decides between the two). Ties (ends unknown): the freest
    nodes first. Also when the job could start there (math.inf if unknown).

    For starving jobs only: the freest nodes held a long job as often as not, and on the
    msft trace at 1,280 GPUs the starved jobs that held the reservation there waited 2.5 h
    each on average for it to drain."""
    on_node: dict[int, list[float]] = defaultdict(list)
    for run in running:
        if run.id in taken:
            end = -math.inf
        else:
            end = run.expected_end.timestamp() if run.expected_end else math.inf
        for node_id, _ in run.slots:
            on_node[node_id].append(end)

    def free_at(node: NodeView, gpus: int) -> tuple[float, int]:
        short = gpus - len(free[node.id])
        ends = sorted(on_node.get(node.id, ()))
        at = -math.inf if short <= 0 else ends[short - 1] if short <= len(ends) else math.inf
        return at, -len(free[node.id])  # unknown ends: the freest first

    def needed(node: NodeView) -> int:  # GPUs the job needs free there: its own, or all
        return job.gpus if job.gpus <= largest else node.total

    chosen = _first_ranked(
        job, sorted(nodes, key=lambda n: (*free_at(n, needed(n)), n.name)), largest
    )
    starts_at = max((free_at(n, needed(n))[0] for n in chosen), default=math.inf)
    return tuple(n.id for n in chosen), starts_at


def _freest_nodes(
    job: JobView, nodes: list[NodeView], free: dict[int, list[int]], largest: int
) -> tuple[int, ...]:
    """The nodes with the most free GPUs: where backfill has the longest window (the
    running jobs left there are often long), so a young reservation costs the least idle
    time; a starving job's reservation goes where GPUs free first (`_soonest_nodes`)."""
    ranked = sorted(nodes, key=lambda n: (-len(free[n.id]), n.name))
    return tuple(n.id for n in _first_ranked(job, ranked, largest))


def _first_ranked(job: JobView, ranked: list[NodeView], largest: int) -> list[NodeView]:
    """The first node of `ranked` big enough for a job that fits one node (`largest`: the
    cluster's largest), else the first nodes of `ranked` that add up to its GPUs (fewer if
    there are not enough)."""
    if job.gpus <= largest:
        return next(([n] for n in ranked if n.total >= job.gpus), [])
    chosen, need = [], job.gpus
    for node in ranked:
        if need <= 0:
            break
        chosen.append(node)
        need -= node.total
    return chosen


def _shadow_time(reserved, running, taken, by_id) -> float | None:
    """When every running job on the reserved nodes is expected to end (None if unknown)."""
    ends = []
    for run in running:
        if run.id in taken or not any(node_id in reserved for node_id, _ in run.slots):
            continue
        if run.expected_end is None:
            return None
        ends.append(run.expected_end.timestamp())
    return max(ends) if ends else None
