"""Scheduling rule 3, where a gang goes: one node when it fits on one (best fit), else whole
idle nodes rack by rack; and the smaller sizes an elastic job may start on (rule 6).

A choice is [(node, [GPU indices])]; `free` maps node id -> its free GPU indices, sorted.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

from jobs.scheduling.snapshot import JobView, NodeView, RunningView
from jobs.scheduling.vocab import Slot, elastic_sizes


def _single_node(gpus: int, free: dict[int, list[int]], nodes: list[NodeView]):
    """Best fit: the fullest node that still has room, so big holes stay whole."""
    fits = [n for n in nodes if len(free[n.id]) >= gpus]
    if not fits:
        return None
    best = min(fits, key=lambda n: (len(free[n.id]), n.name))
    return [(best, free[best.id][:gpus])]


def whole_nodes(gpus: int, free: dict[int, list[int]], nodes: list[NodeView]):
    """Whole idle nodes, taken rack by rack (racks with the most idle nodes first)."""
    idle = [n for n in nodes if n.total > 0 and len(free[n.id]) == n.total]
    by_rack: dict[str, list[NodeView]] = defaultdict(list)
    for node in idle:
        by_rack[node.rack].append(node)
    racks = sorted(by_rack.values(), key=lambda ns: (-sum(n.total for n in ns), ns[0].rack))
    ordered = [n for ns in racks for n in sorted(ns, key=lambda n: (-n.total, n.name))]
    chosen, need = _fill(gpus, free, ordered)
    return chosen if need <= 0 else None


def _fill(gpus: int, free: dict[int, list[int]], idle: list[NodeView]):
    """The first of these idle nodes that add up to `gpus`: (choice, GPUs still needed)."""
    chosen, need = [], gpus
    for node in idle:
        if need <= 0:
            break
        take = min(need, node.total)
        chosen.append((node, free[node.id][:take]))
        need -= take
    return chosen, need


def place(
    job: JobView | RunningView, free: dict[int, list[int]], nodes: list[NodeView], largest=None
):
    """[(node, [gpu indices])] for `job.gpus` GPUs, or None if they do not fit now."""
    if largest is None:
        largest = max((n.total for n in nodes), default=0)
    if job.gpus <= largest:
        return _single_node(job.gpus, free, nodes)
    return whole_nodes(job.gpus, free, nodes)


def shrunk(job: JobView, free, usable, largest):
    """(GPU count, placement) of the largest smaller size that fits now, or None."""
    for size in elastic_sizes(job.gpus, job.min_gpus)[1:]:
        choice = place(replace(job, gpus=size), free, usable, largest)
        if choice is not None:
            return size, choice
    return None


def to_slots(choice) -> tuple[Slot, ...]:
    """Ranks in node order: a node's GPUs hold consecutive ranks (its group rank)."""
    slots, rank = [], 0
    for group_rank, (node, indices) in enumerate(choice):
        for local_rank, index in enumerate(indices):
            slots.append(Slot(node.id, node.gpu_ids[index], index, rank, local_rank, group_rank))
            rank += 1
    return tuple(slots)


def release(free: dict[int, list[int]], run: RunningView) -> None:
    """Count the running job's GPUs as free in `free` (a trial copy), on the nodes it has."""
    for node_id, index in run.slots:
        if node_id in free:
            free[node_id] = sorted({*free[node_id], index})


def place_on_claim(job, free, claimed, nodes, largest):
    """Place a claimant on its claimed nodes; a whole-node job also on idle nodes elsewhere
    for what its victims' nodes do not cover (its claim reserved those too)."""
    if job.gpus <= largest:
        return place(job, free, claimed, largest)
    idle = [n for n in claimed if n.total > 0 and len(free[n.id]) == n.total]
    chosen, need = _fill(job.gpus, free, idle)
    if need > 0:
        mine = {n.id for n in claimed}
        extra = whole_nodes(need, free, [n for n in nodes if n.id not in mine])
        if extra is None:
            return None
        chosen.extend(extra)
    return chosen


def occupy(free: dict[int, list[int]], choice) -> None:
    """Mark the chosen GPUs as no longer free."""
    for node, indices in choice:
        free[node.id] = [i for i in free[node.id] if i not in set(indices)]
