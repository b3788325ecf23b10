"""The scheduler's pure vocabulary: what a plan is made of (slots, placements, preemptions,
grows) and the elastic size rule, shared by the policy, the models and the
simulator. Imports no Django.
"""

from __future__ import annotations

from dataclasses import dataclass, field
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


# Carried out at once; the others wait for an admin or their deadline.
AUTOMATIC_KINDS = (PreemptionKind.RECLAIM, PreemptionKind.STARVATION)


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


@dataclass(frozen=True)
class Plan:
    placements: tuple[Placement, ...]
    reasons: dict[int, str] = field(default_factory=dict)  # queued job id -> why it waits
    reservation: tuple[int, tuple[int, ...]] | None = None  # (job id, node ids)
    preemptions: tuple[Preemption, ...] = ()
    grows: tuple[Grow, ...] = ()
