"""Scheduling rule 4, no starvation: the nodes blocked jobs hold and which later jobs each
admits (EASY backfill per reservation), starving jobs' reservations of their own, and each
team's first job blocked by its cap holding the team's next freed GPUs."""

from __future__ import annotations

import math
from collections import defaultdict

from jobs.scheduling.isolation import allowed
from jobs.scheduling.order import fifo_key, stretch
from jobs.scheduling.placement import place
from jobs.scheduling.protection import at_safety_stop, is_protected
from jobs.scheduling.snapshot import JobView, NodeView, RunningView, Snapshot, TeamView

# A job that has waited this many times its length (stretch) reserves the nodes that free up
# first (not the freest), and gets a reservation of its own even when another job holds one
# (conservative backfill for the few that need it, as Slurm reserves for every job it tests);
# at most MAX_STARVING_HOLDS such extra reservations. With one reservation on the freest
# nodes, 16-32-GPU jobs of the heaviest teams waited 10-30 times their length (the
# simulator's starved jobs).
STARVING_STRETCH = 5.0
MAX_STARVING_HOLDS = 4

_NEVER = 1 << 30  # no job this size was refused yet


class Reservations:
    """The reservations of one scheduling pass and the nodes each queued job may use.

    `free` and `taken` are the pass's own (free GPUs, victims chosen), updated as it decides.
    Within a pass free GPUs only shrink and reservations only grow, which the caches rely on.
    """

    def __init__(
        self,
        snapshot: Snapshot,
        nodes: list[NodeView],
        free: dict[int, list[int]],
        taken: set[int],
        largest: int,
    ):
        self.now = snapshot.now
        self.nodes = nodes  # schedulable, not held for a claimant
        self._by_id = {n.id: n for n in nodes}
        self.free = free
        self.taken = taken
        self.all_running = snapshot.running
        self.running = [r for r in snapshot.running if not r.stopping]
        self.largest = largest  # GPUs of the cluster's largest schedulable node
        self.floor_s = snapshot.preempt_exempt_s
        # Fillers (started past a reservation's time, rule 4) at their safety stop may not be
        # taken: they count as the jobs they are.
        self._fillers = [
            run
            for run in self.running
            if run.filler and not at_safety_stop(run, snapshot.max_preemptions)
        ]
        self._teams = {t.id: t for t in snapshot.teams}
        # node id -> the fillers there the first blocked job may take (`reserve_head`): its
        # reservation counts their GPUs as its own, taken back once the rest has drained.
        self.fillers: dict[int, list[RunningView]] = defaultdict(list)
        self.takable: set[int] = set()
        self._fill_refused: dict[tuple, int] = {}  # (usable_for's key, one node) -> GPUs
        # The first blocked job's reservation, with the nodes later claims of the pass add:
        # (job id, node ids) (Plan.reservation).
        self.holder: tuple[int, tuple[int, ...]] | None = None
        self.reserved: set[int] = set()
        self.head_nodes: frozenset[int] = frozenset()  # the first blocked job's own nodes
        self.shadow: float | None = None  # when the reserved nodes are expected to be free
        self.head_shadow: float | None = None  # the same for the first blocked job's own nodes
        self.head_drain: float | None = None  # the same without the fillers it may take
        # Reservations of starving jobs (STARVING_STRETCH), beside the first blocked job's:
        # (their nodes, when those are expected to drain).
        self.starving: list[tuple[frozenset[int], float | None]] = []
        self.unreserved = nodes  # outside every reservation
        # Outside the first blocked job's reservation: where later claims may look for
        # victims. Guaranteed work outranks a starving borrowed job, so claims may stop jobs on
        # a starving job's reserved nodes; the reclaim bound would otherwise grow with every
        # such reservation.
        self.claimable = nodes
        self._usable: dict[tuple, list[NodeView]] = {}  # usable_for's key -> its nodes
        self._free_counts: dict[tuple, int] = {}  # the same key -> free GPUs there
        self._unfit: dict[tuple, int] = {}  # (key, one node) -> smallest job that did not fit
        # (one node, isolated only) -> the smallest starving job refused a hold
        self._hold_refused: dict[tuple[bool, bool], int] = {}

    def usable_for(
        self, job: JobView, team: TeamView | None = None
    ) -> tuple[tuple, list[NodeView]]:
        """The nodes `job` may take now: outside every reservation, or inside one whose nodes
        it leaves before they drain (EASY backfill, per reservation); isolated nodes only for
        an isolated-only team's job (rule 9). Jobs that may use the same reservations share a
        key (at most one per reservation plus one, as a reservation admits a job exactly when
        the job ends before the reservation's time)."""
        end = (
            None
            if job.runtime_estimate_s is None
            else self.now.timestamp() + job.runtime_estimate_s
        )

        def before(drained: float | None) -> bool:
            return end is not None and drained is not None and end <= drained

        key = (
            before(self.shadow),
            tuple(before(drained) for _, drained in self.starving),
            bool(team and team.isolated_only),
        )
        usable = self._usable.get(key)
        if usable is None:
            blocked = set() if key[0] else set(self.reserved)
            for (held, _), admitted in zip(self.starving, key[1], strict=True):
                if not admitted:
                    blocked |= held
            usable = self._usable[key] = [
                n for n in allowed(team, self.nodes) if n.id not in blocked
            ]
        return key, usable

    def place(self, job: JobView, key: tuple, usable: list[NodeView]):
        """`job`'s placement on its usable nodes (`usable_for`), or None. A shape that did not
        fit will not fit later in the pass either: with 10,000 queued jobs most are answered
        here at once."""
        shape = (key, job.gpus <= self.largest)
        if job.gpus >= self._unfit.get(shape, _NEVER):
            return None
        choice = place(job, self.free, usable, self.largest)
        if choice is None:
            self._unfit[shape] = min(job.gpus, self._unfit.get(shape, _NEVER))
        return choice

    def free_in(self, key: tuple, usable: list[NodeView]) -> int:
        """Free GPUs on a job's usable nodes, counted once per key between placements."""
        count = self._free_counts.get(key)
        if count is None:
            count = self._free_counts[key] = sum(len(self.free[n.id]) for n in usable)
        return count

    def placed(self) -> None:
        """A job was placed: free counts change."""
        self._free_counts.clear()

    def reserve(self, job_id: int, node_ids, *, drains: bool = True) -> None:
        """Reserve nodes for a blocked job: the first keeps the reservation, claims after it
        add nodes. `drains`: recompute when the reserved nodes free up from their running
        jobs' ends (an in-team priority claim leaves it unknown, as before any reservation:
        no backfill on its nodes)."""
        self.reserved.update(node_ids)
        self.holder = (
            job_id if self.holder is None else self.holder[0],
            tuple(sorted(self.reserved)),
        )
        if drains:
            self.shadow = _shadow_time(self.reserved, self.running, self.taken, self.takable)
        self._changed()

    def fill(self, job: JobView, team: TeamView | None, key: tuple, usable: list[NodeView]):
        """A place for `job` as a filler (rule 4): on the first blocked job's draining nodes
        as well as its usable ones, although it runs past their time. Only while those nodes
        are expected to drain (of all but fillers) at least the least minimum run
        (`floor_s`, PreemptExemptTime) from now: the holder stops it checkpoint-first once
        they have, or once its own minimum run is over if that ends later; the head then
        waits at most that minimum run less `floor_s`. Not for a job already stopped as a
        filler within the safety window (a job is a filler at most once a day). Returns
        (placement, filler) or None.

        Until 2026-12-06 a filler had to end its whole minimum run before the drain, which
        the head never waited for; drains of 10-32 minutes then idled with nothing to fill
        them (bench/utilization_gap.py: utilization +0.44 points, mean JCT -4 %, reclaims
        over the bound -18 % on 1,200-job traces with this rule; docs/thrash.md)."""
        if self.head_drain is None or job.filled or not self.head_nodes:
            return None
        if self.head_drain - self.now.timestamp() < self.floor_s:
            return None
        shape = (key, job.gpus <= self.largest)  # `usable` is the same for one key
        if job.gpus >= self._fill_refused.get(shape, _NEVER):
            return None
        seen = {n.id for n in usable}
        nodes = usable + [
            n for n in allowed(team, self.nodes) if n.id in self.head_nodes and n.id not in seen
        ]
        choice = place(job, self.free, nodes, self.largest)
        if choice is None:
            self._fill_refused[shape] = min(job.gpus, self._fill_refused.get(shape, _NEVER))
            return None
        return choice, any(node.id in self.head_nodes for node, _ in choice)

    def fillers_to_stop(self, job: JobView) -> list[RunningView] | None:
        """The fillers on the first blocked job's nodes that stand between it and a start now
        (everything else there has drained), or None while anything else is in the way or a
        filler is still within its minimum run."""
        nodes = [self._by_id[i] for i in sorted(self.head_nodes) if i in self._by_id]
        chosen: dict[int, RunningView] = {}
        for node in nodes:
            runs = [r for r in self.fillers.get(node.id, ()) if r.id not in self.taken]
            need = (job.gpus if job.gpus <= self.largest else node.total) - len(self.free[node.id])
            if need <= 0:
                continue
            if sum(_gpus_on(r, node.id) for r in runs) < need:
                return None
            for run in sorted(runs, key=lambda r: -_gpus_on(r, node.id)):
                if need <= 0:
                    break
                chosen[run.id] = run
                need -= _gpus_on(run, node.id)
        if not chosen or any(is_protected(run, self.now, self.floor_s) for run in chosen.values()):
            return None
        return list(chosen.values())

    def reserve_head(
        self, job: JobView, team: TeamView | None = None, *, borrowing: bool = False
    ) -> None:
        """The first blocked job's reservation: where its GPUs free first if it is starving,
        else the freest nodes (isolated ones only for an isolated-only team's job).
        `borrowing`: the job is beyond its team's quota; it then takes no filler of another
        team within that team's quota (invariant 6)."""
        for run in self._fillers:
            team_of = self._teams.get(run.team_id)
            if team_of is not None and may_take(
                job.team_id, borrowing, run.team_id, team_of.used - run.gpus, team_of.quota
            ):
                self.takable.add(run.id)
                for node_id in dict.fromkeys(n for n, _ in run.slots):
                    self.fillers[node_id].append(run)
        nodes = allowed(team, self.nodes)
        self.reserved.update(
            _soonest_nodes(
                job, nodes, self.free, self.all_running, self.taken, self.largest, self.takable
            )[0]
            if stretch(job, self.now) >= STARVING_STRETCH
            else _freest_nodes(job, nodes, self.free, self.largest, self.fillers)
        )
        self.head_nodes = frozenset(self.reserved)
        self.reserve(job.id, ())
        self.head_shadow = self.shadow  # later claims of the pass add nodes, not to this
        # When the head's nodes drain of everything but the fillers it may take: fillers are
        # admitted against this time, not head_shadow, which a filler's minimum run moves
        # (against the moving time each new filler would admit the next, without end).
        self.head_drain = _shadow_time(
            self.head_nodes,
            [run for run in self.running if run.id not in self.takable],
            self.taken,
            set(),
        )

    def hold_for_starving(
        self, job: JobView, team: TeamView | None = None
    ) -> frozenset[int] | None:
        """A reservation of its own for a starving job behind the first blocked one, where its
        GPUs free first outside every reservation; None if it gets none. Its nodes admit
        backfill that ends before the job could start there (not before they drain: a long
        job on the node's other GPUs would let backfill delay it); none if that time is
        unknown, as a hold would then block them for good."""
        shape = (job.gpus <= self.largest, bool(team and team.isolated_only))
        nodes = allowed(team, self.unreserved)
        hold, starts_at = (
            # Only the head stops fillers: here they run to their ends.
            _soonest_nodes(job, nodes, self.free, self.all_running, self.taken, self.largest, set())
            if len(self.starving) < MAX_STARVING_HOLDS
            and job.gpus < self._hold_refused.get(shape, _NEVER)
            and stretch(job, self.now) >= STARVING_STRETCH
            else ((), math.inf)
        )
        if not hold or starts_at == math.inf:
            # Unreserved nodes and free GPUs only shrink within a pass: a larger job of this
            # shape finds no reservation either (without this, every starving job of a long
            # queue searched again: 0.13 -> 1.1 s for 10,000 jobs).
            self._hold_refused[shape] = min(job.gpus, self._hold_refused.get(shape, _NEVER))
        if hold and starts_at < math.inf and sum(self._by_id[n].total for n in hold) >= job.gpus:
            self.starving.append((frozenset(hold), starts_at))
            self._changed()
            return frozenset(hold)
        return None

    def claimed(self, node_ids) -> None:
        """Nodes a starvation claim took, after every placement of the pass: later claims
        look elsewhere."""
        self.reserved.update(node_ids)
        self.claimable = [n for n in self.claimable if n.id not in self.reserved]

    def _changed(self) -> None:
        self.claimable = [n for n in self.nodes if n.id not in self.reserved]
        held = set(self.reserved).union(*(nodes for nodes, _ in self.starving))
        self.unreserved = [n for n in self.claimable if n.id not in held]
        self._usable.clear()
        self._free_counts.clear()
        self._unfit.clear()


def may_take(head_team: int, borrowing: bool, team: int, used_without: int, quota: int) -> bool:
    """Whether the first blocked job (of `head_team`, `borrowing` beyond its quota) may stop a
    filler of `team` when its nodes drain, `used_without`: that team's GPUs without the filler.
    Yes if the filler is of its own team, or the head is within its team's quota, or the filler
    runs wholly on borrowed GPUs (its team holds its quota without it): a team's guaranteed
    GPUs never serve another team's borrowing (invariant 6). The policy asks the same before
    it admits a filler (`SchedulingPass._may_fill`)."""
    return team == head_team or not borrowing or used_without >= quota


def team_holds(snapshot: Snapshot) -> dict[int, tuple[int, float | None, tuple]]:
    """team id -> (job id, shadow, its FIFO key) for each team whose first job in priority and
    submit order is blocked by the team's cap (and could fit under it). That job holds the
    team's next freed GPUs: the team's later jobs start only if they end before then (EASY
    backfill inside the team), so a stream of small jobs cannot starve a large one. Without
    it, "guaranteed before borrowed" would let any job small enough to fit under the quota
    now go first, forever."""
    by_team: dict[int, list[JobView]] = defaultdict(list)
    for job in snapshot.queued:
        by_team[job.team_id].append(job)
    runs_by_team: dict[int, list[RunningView]] = defaultdict(list)
    for run in snapshot.running:
        runs_by_team[run.team_id].append(run)
    holds = {}
    for team in snapshot.teams:
        if team.borrow_paused:  # its cap is lowered for a short while; no hold on that basis
            continue
        for job in sorted(by_team.get(team.id, ()), key=fifo_key):
            if team.used + job.gpus > team.cap and job.gpus <= team.cap:
                shadow = _team_shadow(team, job, team.used, runs_by_team.get(team.id, []))
                holds[team.id] = (job.id, shadow, fifo_key(job))
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


def _soonest_nodes(
    job, nodes, free, running, taken, largest, takable
) -> tuple[tuple[int, ...], float]:
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
            end = _end(run, takable)
            end = math.inf if end is None else end
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
    job: JobView, nodes: list[NodeView], free: dict[int, list[int]], largest: int, fillers
) -> tuple[int, ...]:
    """The nodes with the most free GPUs: where backfill has the longest window (the
    running jobs left there are often long), so a young reservation costs the least idle
    time; a starving job's reservation goes where GPUs free first (`_soonest_nodes`)."""

    def freeable(node: NodeView) -> int:  # a filler's GPUs are the reservation's to take
        return len(free[node.id]) + sum(_gpus_on(r, node.id) for r in fillers.get(node.id, ()))

    ranked = sorted(nodes, key=lambda n: (-freeable(n), n.name))
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


def _shadow_time(reserved, running, taken, takable) -> float | None:
    """When every running job on the reserved nodes is expected to end (None if unknown)."""
    ends = []
    for run in running:
        if run.id in taken or not any(node_id in reserved for node_id, _ in run.slots):
            continue
        end = _end(run, takable)
        if end is None:
            return None
        ends.append(end)
    return max(ends) if ends else None


def _end(run: RunningView, takable: set[int]) -> float | None:
    """When `run` leaves its GPUs for a reservation: its expected end, or for a filler a
    reservation may take (`takable`) the end of its minimum run (the holder stops it then)."""
    if run.id in takable:
        return (run.protected_until or run.started_at).timestamp()
    return run.expected_end.timestamp() if run.expected_end else None


def _gpus_on(run: RunningView, node_id: int) -> int:
    return sum(1 for n, _ in run.slots if n == node_id)
