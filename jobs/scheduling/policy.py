"""The scheduling policy: a pure function from a Snapshot to a Plan.

Rules (first version; DESIGN.md section 6): order by priority, then submit time; a team never
holds more than quota + borrow limit; a job that fits on one node goes on one node (best fit: the
fullest node it fits on); a larger job takes whole nodes, fewest racks first; the highest-ordered
job that cannot fit reserves the nodes it will need so smaller jobs cannot starve it; every job
left queued gets a reason a person can read.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from jobs.scheduling.snapshot import JobView, NodeView, Snapshot


@dataclass(frozen=True)
class Slot:
    """One rank's GPU."""

    node_id: int
    gpu_id: int
    index: int
    rank: int
    local_rank: int
    group_rank: int


@dataclass(frozen=True)
class Placement:
    job_id: int
    team_id: int
    slots: tuple[Slot, ...]

    @property
    def node_ids(self) -> tuple[int, ...]:
        return tuple(dict.fromkeys(slot.node_id for slot in self.slots))


@dataclass(frozen=True)
class Preemption:
    """A running job (the victim) to checkpoint-and-stop so a queued one (the claimant) fits.

    kind "reclaim": the claimant's team is under its quota and the victim runs on borrowed
    GPUs (automatic). kind "priority": a higher-priority claimant (a proposal for admins).
    """

    victim_job_id: int
    claimant_job_id: int
    kind: str
    reason: str


@dataclass(frozen=True)
class Plan:
    placements: tuple[Placement, ...]
    reasons: dict[int, str] = field(default_factory=dict)  # queued job id -> why it waits
    reservation: tuple[int, tuple[int, ...]] | None = None  # (job id, node ids)
    preemptions: tuple[Preemption, ...] = ()


def job_order_key(job: JobView):
    return (-job.priority, job.submitted_at, job.id)


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


def place(job: JobView, free: dict[int, list[int]], nodes: list[NodeView]):
    """[(node, [gpu indices])] for the job, or None if it does not fit now."""
    largest = max((n.total for n in nodes), default=0)
    if job.gpus <= largest:
        return _single_node(job.gpus, free, nodes)
    return _whole_nodes(job.gpus, free, nodes)


def _to_slots(choice) -> tuple[Slot, ...]:
    slots, rank = [], 0
    for group_rank, (node, indices) in enumerate(choice):
        for local_rank, index in enumerate(indices):
            slots.append(Slot(node.id, node.gpu_ids[index], index, rank, local_rank, group_rank))
            rank += 1
    return tuple(slots)


def _reserve(job: JobView, nodes: list[NodeView], free: dict[int, list[int]]) -> tuple[int, ...]:
    """The nodes the blocked job will take when they drain: those closest to free first."""
    largest = max((n.total for n in nodes), default=0)
    ranked = sorted(nodes, key=lambda n: (-len(free[n.id]), n.name))
    if job.gpus <= largest:
        fitting = [n for n in ranked if n.total >= job.gpus]
        return (fitting[0].id,) if fitting else ()
    chosen, need = [], job.gpus
    for node in ranked:
        if need <= 0:
            break
        chosen.append(node.id)
        need -= node.total
    return tuple(chosen)


def plan(snapshot: Snapshot) -> Plan:
    nodes = [n for n in snapshot.nodes if n.schedulable]
    free = {n.id: sorted(n.free) for n in nodes}
    names = {n.id: n.name for n in nodes}
    capacity = sum(n.total for n in nodes)
    used = {t.id: t.used for t in snapshot.teams}
    teams = {t.id: t for t in snapshot.teams}

    placements: list[Placement] = []
    reasons: dict[int, str] = {}
    reservation: tuple[int, tuple[int, ...]] | None = None
    reserved: set[int] = set()
    ahead = 0  # queued jobs ordered before this one that are still waiting

    for job in sorted(snapshot.queued, key=job_order_key):
        team = teams.get(job.team_id)
        if team is None:
            reasons[job.id] = "team not found"
            ahead += 1
            continue
        if used[team.id] + job.gpus > team.cap:
            reasons[job.id] = (
                f"team {team.name} at its limit: {used[team.id]}/{team.cap} GPUs in use "
                f"(quota {team.quota} + borrow limit {team.borrow_limit}); needs {job.gpus}"
            )
            ahead += 1
            continue
        if job.gpus > capacity:
            reasons[job.id] = (
                f"needs {job.gpus} GPUs but only {capacity} GPUs are on schedulable nodes"
            )
            ahead += 1
            continue
        usable = [n for n in nodes if n.id not in reserved]
        choice = place(job, free, usable)
        if choice is None:
            free_now = sum(len(free[n.id]) for n in usable)
            if reservation is None:
                reserved.update(_reserve(job, nodes, free))
                reservation = (job.id, tuple(sorted(reserved)))
                held = ", ".join(names[i] for i in sorted(reserved, key=names.get))
                shape = "on one node" if len(reserved) <= 1 else "on whole nodes"
                reasons[job.id] = (
                    f"waiting for {job.gpus} GPUs {shape}; {free_now} free now; "
                    f"holds a reservation on {held}" + (f"; {ahead} job(s) ahead" if ahead else "")
                )
            else:
                reasons[job.id] = (
                    f"waiting for {job.gpus} GPUs; {free_now} free outside the reservation "
                    f"held by job {reservation[0]}; {ahead} job(s) ahead"
                )
            ahead += 1
            continue
        for node, indices in choice:
            free[node.id] = [i for i in free[node.id] if i not in set(indices)]
        used[team.id] += job.gpus
        placements.append(Placement(job.id, job.team_id, _to_slots(choice)))

    return Plan(placements=tuple(placements), reasons=reasons, reservation=reservation)
