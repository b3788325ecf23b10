"""Shared by the claim tests: a placement on chosen GPUs, and invariants 1 and 2 of DESIGN.md
checked on the database (no GPU in two live allocations, every live attempt holds its whole
gang, no job with two live attempts)."""

from collections import Counter

from django.db.models import Count, Q

from jobs.models import GPU, Allocation, Attempt, Job
from jobs.scheduling.vocab import Placement, Slot


def placement_on(job: Job, gpus: list[GPU]) -> Placement:
    """`job` placed on `gpus`, ranks in list order, node groups in order of first appearance."""
    group: dict[int, int] = {}
    slots = []
    for rank, gpu in enumerate(gpus):
        group.setdefault(gpu.node_id, len(group))
        slots.append(
            Slot(
                node_id=gpu.node_id,
                gpu_id=gpu.id,
                index=gpu.index,
                rank=rank,
                local_rank=sum(1 for g in gpus[:rank] if g.node_id == gpu.node_id),
                group_rank=group[gpu.node_id],
            )
        )
    return Placement(job_id=job.id, team_id=job.team_id, slots=tuple(slots))


def check_claim_invariants() -> None:
    doubled = (
        Allocation.objects.filter(released_at__isnull=True)
        .values("gpu_id")
        .annotate(n=Count("id"))
        .filter(n__gt=1)
    )
    assert list(doubled) == [], "a GPU is held by two live allocations"
    for attempt in (
        Attempt.objects.filter(ended_at__isnull=True)
        .select_related("job")
        .annotate(held=Count("allocations", filter=Q(allocations__released_at__isnull=True)))
    ):
        assert attempt.held == attempt.job.gpus, f"partial gang: {attempt} holds {attempt.held}"
    live = Counter(Attempt.objects.filter(ended_at__isnull=True).values_list("job_id", flat=True))
    assert all(n == 1 for n in live.values()), "a job has two live attempts"
