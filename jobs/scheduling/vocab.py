"""The scheduler's pure vocabulary: what a plan is made of (slots, placements, preemptions,
grows, wait reasons) and the elastic size rule, shared by the policy, the models, the applier
and the simulator. Imports no Django.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum


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
    filler: bool = False  # on a reservation's draining nodes past their time (rule 4)

    @property
    def node_ids(self) -> tuple[int, ...]:
        return tuple(dict.fromkeys(slot.node_id for slot in self.slots))


class PreemptionKind(StrEnum):
    """Why a running job is stopped for a queued one (the values are the database's)."""

    # The claimant's team is under its quota and the victim runs on borrowed GPUs.
    RECLAIM = "reclaim"
    # A higher-priority claimant: a proposal for admins.
    PRIORITY = "priority"
    # The claimant has waited many times its length (scheduling rule 4); the victim is its
    # own team's work beyond the quota, or borrowed work of a team with at least its team's
    # fair share.
    STARVATION = "starvation"
    # The reservation's holder takes back its drained nodes from the fillers that ran there
    # meanwhile (scheduling rule 4): they started knowing they would be stopped then.
    BACKFILL = "backfill"


# Carried out at once; the others wait for an admin or their deadline.
AUTOMATIC_KINDS = (PreemptionKind.RECLAIM, PreemptionKind.STARVATION, PreemptionKind.BACKFILL)


@dataclass(frozen=True)
class Preemption:
    """A running job (the victim) to checkpoint-and-stop so a queued one (the claimant) fits."""

    victim_job_id: int
    claimant_job_id: int
    kind: PreemptionKind
    reason: str


@dataclass(frozen=True)
class Grow:
    """A shrunk elastic job to checkpoint-and-stop so that it restarts at full size (rule 8)."""

    job_id: int
    gpus: int  # its full size
    held: int  # the GPUs it runs on now
    reason: str


def elastic_sizes(gpus: int, min_gpus: int | None) -> tuple[int, ...]:
    """The GPU counts a job may run on, largest first: all it asked for, then, for an elastic
    job (min_gpus below gpus), the divisors of that down to min_gpus, so that the global
    batch splits evenly over the ranks."""
    low = max(min_gpus or gpus, 1)
    return (gpus, *(n for n in range(gpus - 1, low - 1, -1) if gpus % n == 0))


def _victims(data: Mapping) -> str:
    return ", ".join(f"job {v}" for v in data["victims"])


def _stopping(data: Mapping) -> str:
    return (
        f"waiting for {_victims(data)} to checkpoint and stop (preempted for it); "
        f"{data['gpus']} GPUs held on {', '.join(data['nodes'])}"
    )


def _ending(data: Mapping) -> str:
    jobs = ", ".join(f"job {j}" for j in data["ending"])
    until = datetime.fromtimestamp(data["until"], tz=UTC).strftime("%H:%M:%S UTC")
    return (
        f"waiting for {jobs} to end by {until} (time limit or stop deadline); nothing is "
        f"stopped for it; {data['gpus']} GPUs held on {', '.join(data['nodes'])}"
    )


def _team_queue(data: Mapping) -> str:
    return (
        f"behind job {data['job']} of team {data['team']}, which waits for the team's GPUs "
        f"to free up under its limit ({data['cap']} GPUs)"
        + ("" if data["until"] is None else "; only jobs that end before then may pass")
    )


def _team_limit(data: Mapping) -> str:
    paused = " (borrowing paused after a reclaim)" if data["paused"] else ""
    return (
        f"team {data['team']} at its limit: {data['used']}/{data['cap']} GPUs in use "
        f"(quota {data['quota']} + borrow limit {data['borrow_limit']}{paused}); "
        f"needs {data['gpus']}"
    )


def _preempting(data: Mapping) -> str:
    kind = data["kind"]
    if kind == PreemptionKind.STARVATION:
        why = f"it has waited {data['stretch']:.0f} times its length"
    elif kind == PreemptionKind.BACKFILL:
        why = "its reserved nodes have drained but for the jobs that filled them meanwhile"
    elif kind == PreemptionKind.RECLAIM:
        why = "reclaiming its team's quota"
    elif data["same_team"]:
        return (
            f"waiting for {_victims(data)} (lower priority, same team) to checkpoint and stop; "
            f"{data['gpus']} GPUs reserved"
        )
    else:
        why = f"priority {data['priority']} over lower-priority work"
    return (
        f"waiting for {_victims(data)} to checkpoint and stop ({why}); {data['gpus']} GPUs reserved"
    )


def _ahead(data: Mapping) -> str:
    return f"; {data['ahead']} job(s) ahead"


def _reserved(data: Mapping) -> str:
    shape = "on one node" if len(data["nodes"]) <= 1 else "on whole nodes"
    return (
        f"waiting for {data['gpus']} GPUs {shape}; {data['free']} free now; "
        f"holds a reservation on {', '.join(data['nodes'])}"
        + (_ahead(data) if data["ahead"] else "")
    )


def _reserved_starving(data: Mapping) -> str:
    return (
        f"waiting for {data['gpus']} GPUs; it has waited {data['stretch']:.0f} times its "
        f"length, so it holds a reservation of its own on {', '.join(data['nodes'])} "
        f"(beside job {data['beside']}'s)" + _ahead(data)
    )


def _behind_reservation(data: Mapping) -> str:
    held_by = (
        f"reservations held by job {data['job']} and others"
        if data["others"]
        else f"reservation held by job {data['job']}"
    )
    return f"waiting for {data['gpus']} GPUs; {data['free']} free outside the {held_by}" + _ahead(
        data
    )


# code -> its text; the data each needs is listed on WaitReason.
_TEXTS = {
    "no_team": lambda data: "team not found",
    "stopping": _stopping,
    "ending": _ending,
    "team_queue": _team_queue,
    "team_limit": _team_limit,
    "too_large": lambda data: (
        f"needs {data['gpus']} GPUs but only {data['capacity']} GPUs are on schedulable nodes"
    ),
    "isolation": lambda data: (
        f"team {data['team']} runs on isolated (container) nodes only; those have "
        f"{data['capacity']} GPUs schedulable and it needs {data['gpus']}"
    ),
    "preempting": _preempting,
    "reserved": _reserved,
    "reserved_starving": _reserved_starving,
    "behind_reservation": _behind_reservation,
    "reclaim_risk": lambda data: (
        f"a reclaim stopped it lately; it does not borrow beyond team {data['team']}'s quota "
        f"({data['quota']} GPUs) while {', '.join(data['teams'])} wait(s) within their quota, "
        "who would take the GPUs back at once"
    ),
    "rejected": lambda data: f"placement rejected ({data['why']}); retrying next pass",
}


@dataclass(frozen=True, slots=True)
class WaitReason:
    """Why a queued job waits, as data: a code and its numbers, from which `text()` writes the
    sentence people read (pages can show the numbers without parsing the sentence).

    Codes and their data (job ids, GPU counts, node names; JSON-ready):
    - no_team: {}
    - stopping: its claim's victims were told to stop and its GPUs are held:
      {victims: job ids, gpus, nodes: names held}
    - ending: jobs ending within a stop's grace anyway free its GPUs, so nothing is stopped
      for it: {ending: their job ids, gpus, until: epoch seconds they are gone by, by: epoch
      seconds its first such wait was due (later ones end by then), nodes: names held,
      node_ids: the same nodes' ids}
    - team_queue: behind its team's first job blocked by the team's cap:
      {job, team: name, cap, until: epoch seconds the team's GPUs free up, or None}
    - team_limit: {team: name, used, cap, quota, borrow_limit, paused: bool, gpus}
    - too_large: more GPUs than the schedulable nodes have: {gpus, capacity}
    - isolation: its team runs on isolated nodes only and those have too few GPUs:
      {team: name, gpus, capacity}
    - preempting: victims chosen this pass: {victims: job ids, gpus, kind: a PreemptionKind,
      same_team: bool (priority), priority (priority), stretch (starvation); backfill: the
      reservation's holder stopping the fillers on its drained nodes}
    - reserved: it holds the reservation: {gpus, free: GPUs free now, nodes: names, ahead}
    - reserved_starving: a starving job's own reservation:
      {gpus, stretch, nodes: names, beside: the reservation holder's job id, ahead}
    - behind_reservation: {gpus, free: GPUs free outside the reservations, job: the
      reservation holder, others: bool (starving jobs hold more), ahead}
    - reclaim_risk: reclaimed lately, it would borrow while other teams' guaranteed jobs
      wait (jobs.scheduling.protection, rule 2): {team: name, quota, teams: names waiting}
    - rejected: the applier refused its placement: {why}
    """

    code: str
    data: Mapping = field(default_factory=dict)

    def text(self) -> str:
        return _TEXTS[self.code](self.data)

    def to_json(self) -> dict:
        return {"code": self.code, "data": dict(self.data)}

    @classmethod
    def from_json(cls, value: Mapping) -> WaitReason:
        return cls(value["code"], value.get("data") or {})

    @property
    def reserved_nodes(self) -> tuple[str, ...]:
        """Names of the nodes it holds, if any."""
        if self.code in ("stopping", "ending", "reserved", "reserved_starving"):
            return tuple(self.data["nodes"])
        return ()

    @property
    def victims(self) -> tuple[int, ...]:
        """Job ids of the running jobs stopping (or to stop) for it, if any."""
        return tuple(self.data.get("victims", ()))


@dataclass(frozen=True)
class Plan:
    placements: tuple[Placement, ...]
    reasons: dict[int, str] = field(default_factory=dict)  # queued job id -> why it waits
    reservation: tuple[int, tuple[int, ...]] | None = None  # (job id, node ids)
    preemptions: tuple[Preemption, ...] = ()
    grows: tuple[Grow, ...] = ()
    # queued job id -> why it waits, as data (reasons[id] == waits[id].text()); the policy
    # fills it, the baselines do not.
    waits: dict[int, WaitReason] = field(default_factory=dict)
    # Queued job ids in the policy's order (the policy fills it): start estimates take the
    # head of the queue from it instead of ordering 10,000 jobs again (estimate.head_of_queue).
    order: tuple[int, ...] = ()
    # Jobs waiting for jobs that end within the grace anyway (rule 5, jobs.scheduling.ending):
    # job id -> (the node ids it holds, its first such wait's deadline). The next pass offers
    # it the GPUs there first, as a claimant (JobView.claim_nodes, ending_by; the simulator
    # reads them here, the live reader from the job's stored wait).
    ending_holds: dict[int, tuple[tuple[int, ...], datetime]] = field(default_factory=dict)
