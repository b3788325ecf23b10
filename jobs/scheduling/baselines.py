"""Baseline planners for the simulator, with the policy's signature `plan(snapshot) -> Plan`.

`fifo`: strict FIFO by submit time with gang placement; the head of the queue blocks everyone.
`backfill`: FIFO with EASY backfill, as in Slurm: the blocked head gets a reservation at the
earliest time enough GPUs free (from running jobs' `expected_end`); a later job may start now
only if it fits now and either ends before that time or stays off the nodes the head reserved.

Both are pure, priority-blind and quota-free on purpose: they show what the policy's ordering,
quotas and preemption buy. Placement is the policy's rule: a job that fits on one node goes on
one node (best fit: the fullest node it fits on); a larger job takes whole idle nodes.
"""

from __future__ import annotations

import math
from collections import defaultdict
from operator import attrgetter

from jobs.scheduling.snapshot import JobView, NodeView, Snapshot
from jobs.scheduling.vocab import Placement, Plan, Slot

fifo_key = attrgetter("submitted_at", "id")  # C-level: the queue is sorted at every event
_ids = attrgetter("id")


class _Free:
    """Free GPUs per node for one pass, bucketed by free count so best fit is O(GPUs per node).

    Built with a few comprehensions over the nodes (the planner runs at every event, mostly to
    place one job); a bucket is sorted by node name and a node's free list is sorted only when
    a job looks at it.
    """

    def __init__(self, nodes: list[NodeView]):
        self.nodes = nodes
        self.counts = [len(n.free) for n in nodes]
        self.totals = [len(n.gpu_ids) for n in nodes]
        self.lists: dict[int, list[int]] = {}  # node index -> sorted free GPU indices
        self.buckets: dict[int, list[int]] = defaultdict(list)  # free count -> node indices
        for i, k in enumerate(self.counts):
            self.buckets[k].append(i)
        self.sorted_buckets: set[int] = set()
        self._idle: set[int] | None = None  # indices of nodes with every GPU free, when needed
        self.idle_gpus = 0
        self.total_free = sum(self.counts)
        self.capacity = sum(self.totals)
        self.largest = max(self.totals, default=0)
        self.max_free = max((k for k, b in self.buckets.items() if b), default=0)

    @property
    def index(self) -> dict[int, int]:
        if not hasattr(self, "_index"):
            self._index = {n.id: i for i, n in enumerate(self.nodes)}
        return self._index

    @property
    def idle(self) -> set[int]:
        if self._idle is None:
            counts, totals = self.counts, self.totals
            self._idle = {i for i in range(len(counts)) if counts[i] == totals[i] and totals[i]}
            self.idle_gpus = sum(totals[i] for i in self._idle)
        return self._idle

    def _bucket(self, k: int) -> list[int]:
        bucket = self.buckets[k]
        if k not in self.sorted_buckets:
            bucket.sort(key=lambda i: self.nodes[i].name)
            self.sorted_buckets.add(k)
        return bucket

    def single(self, gpus: int, avoid: frozenset[int]) -> int | None:
        """Best fit: the fullest node with room (by name on ties), not in `avoid` (node ids)."""
        if gpus > self.max_free:
            return None
        for k in range(gpus, self.max_free + 1):
            for i in self._bucket(k):
                if self.nodes[i].id not in avoid:
                    return i
        return None

    def whole(self, gpus: int, avoid: frozenset[int]) -> list[tuple[int, int]] | None:
        """Whole idle nodes, racks with the most idle GPUs first, bigger nodes first."""
        if gpus > self.total_free or gpus > (len(self.idle) and self.idle_gpus):
            return None
        by_rack: dict[str, list[int]] = defaultdict(list)
        for i in self.idle:
            if self.nodes[i].id not in avoid:
                by_rack[self.nodes[i].rack].append(i)
        racks = sorted(
            by_rack.values(),
            key=lambda ns: (-sum(self.totals[i] for i in ns), self.nodes[ns[0]].rack),
        )
        chosen, need = [], gpus
        for rack_nodes in racks:
            for i in sorted(rack_nodes, key=lambda i: (-self.totals[i], self.nodes[i].name)):
                if need <= 0:
                    break
                take = min(need, self.totals[i])
                chosen.append((i, take))
                need -= take
        return chosen if need <= 0 else None

    def place(self, job: JobView, avoid: frozenset[int] = frozenset()):
        """[(node index, [GPU indices])] taken from the free map, or None if it does not fit."""
        if job.gpus > self.total_free:
            return None
        if job.gpus <= self.largest:
            i = self.single(job.gpus, avoid)
            shape = None if i is None else [(i, job.gpus)]
        else:
            shape = self.whole(job.gpus, avoid)
        if shape is None:
            return None
        return [(i, self.take(i, count)) for i, count in shape]

    def free_list(self, i: int) -> list[int]:
        if i not in self.lists:
            self.lists[i] = sorted(self.nodes[i].free)
        return self.lists[i]

    def take(self, i: int, count: int) -> list[int]:
        free = self.free_list(i)
        before = len(free)
        self._bucket(before).remove(i)
        taken, self.lists[i] = free[:count], free[count:]
        self.counts[i] = before - count
        bucket = self.buckets[before - count]
        bucket.append(i)
        if before - count in self.sorted_buckets:
            bucket.sort(key=lambda j: self.nodes[j].name)
        if self._idle is not None and i in self._idle:
            self._idle.discard(i)
            self.idle_gpus -= self.totals[i]
        self.total_free -= count
        while self.max_free and not self.buckets[self.max_free]:
            self.max_free -= 1
        return taken


def _placement(job: JobView, choice, free: _Free) -> Placement:
    slots, rank = [], 0
    for group_rank, (i, indices) in enumerate(choice):
        node = free.nodes[i]
        for local_rank, index in enumerate(indices):
            slots.append(Slot(node.id, node.gpu_ids[index], index, rank, local_rank, group_rank))
            rank += 1
    return Placement(job.id, job.team_id, tuple(slots))


def _nodes(snapshot: Snapshot) -> list[NodeView]:
    return [n for n in snapshot.nodes if n.schedulable]


def _too_big(job: JobView, capacity: int) -> str:
    return f"needs {job.gpus} GPUs but only {capacity} GPUs are on schedulable nodes"


def fifo(snapshot: Snapshot) -> Plan:
    """Strict FIFO: start jobs in submit order until one does not fit; it blocks the rest."""
    free = _Free(_nodes(snapshot))
    queue = sorted(snapshot.queued, key=fifo_key)
    placements: list[Placement] = []
    reasons: dict[int, str] = {}
    for k, job in enumerate(queue):
        if job.gpus > free.capacity:
            reasons[job.id] = _too_big(job, free.capacity)
            continue
        choice = free.place(job)
        if choice is None:
            reasons[job.id] = (
                f"head of the FIFO queue: waiting for {job.gpus} GPUs; {free.total_free} free"
            )
            behind = f"behind job {job.id} at the head of the FIFO queue"
            reasons.update(dict.fromkeys(map(_ids, queue[k + 1 :]), behind))
            break
        placements.append(_placement(job, choice, free))
    return Plan(placements=tuple(placements), reasons=reasons)


def _seconds_until(when, now) -> float:
    if when is None:
        return math.inf
    return max(0.0, (when - now).total_seconds())


def _shadow(
    job: JobView, snapshot: Snapshot, free: _Free, started: list[tuple[list, float]]
) -> tuple[float, frozenset[int]]:
    """When (seconds from now) the head can start, and the node ids it will take then.

    Each GPU frees at its holder's expected end (unknown: never); GPUs free now at 0.
    """
    times = [[0.0] * k for k in free.counts]
    for run in snapshot.running:
        end = _seconds_until(run.expected_end, snapshot.now)
        for node_id, _ in run.slots:
            i = free.index.get(node_id)
            if i is not None:
                times[i].append(end)
    for choice, end in started:
        for i, indices in choice:
            times[i].extend([end] * len(indices))
    nodes = free.nodes
    if job.gpus <= free.largest:
        best = min(
            (
                (sorted(ts)[job.gpus - 1], nodes[i].name, nodes[i].id)
                for i, ts in enumerate(times)
                if free.totals[i] >= job.gpus
            ),
            default=None,
        )
        return (math.inf, frozenset()) if best is None else (best[0], frozenset({best[2]}))
    drained = sorted(
        (max(ts), nodes[i].name, nodes[i].id, free.totals[i]) for i, ts in enumerate(times) if ts
    )
    chosen, need, when = [], job.gpus, math.inf
    for end, _, node_id, total in drained:
        chosen.append(node_id)
        need -= total
        if need <= 0:
            when = end
            break
    return when, frozenset(chosen)


def backfill(snapshot: Snapshot) -> Plan:
    """FIFO with EASY backfill (one reservation, for the head of the queue)."""
    free = _Free(_nodes(snapshot))
    queue = sorted(snapshot.queued, key=fifo_key)
    placements: list[Placement] = []
    reasons: dict[int, str] = {}
    started: list[tuple[list, float]] = []  # placed before the head: (choice, seconds to end)
    head: JobView | None = None
    shadow, reserved = math.inf, frozenset()
    reservation = None
    behind = ""
    for k, job in enumerate(queue):
        if job.gpus > free.capacity:
            reasons[job.id] = _too_big(job, free.capacity)
            continue
        estimate = job.runtime_estimate_s
        if head is None:
            choice = free.place(job)
            if choice is not None:
                placements.append(_placement(job, choice, free))
                started.append((choice, math.inf if estimate is None else estimate))
                continue
            head = job
            shadow, reserved = _shadow(job, snapshot, free, started)
            reservation = (job.id, tuple(sorted(reserved)))
            names = ", ".join(sorted(free.nodes[free.index[n]].name for n in reserved))
            when = "at an unknown time" if math.isinf(shadow) else f"in about {shadow:.0f}s"
            reasons[job.id] = (
                f"head of the queue: waiting for {job.gpus} GPUs; {free.total_free} free now; "
                f"reserved {names or 'nothing'} {when}"
            )
            behind = (
                f"waiting behind job {head.id}: does not fit now without delaying its reservation"
            )
            continue
        if free.total_free == 0:
            full = f"waiting for GPUs behind job {head.id}; no GPUs free"
            reasons.update(dict.fromkeys(map(_ids, queue[k:]), full))
            break
        ends_first = estimate is not None and estimate <= shadow < math.inf
        choice = free.place(job, frozenset() if ends_first else reserved)
        if choice is None:
            reasons[job.id] = behind  # one string for all: long queues are scanned every event
            continue
        placements.append(_placement(job, choice, free))
    return Plan(placements=tuple(placements), reasons=reasons, reservation=reservation)
