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
from bisect import insort
from collections import defaultdict

from jobs.scheduling.policy import Placement, Plan, Slot
from jobs.scheduling.snapshot import JobView, NodeView, Snapshot


def fifo_key(job: JobView):
    return (job.submitted_at, job.id)


class _Free:
    """Free GPUs per node for one pass, bucketed by free count so best fit is O(GPUs per node)."""

    def __init__(self, nodes: list[NodeView]):
        self.nodes = {n.id: n for n in nodes}
        self.free = {n.id: sorted(n.free) for n in nodes}
        self.largest = max((n.total for n in nodes), default=0)
        self.capacity = sum(n.total for n in nodes)
        self.buckets: list[list[tuple[str, int]]] = [[] for _ in range(self.largest + 1)]
        for n in nodes:
            insort(self.buckets[len(self.free[n.id])], (n.name, n.id))
        self.idle = {n.id for n in nodes if n.total and len(self.free[n.id]) == n.total}
        self.idle_gpus = sum(self.nodes[i].total for i in self.idle)
        self.total_free = sum(len(f) for f in self.free.values())
        self.max_free = max((k for k, b in enumerate(self.buckets) if b), default=0)

    def single(self, gpus: int, avoid: frozenset[int]) -> int | None:
        """Best fit: the fullest node with room (by name on ties), not in `avoid`."""
        if gpus > self.max_free:
            return None
        for k in range(gpus, self.max_free + 1):
            for _, node_id in self.buckets[k]:
                if node_id not in avoid:
                    return node_id
        return None

    def whole(self, gpus: int, avoid: frozenset[int]) -> list[tuple[int, int]] | None:
        """Whole idle nodes, racks with the most idle GPUs first, bigger nodes first."""
        if gpus > self.idle_gpus:
            return None
        by_rack: dict[str, list[NodeView]] = defaultdict(list)
        for node_id in self.idle - avoid:
            node = self.nodes[node_id]
            by_rack[node.rack].append(node)
        racks = sorted(by_rack.values(), key=lambda ns: (-sum(n.total for n in ns), ns[0].rack))
        chosen, need = [], gpus
        for rack_nodes in racks:
            for node in sorted(rack_nodes, key=lambda n: (-n.total, n.name)):
                if need <= 0:
                    break
                take = min(need, node.total)
                chosen.append((node.id, take))
                need -= take
        return chosen if need <= 0 else None

    def place(self, job: JobView, avoid: frozenset[int] = frozenset()):
        """[(node id, [GPU indices])] taken from the free map, or None if it does not fit now."""
        if job.gpus > self.total_free:
            return None
        if job.gpus <= self.largest:
            node_id = self.single(job.gpus, avoid)
            shape = None if node_id is None else [(node_id, job.gpus)]
        else:
            shape = self.whole(job.gpus, avoid)
        if shape is None:
            return None
        return [(node_id, self.take(node_id, count)) for node_id, count in shape]

    def take(self, node_id: int, count: int) -> list[int]:
        node, free = self.nodes[node_id], self.free[node_id]
        before = len(free)
        self.buckets[before].remove((node.name, node_id))
        taken, self.free[node_id] = free[:count], free[count:]
        insort(self.buckets[before - count], (node.name, node_id))
        if node_id in self.idle:
            self.idle.discard(node_id)
            self.idle_gpus -= node.total
        self.total_free -= count
        while self.max_free and not self.buckets[self.max_free]:
            self.max_free -= 1
        return taken


def _placement(job: JobView, choice, nodes: dict[int, NodeView]) -> Placement:
    slots, rank = [], 0
    for group_rank, (node_id, indices) in enumerate(choice):
        node = nodes[node_id]
        for local_rank, index in enumerate(indices):
            slots.append(Slot(node_id, node.gpu_ids[index], index, rank, local_rank, group_rank))
            rank += 1
    return Placement(job.id, job.team_id, tuple(slots))


def _nodes(snapshot: Snapshot) -> list[NodeView]:
    return sorted((n for n in snapshot.nodes if n.schedulable), key=lambda n: n.name)


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
            reasons.update(dict.fromkeys((j.id for j in queue[k + 1 :]), behind))
            break
        placements.append(_placement(job, choice, free.nodes))
    return Plan(placements=tuple(placements), reasons=reasons)


def _seconds_until(when, now) -> float:
    if when is None:
        return math.inf
    return max(0.0, (when - now).total_seconds())


def _shadow(
    job: JobView, snapshot: Snapshot, free: _Free, started: list[tuple[list, float]]
) -> tuple[float, frozenset[int]]:
    """When (seconds from now) the head can start, and the nodes it will take then.

    Each GPU frees at its holder's expected end (unknown: never); GPUs free now at 0.
    """
    times: dict[int, list[float]] = {node_id: [0.0] * len(f) for node_id, f in free.free.items()}
    for run in snapshot.running:
        end = _seconds_until(run.expected_end, snapshot.now)
        for node_id, _ in run.slots:
            if node_id in times:
                times[node_id].append(end)
    for choice, end in started:
        for node_id, indices in choice:
            times[node_id].extend([end] * len(indices))
    if job.gpus <= free.largest:
        best = min(
            (
                (sorted(ts)[job.gpus - 1], free.nodes[node_id].name, node_id)
                for node_id, ts in times.items()
                if free.nodes[node_id].total >= job.gpus
            ),
            default=None,
        )
        return (math.inf, frozenset()) if best is None else (best[0], frozenset({best[2]}))
    drained = sorted(
        (max(ts), free.nodes[node_id].name, node_id, free.nodes[node_id].total)
        for node_id, ts in times.items()
        if ts
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
    for k, job in enumerate(queue):
        if job.gpus > free.capacity:
            reasons[job.id] = _too_big(job, free.capacity)
            continue
        estimate = job.runtime_estimate_s
        if head is None:
            choice = free.place(job)
            if choice is not None:
                placements.append(_placement(job, choice, free.nodes))
                started.append((choice, math.inf if estimate is None else estimate))
                continue
            head = job
            shadow, reserved = _shadow(job, snapshot, free, started)
            reservation = (job.id, tuple(sorted(reserved)))
            names = ", ".join(sorted(free.nodes[i].name for i in reserved))
            when = "at an unknown time" if math.isinf(shadow) else f"in about {shadow:.0f}s"
            reasons[job.id] = (
                f"head of the queue: waiting for {job.gpus} GPUs; {free.total_free} free now; "
                f"reserved {names or 'nothing'} {when}"
            )
            continue
        if free.total_free == 0:
            full = f"waiting for GPUs behind job {head.id}; no GPUs free"
            reasons.update(dict.fromkeys((j.id for j in queue[k:]), full))
            break
        ends_first = estimate is not None and estimate <= shadow < math.inf
        choice = free.place(job, frozenset() if ends_first else reserved)
        if choice is None:
            reasons[job.id] = (
                f"waiting for {job.gpus} GPUs behind job {head.id}; "
                "cannot start now without delaying its reservation"
            )
            continue
        placements.append(_placement(job, choice, free.nodes))
    return Plan(placements=tuple(placements), reasons=reasons, reservation=reservation)
