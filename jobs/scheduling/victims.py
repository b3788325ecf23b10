"""Scheduling rules 4-5, whom to stop for a blocked job: reclaims of lent GPUs, priority
preemptions and starvation claims, each choosing the cheapest victims (lowest priority, then
past their minimum run, then least work lost since their last checkpoint), node by node, within
the limits of jobs.scheduling.protection."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from jobs.scheduling.order import fair_share
from jobs.scheduling.placement import place, release
from jobs.scheduling.protection import (
    at_safety_stop,
    is_protected,
    pays,
    reclaim_exempt,
    work_at_risk_s,
)
from jobs.scheduling.snapshot import JobView, NodeView, RunningView, TeamView
from jobs.scheduling.vocab import PreemptionKind

MayTake = Callable[[RunningView, list[RunningView]], bool]


def victim_order(now, floor_s: float):
    """Lowest priority first; then victims past their minimum run before protected ones (only
    reclaims take those); then those stopped least often lately (a reclaim spreads its stops
    instead of taking the same borrower each time it restarts); then least work at risk; then
    the most recently started."""

    def key(run: RunningView):
        fresh = is_protected(run, now, floor_s)
        return (
            run.priority,
            fresh,
            run.preemptions,
            work_at_risk_s(run, now),
            -run.started_at.timestamp(),
        )

    return key


def _cost(victims: list[RunningView], order) -> tuple:
    """Worst priority stopped, then victims that just (re)started, then their recent stops,
    then GPU-seconds of work thrown away, then how many jobs stop."""
    keys = [order(v) for v in victims]
    return (
        max((k[0] for k in keys), default=-(1 << 30)),
        sum(k[1] for k in keys),
        sum(k[2] for k in keys),
        sum(k[3] * v.gpus for k, v in zip(keys, victims, strict=True)),
        len(victims),
    )


def _on_nodes(
    candidates: list[RunningView], nodes_of: Callable[[RunningView], tuple[int, ...]]
) -> dict[int, list[RunningView]]:
    by_node: dict[int, list[RunningView]] = defaultdict(list)
    for victim in candidates:
        for node_id in nodes_of(victim):
            by_node[node_id].append(victim)
    return by_node


class Chosen(list):
    """Victims chosen so far in one search, with the GPUs they take from each team: the
    may-take rules ask that after every candidate, and summing the list each time made a
    search quadratic in its length."""

    def __init__(self, victims=()) -> None:
        super().__init__()
        self._team_gpus: dict[int, int] = defaultdict(int)
        for victim in victims:
            self.append(victim)

    def append(self, victim: RunningView) -> None:
        super().append(victim)
        self._team_gpus[victim.team_id] += victim.gpus

    def truncate(self, length: int) -> None:
        """Back to its first `length` victims."""
        while len(self) > length:
            victim = self.pop()
            self._team_gpus[victim.team_id] -= victim.gpus


def team_gpus(chosen: list[RunningView], team_id: int) -> int:
    """GPUs of `team_id` among the chosen victims."""
    if isinstance(chosen, Chosen):
        return chosen._team_gpus.get(team_id, 0)
    return sum(v.gpus for v in chosen if v.team_id == team_id)


class _Fits:
    """Whether `place(job, trial, nodes)` would find room, kept as victims are released into
    `trial` (a release only adds free GPUs), so that a search calls place() only when it will
    succeed: place() looks at every node, and a search of a 10,000-job pass released victims
    one by one across 512 nodes (placement.place's own two rules, mirrored)."""

    def __init__(self, gpus: int, trial: dict[int, list[int]], nodes: list[NodeView]) -> None:
        self.gpus = gpus
        self.trial = trial
        self.total = {n.id: n.total for n in nodes}
        self.one_node = gpus <= max(self.total.values(), default=0)
        self.idle = {i for i, t in self.total.items() if t > 0 and len(trial[i]) == t}
        self.idle_gpus = sum(self.total[i] for i in self.idle)
        self.ok = (
            any(len(trial[i]) >= gpus for i in self.total)
            if self.one_node
            else self.idle_gpus >= gpus
        )

    def released(self, node_ids: tuple[int, ...]) -> bool:
        if not self.ok:
            for node_id in node_ids:
                total = self.total.get(node_id)
                if total is None:
                    continue
                have = len(self.trial[node_id])
                if self.one_node:
                    self.ok = self.ok or have >= self.gpus
                elif have == total and node_id not in self.idle:
                    self.idle.add(node_id)
                    self.idle_gpus += total
                    self.ok = self.idle_gpus >= self.gpus
        return self.ok


@dataclass
class Victims:
    """The victim searches of one scheduling pass. The dicts and sets are the pass's own, so
    each search sees what the pass has decided so far."""

    teams: dict[int, TeamView]
    used: dict[int, int]  # team id -> GPUs it holds, with this pass's placements
    free: dict[int, list[int]]  # node id -> free GPU indices, with this pass's placements
    running: list[RunningView]  # not stopping yet; kept in victim order
    taken: set[int]  # running jobs chosen as victims this pass
    # team id -> its lent GPUs reclaimed this pass (or stopping): several claims of one pass
    # never reach a team's guarantee.
    lent: dict[int, int]
    now: datetime
    exempt_s: float  # Snapshot.preempt_exempt_s: the least protection of a started job
    max_preemptions: int = 0  # Snapshot.max_preemptions: the safety stop (0: none)
    gang_exempt_s: float = 0.0  # Snapshot.gang_reclaim_exempt_s (protection rule 5)
    largest: int = 0  # GPUs of the cluster's largest schedulable node: beyond it, a gang

    def __post_init__(self) -> None:
        # Each running job's place in victim order, worked out once per pass: every search
        # prices its candidate victims with it (_cost), node by node.
        order, keys = victim_order(self.now, self.exempt_s), {}

        def cached(run: RunningView) -> tuple:
            key = keys.get(run.id)
            if key is None:
                key = keys[run.id] = order(run)
            return key

        self.order = cached
        # Sorted once per pass: every claim filters this list instead of sorting the running
        # jobs again (135 claims of one 10,000-job pass spent 0.25 s in the sort keys). Jobs
        # at the safety stop are no one's victims.
        self.running = sorted(
            (r for r in self.running if not at_safety_stop(r, self.max_preemptions)),
            key=self.order,
        )
        # Per pass as well: the nodes each running job is on, and protection rule 5, which
        # every claim asked again of every running job.
        self._nodes: dict[int, tuple[int, ...]] = {}
        self._indices: dict[int, dict[int, tuple[int, ...]]] = {}
        self._exempt: dict[int, bool] = {}

    def nodes_of(self, run: RunningView) -> tuple[int, ...]:
        """The nodes the running job is on, in slot order (once per job and pass)."""
        found = self._nodes.get(run.id)
        if found is None:
            found = self._nodes[run.id] = tuple(dict.fromkeys(n for n, _ in run.slots))
        return found

    def protected(self, run: RunningView) -> bool:
        return self.order(run)[1]  # victim_order's second field: is_protected, cached

    def on_node(self, run: RunningView, node_id: int) -> tuple[int, ...]:
        """The GPU indices the running job holds on one node (worked out once per pass)."""
        by_node = self._indices.get(run.id)
        if by_node is None:
            by_node = defaultdict(list)
            for slot_node, index in run.slots:
                by_node[slot_node].append(index)
            by_node = self._indices[run.id] = {n: tuple(i) for n, i in by_node.items()}
        return by_node.get(node_id, ())

    def find(
        self,
        job: JobView,
        candidates: list[RunningView],
        nodes: list[NodeView],
        may_take: MayTake,
        enough: Callable[[list[RunningView]], bool] | None = None,
    ) -> tuple[list[RunningView], list] | None:
        """Victims (candidates are in victim order) whose GPUs make `job` fit on `nodes`, and
        the placement; None if even all of them would not. `may_take(victim, chosen)` says
        whether one more may go given those already chosen. `enough(chosen)`, where given, must
        also hold (a team making room under its own cap: any of its GPUs count, wherever they
        are).

        Node by node, not in one global order: a job of one node needs its victims on one
        node, and the cheapest node to clear is rarely where the globally cheapest victims are
        (taking those first would stop jobs all over the cluster, or run out of lendable GPUs
        before any node is clear). Whole-node jobs clear the cheapest nodes first."""
        if enough is None:
            largest = max((n.total for n in nodes), default=0)
            found = (
                self._one_node(job, candidates, nodes, may_take)
                if job.gpus <= largest
                else self._whole_nodes(job, candidates, nodes, may_take)
            )
            if found is not None:
                return found
        trial = {n: list(v) for n, v in self.free.items()}
        fits = _Fits(job.gpus, trial, nodes)
        chosen = Chosen()
        for victim in candidates:
            if not may_take(victim, chosen):
                continue
            chosen.append(victim)
            release(trial, victim)
            if not fits.released(self.nodes_of(victim)):
                continue  # place() would find no room yet
            choice = place(job, trial, nodes)
            if choice is not None and (enough is None or enough(chosen)):
                return chosen, choice
        return None

    def _one_node(self, job, candidates, nodes, may_take):
        """The node where the cheapest in-order prefix of its victims makes room."""
        free = self.free
        by_node = _on_nodes(candidates, self.nodes_of)
        best = None
        for node in nodes:
            if node.total < job.gpus or node.id not in by_node:
                continue
            have = set(free[node.id])
            chosen = Chosen()
            for victim in by_node[node.id]:
                if len(have) >= job.gpus:
                    break
                if not may_take(victim, chosen):
                    continue
                chosen.append(victim)
                have.update(self.on_node(victim, node.id))
            if len(have) < job.gpus or not chosen:
                continue
            key = (_cost(chosen, self.order), node.name)
            if best is None or key < best[0]:
                best = (key, chosen, node, sorted(have))
        if best is None:
            return None
        _, chosen, node, have = best
        return chosen, place(job, {node.id: have}, [node])

    def _whole_nodes(self, job, candidates, nodes, may_take):
        """Whole nodes, the cheapest to clear first (idle ones cost nothing); None if the nodes
        that can be cleared do not add up."""
        free = self.free
        by_node = _on_nodes(candidates, self.nodes_of)
        options = []
        for node in nodes:
            if node.total == 0:
                continue
            on = by_node.get(node.id, [])
            cleared = set(free[node.id])
            for victim in on:
                cleared.update(self.on_node(victim, node.id))
            if len(cleared) == node.total:
                options.append(((_cost(on, self.order), node.name), node, on))
        options.sort(key=lambda option: option[0])
        chosen = Chosen()
        chosen_ids: set[int] = set()
        trial = {n: list(v) for n, v in free.items()}
        need = job.gpus
        for _, node, on in options:
            if need <= 0:
                break
            extra = [v for v in on if v.id not in chosen_ids]
            mark = len(chosen)
            for victim in extra:
                if not may_take(victim, chosen):
                    chosen.truncate(mark)  # this node cannot be cleared: none of it taken
                    break
                chosen.append(victim)
            else:
                taken_here = chosen[mark:]
                chosen_ids.update(v.id for v in taken_here)
                for victim in taken_here:
                    release(trial, victim)
                need -= node.total
        if need > 0 or not chosen:
            return None
        choice = place(job, trial, nodes)
        return (chosen, choice) if choice is not None else None

    def _drained_for(self, run: RunningView) -> bool:
        """Protection rule 5: a young gang beyond its team's quota, which no reclaim takes."""
        exempt = self._exempt.get(run.id)
        if exempt is None:
            owner = self.teams.get(run.team_id)
            quota = owner.quota if owner is not None else 0
            exempt = reclaim_exempt(run, quota, self.largest, self.now, self.gang_exempt_s)
            self._exempt[run.id] = exempt
        return exempt

    def _lend(self, victims: list[RunningView]) -> None:
        for victim in victims:
            self.lent[victim.team_id] = self.lent.get(victim.team_id, 0) + victim.gpus

    def claim(
        self,
        job: JobView,
        team: TeamView,
        nodes: list[NodeView],
        *,
        guaranteed: bool,
        allow_priority: bool,
    ) -> tuple[list[RunningView], list, PreemptionKind] | None:
        """Victims for a blocked job on `nodes`: a reclaim if it is within its team's quota
        (`guaranteed`), else (where `allow_priority`) a priority preemption of strictly
        lower-priority work. (victims, placement, kind) or None. A reclaim counts what it
        takes in `lent`. A priority preemption takes no protected victim, nothing another
        team holds within its quota, and only victims whose stop pays (protection.pays)."""
        lent, used, teams, taken = self.lent, self.used, self.teams, self.taken

        def lendable(victim: RunningView, chosen: list[RunningView]) -> int | None:
            """GPUs the victim's team still holds beyond its quota, None if it may not lose
            this victim at all."""
            owner = teams.get(victim.team_id)
            if owner is None or victim.team_id == team.id:
                return None
            # Its GPUs already stopping or reclaimed, these chosen victims included.
            gone = lent.get(owner.id, 0) + team_gpus(chosen, owner.id)
            return used[owner.id] - gone - owner.quota

        if guaranteed:

            def wholly_borrowed(victim: RunningView, chosen: list[RunningView]) -> bool:
                spare = lendable(victim, chosen)
                return spare is not None and spare >= victim.gpus

            def straddling(victim: RunningView, chosen: list[RunningView]) -> bool:
                # A job that took its team over its quota, only part of it borrowed: a team 2
                # GPUs over with 8-GPU jobs lends nothing that could be taken wholly, and the
                # claimant would wait for a job to end, not for a grace. The claimant is not
                # borrowing (it is within its own quota), so DESIGN's invariant 6 holds; the
                # victim's team may drop below its quota by less than this one job, and its
                # own queued work is then guaranteed again. Only when no wholly borrowed
                # victims do.
                spare = lendable(victim, chosen)
                return spare is not None and spare > 0

            # Only victims with GPUs on the nodes this claim may use: stopping others frees
            # nothing for it (a later claim of a pass sees only nodes no earlier one reserved).
            usable = {n.id for n in nodes}
            candidates = [
                r
                for r in self.running
                if r.id not in taken
                and not usable.isdisjoint(self.nodes_of(r))
                and not self._drained_for(r)
            ]
            found = self.find(job, candidates, nodes, wholly_borrowed) or self.find(
                job, candidates, nodes, straddling
            )
            if found:
                self._lend(found[0])
                return (*found, PreemptionKind.RECLAIM)
        if not allow_priority:
            return None
        # Past their minimum run only. For a claimant that would borrow, of another team only
        # its borrowed work (DESIGN: a team's jobs within its quota are never preempted for
        # another team's borrowing; a victim taken below its quota would come back as a
        # reclaim of the claimant's borrowed GPUs: a loop).
        lower = [
            r
            for r in self.running
            if r.id not in taken and r.priority < job.priority and not self.protected(r)
        ]

        def own_or_borrowed(victim: RunningView, chosen: list[RunningView]) -> bool:
            if guaranteed or victim.team_id == team.id:
                return True
            spare = lendable(victim, chosen)
            return spare is not None and spare >= victim.gpus

        found = self.find(job, lower, nodes, own_or_borrowed)
        if found is None or not pays(job.gpus, found[0], self.now):
            return None
        return (*found, PreemptionKind.PRIORITY)

    def starvation(
        self, job: JobView, team: TeamView, nodes: list[NodeView]
    ) -> tuple[list[RunningView], list] | None:
        """Victims for a starving job (rule 4) on `nodes` and its placement, or None. A victim
        is not taken, has no higher priority than the job, ran past its minimum run (no
        stop-restart chains), is expected to run on after the job would end (else waiting is
        cheaper), and runs on `nodes`. It belongs to the job's team, which stays at or above
        its quota (its own queued work must not become guaranteed and reclaim from others), or
        is borrowed work of a team with at least the job's team's fair share that stays at or
        above its quota (taking from lighter teams would undo fair share). Counts what it
        takes in `lent`, as `claim`."""
        now, lent, used, teams, taken = self.now, self.lent, self.used, self.teams, self.taken
        share = fair_share(team)
        usable = {n.id for n in nodes}
        end = None if job.runtime_estimate_s is None else now.timestamp() + job.runtime_estimate_s

        def candidate(run: RunningView) -> bool:
            return (
                run.id not in taken
                and run.priority <= job.priority
                and not self.protected(run)
                and (end is None or run.expected_end is None or run.expected_end.timestamp() > end)
                and not usable.isdisjoint(self.nodes_of(run))
            )

        def may_take(victim: RunningView, chosen: list[RunningView]) -> bool:
            owner = teams.get(victim.team_id)
            if owner is None or (owner.id != team.id and fair_share(owner) < share):
                return False
            gone = lent.get(owner.id, 0) + team_gpus(chosen, owner.id)
            return used[owner.id] - gone - victim.gpus >= owner.quota

        found = self.find(job, [r for r in self.running if candidate(r)], nodes, may_take)
        if found is None or not pays(job.gpus, found[0], now):
            return None
        self._lend(found[0])
        return found
