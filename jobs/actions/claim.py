"""The gang claim: QUEUED -> STARTING for many gangs at once, each whole or not at all
(DESIGN.md invariants 1-3), run by the scheduler's applier inside its transaction."""

from __future__ import annotations

import random
from datetime import datetime

from django.db import connection, transaction
from django.db.models import Count, Max

from jobs.actions.base import push_state, record_event
from jobs.bulk import bulk_set
from jobs.checkpoint_policy import checkpoint_advice
from jobs.conf import lockstep_setting
from jobs.event_kinds import EventKind
from jobs.models import (
    GPU,
    Allocation,
    Attempt,
    Checkpoint,
    Event,
    Job,
    Node,
    PreemptionRequest,
)
from jobs.queries import (
    latest_checkpoint,
)
from jobs.scheduling.vocab import elastic_sizes
from jobs.validation import dataset_location
from teams.models import Team
from trainer import framework_saves
from trainer.checkpoint_layout import attempt_dir, dir_bytes, read_marker, step_dirs
from trainer.framework_saves import seeded_path


class ClaimRejected(Exception):
    """A placement could not be applied; the job stays queued."""


class ClaimConflict(Exception):
    """A batch of claims met a concurrent change after its checks: retry it in smaller batches."""


def _master_port(master: Node, attempt_id: int, taken: set[int]) -> int:
    """A rendezvous port on the master node that no live attempt there uses (`taken`: the
    ports of the live attempts on its address): random within [MASTER_PORT_BASE,
    +MASTER_PORT_SPAN) so that two portals on one host rarely meet either."""
    base = lockstep_setting("MASTER_PORT_BASE")
    span = max(int(lockstep_setting("MASTER_PORT_SPAN")), 1)
    rng = random.Random(f"{master.id}-{attempt_id}")
    for _ in range(100):
        port = base + rng.randrange(span)
        if port not in taken:
            return port
    return base + attempt_id % span


def adopt_unreported_checkpoints(job: Job, *, now: datetime) -> list[Checkpoint]:
    """Saves of ended attempts that the portal never heard of, recorded so the next attempt
    resumes from the newest instead of redoing their steps:
    - committed DCP saves whose report was lost with rank 0's node (the COMMITTED marker is
      the proof);
    - a framework's own saves (trainer/framework_saves.py) that the agent saw too late: a
      script that saves and then fails at once ends its attempt, on another node's report,
      before the save has settled for the agent. Whole on disk is the proof."""
    latest = latest_checkpoint(job.id)
    known = set(Checkpoint.objects.filter(job=job).values_list("path", flat=True))
    root = lockstep_setting("CHECKPOINT_ROOT")
    adopted = []
    ended = job.attempts.filter(ended_at__isnull=False).select_related("resumed_from")
    for attempt in ended.order_by("number"):
        directory = attempt_dir(root, job.id, attempt.number)
        if not directory.is_dir():
            continue
        found = [
            (step_dir, Checkpoint.Format.DCP, int(marker.get("step", 0)))
            for step_dir in step_dirs(directory)
            if (marker := read_marker(step_dir)) is not None
        ]
        # What the attempt resumed from, laid out in its directory: not a save of its own.
        seeded = (
            seeded_path(directory, attempt.resumed_from.path)
            if attempt.resumed_from and attempt.resumed_from.format != Checkpoint.Format.DCP
            else None
        )
        own = directory.parent
        for path in framework_saves.candidates(directory):
            fmt, step = framework_saves.classify(path) or ("", None)
            if (
                path != seeded
                and framework_saves.inside(path, own)
                and framework_saves.complete(path, fmt)
            ):
                found.append((path, fmt, attempt.last_step if step is None else step))
        for path, fmt, step in found:
            if str(path) in known or (latest is not None and step <= latest.step):
                continue
            checkpoint = Checkpoint.objects.create(
                job=job,
                attempt=attempt,
                step=step,
                path=str(path),
                bytes=dir_bytes(path) if path.is_dir() else path.stat().st_size,
                created_at=now,
                format=fmt,
            )
            known.add(str(path))
            adopted.append(checkpoint)
            why = (
                "committed checkpoint at step {} of attempt {} found on disk (its report was "
                "lost with its node)"
                if fmt == Checkpoint.Format.DCP
                else f"{Checkpoint.Format(fmt).label} checkpoint at step {{}} of attempt {{}} "
                "found on disk (the attempt ended before the agent reported it)"
            )
            record_event(
                EventKind.CHECKPOINT_RECOVERED,
                why.format(step, attempt.number),
                job=job,
                attempt=attempt,
                data={"step": step, "format": fmt},
            )
    return adopted


def do_start_attempt(placement, *, now: datetime) -> Attempt:
    """Claim a whole gang for a queued job, or raise ClaimRejected and change nothing.

    The one-gang form of `do_start_attempts`; the same rules and the same transaction needs.
    """
    started, rejected = do_start_attempts([placement], now=now)
    if placement.job_id in rejected:
        raise ClaimRejected(rejected[placement.job_id])
    return started[placement.job_id]


def _held_gpus(gpu_ids) -> set[int]:
    """GPUs (of these) in a live allocation, as committed so far (or written by this
    transaction)."""
    return set(
        Allocation.objects.filter(released_at__isnull=True, gpu_id__in=gpu_ids).values_list(
            "gpu_id", flat=True
        )
    )


def do_start_attempts(placements, *, now: datetime) -> tuple[dict[int, Attempt], dict[int, str]]:
    """Claim many gangs at once, each whole or not at all: ({job id: attempt} started,
    {job id: why} rejected). A rejected job changes nothing and stays queued.

    Set-based, so the cost of a scheduling pass does not grow by a round trip per gang: the
    teams, then the jobs of all the gangs are locked in two queries (`SELECT ... FOR NO KEY
    UPDATE`, in id order: concurrent claimers of a team queue up behind one another, never in
    a cycle, while rows that merely reference a team or job, a submit or an event, still go
    in); the team usage,
    nodes, GPUs and the GPUs already held are read in one query each; every gang is checked in
    memory in plan order (job still QUEUED, size, the team's cap, nodes up, GPUs exist and are
    free, not given twice in the batch); then attempts, allocations and events of all the
    accepted gangs are written in bulk.

    Must run inside a transaction, and in its own savepoint: the checks see what other
    transactions have committed, so a GPU claimed by a concurrent scheduler after the check
    makes the allocation insert fail on the `gpu_held_once` index (IntegrityError; or a
    deadlock error), and a job changed under us raises ClaimConflict. Either way the caller
    rolls the savepoint back and retries the gangs in smaller batches, down to one gang each,
    so only the gang that lost the race is rejected.
    """
    assert transaction.get_connection().in_atomic_block, "claims run inside a transaction"
    placements = list(placements)
    if not placements:
        return {}, {}
    accepted, rejected, nodes = _check_gangs(placements)
    if not accepted:
        return {}, rejected
    attempts = _create_attempts(accepted, nodes, now=now)
    _write_allocations(accepted, attempts, now=now)
    _move_to_starting(accepted, attempts, nodes, now=now)
    _record_starts(accepted, attempts, now=now)
    started: dict[int, Attempt] = {}
    # Last, after every write that can fail: pushes queued in a savepoint that rolls back
    # would otherwise go out for jobs that did not start.
    for (_, job, _), attempt in zip(accepted, attempts, strict=True):
        push_state(job)
        started[job.id] = attempt
    return started, rejected


def _lock_up_nodes(node_ids) -> dict[int, Node]:
    """The placements' nodes that are up, read under a share lock on PostgreSQL (in id order,
    after the jobs). Read plainly, a drain, a planned leave or a health hold that committed
    between this read and the claim's commit missed the new attempt, which then stayed on a
    draining node or waited out its start timeout on a leaving one. FOR SHARE waits for those
    writers (FOR NO KEY UPDATE) and blocks none of the allocations' foreign-key checks.
    SQLite serializes writers: a plain read is already the latest."""
    if connection.vendor != "postgresql":
        return {n.id: n for n in Node.objects.filter(id__in=node_ids, state=Node.State.UP)}
    table = Node._meta.db_table
    locked = Node.objects.raw(
        f"SELECT * FROM {table} WHERE id = ANY(%s) ORDER BY id FOR SHARE",  # noqa: S608
        [sorted(node_ids)],
    )
    return {n.id: n for n in locked if n.state == Node.State.UP}


def _check_gangs(placements) -> tuple[list, dict[int, str], dict[int, Node]]:
    """Lock the teams, then the jobs (id order), read usage, nodes and held GPUs in one query
    each, and check every gang in memory in plan order: (accepted (placement, job, team) in
    plan order, {job id: why} rejected, the placements' nodes that are up)."""
    rejected: dict[int, str] = {}
    team_ids = sorted({p.team_id for p in placements})
    teams = {
        t.id: t
        for t in Team.objects.select_for_update(no_key=True).filter(id__in=team_ids).order_by("id")
    }
    jobs = {
        j.id: j
        for j in Job.objects.select_for_update(no_key=True)
        .filter(id__in={p.job_id for p in placements})
        .order_by("id")
    }
    used = dict(
        Allocation.objects.filter(released_at__isnull=True, attempt__job__team_id__in=team_ids)
        .order_by()
        .values("attempt__job__team_id")
        .annotate(n=Count("id"))
        .values_list("attempt__job__team_id", "n")
    )
    nodes = _lock_up_nodes({s.node_id for p in placements for s in p.slots})
    all_gpus = {s.gpu_id for p in placements for s in p.slots}
    gpu_node = dict(GPU.objects.filter(id__in=all_gpus).values_list("id", "node_id"))
    held = _held_gpus(all_gpus)

    accepted = []  # (placement, job, team), in plan order
    given: set[int] = set()  # GPUs given to an earlier gang of this batch
    claimed: set[int] = set()  # jobs accepted so far
    for placement in placements:
        job, team = jobs.get(placement.job_id), teams.get(placement.team_id)
        gpu_ids = [slot.gpu_id for slot in placement.slots]
        if job is None or team is None or job.team_id != team.id:
            why = f"job {placement.job_id} of team {placement.team_id} does not exist"
        elif job.id in rejected or job.id in claimed:
            why = f"job {job.id} is placed twice in one plan"
        elif job.state != Job.State.QUEUED:
            why = f"job {job.id} is {job.state}, not QUEUED"
        elif len(placement.slots) not in elastic_sizes(job.gpus, job.min_gpus):
            why = f"placement has {len(placement.slots)} GPUs, job needs {job.gpus}" + (
                f" (or, elastic, a divisor of it down to {job.min_gpus})" if job.min_gpus else ""
            )
        elif used.get(team.id, 0) + len(placement.slots) > team.gpu_cap:
            why = f"team {team.name} would exceed {team.gpu_cap} GPUs"
        elif any(slot.node_id not in nodes for slot in placement.slots):
            why = "a node of the placement is no longer up"
        elif team.isolated_only and not all(nodes[s.node_id].isolated for s in placement.slots):
            why = f"team {team.name} runs on isolated nodes only; a node is process-runtime"
        elif len(set(gpu_ids)) != len(gpu_ids) or any(
            gpu_node.get(slot.gpu_id) != slot.node_id for slot in placement.slots
        ):
            why = "a GPU of the placement does not exist"
        elif held.intersection(gpu_ids):
            why = f"claim lost a race: GPU {min(held.intersection(gpu_ids))} is held"
        elif given.intersection(gpu_ids):
            why = f"GPU {min(given.intersection(gpu_ids))} is given to another job of the plan"
        else:
            accepted.append((placement, job, team))
            used[team.id] = used.get(team.id, 0) + len(placement.slots)
            given.update(gpu_ids)
            claimed.add(job.id)
            continue
        rejected[placement.job_id] = why
    return accepted, rejected, nodes


def _create_attempts(accepted, nodes: dict[int, Node], *, now: datetime) -> list[Attempt]:
    """One attempt per accepted gang, numbered after the job's last, resuming from its newest
    committed checkpoint, with a rendezvous port of its own on the master node."""
    # Jobs that ran before: adopt committed checkpoints nobody reported, resume from the newest.
    ids = [job.id for _, job, _ in accepted]
    numbers = dict(
        Attempt.objects.filter(job_id__in=ids)
        .order_by()
        .values("job_id")
        .annotate(n=Max("number"))
        .values_list("job_id", "n")
    )
    latest: dict[int, tuple[int, int]] = {}  # job id -> (checkpoint id, step)
    if numbers:
        for _, job, _ in accepted:
            if job.id in numbers:
                adopt_unreported_checkpoints(job, now=now)
        for job_id, checkpoint_id, step in (
            Checkpoint.objects.filter(job_id__in=list(numbers), deleted_at__isnull=True)
            .order_by("job_id", "-step", "-id")
            .values_list("job_id", "id", "step")
        ):
            latest.setdefault(job_id, (checkpoint_id, step))
    attempts = Attempt.objects.bulk_create(
        [
            Attempt(
                job=job,
                number=numbers.get(job.id, 0) + 1,
                world_size=len(placement.slots),
                created_at=now,
                master_addr=nodes[placement.slots[0].node_id].address,
                master_port=0,
                resumed_from_id=latest[job.id][0] if job.id in latest else None,
                resumed_from_step=latest[job.id][1] if job.id in latest else 0,
                # Before first_started_at is set: a fresh job's advice needs no queries.
                checkpoint_interval_s=checkpoint_advice(job)["interval_s"],
                dataset_location=dataset_location(job.dataset),
                filler=placement.filler,
            )
            for placement, job, _ in accepted
        ],
        batch_size=500,
    )
    # A port per attempt so two rendezvous on one master node never meet, including two
    # started by this batch.
    ports: dict[str, set[int]] = {}
    for addr, port in Attempt.objects.filter(
        ended_at__isnull=True, master_addr__in={a.master_addr for a in attempts}
    ).values_list("master_addr", "master_port"):
        ports.setdefault(addr, set()).add(port)
    for (placement, _, _), attempt in zip(accepted, attempts, strict=True):
        taken = ports.setdefault(attempt.master_addr, set())
        attempt.master_port = _master_port(nodes[placement.slots[0].node_id], attempt.id, taken)
        taken.add(attempt.master_port)
    bulk_set(Attempt, ["master_port"], [(a.id, a.master_port) for a in attempts])
    return attempts


def _write_allocations(accepted, attempts: list[Attempt], *, now: datetime) -> None:
    # Sorted by GPU id so concurrent claimers lock index entries in one order (no deadlock).
    # A GPU claimed concurrently since `held` was read fails here, on gpu_held_once.
    Allocation.objects.bulk_create(
        sorted(
            (
                Allocation(
                    attempt=attempt,
                    gpu_id=slot.gpu_id,
                    node_id=slot.node_id,
                    rank=slot.rank,
                    local_rank=slot.local_rank,
                    group_rank=slot.group_rank,
                    claimed_at=now,
                )
                for (placement, _, _), attempt in zip(accepted, attempts, strict=True)
                for slot in placement.slots
            ),
            key=lambda a: a.gpu_id,
        ),
        batch_size=1000,
    )


def _move_to_starting(accepted, attempts: list[Attempt], nodes: dict[int, Node], *, now) -> None:
    for (placement, job, _), attempt in zip(accepted, attempts, strict=True):
        slots = placement.slots
        where = ", ".join(
            f"{nodes[nid].name}[{','.join(str(s.index) for s in slots if s.node_id == nid)}]"
            for nid in placement.node_ids
        )
        resume = (
            f"resuming from step {attempt.resumed_from_step}"
            if attempt.resumed_from_id
            else "fresh start"
        )
        job.state = Job.State.STARTING
        job.reason = f"attempt {attempt.number} starting on {where}; {resume}"
        if attempt.world_size < job.gpus:
            job.reason += f"; on {attempt.world_size} of its {job.gpus} GPUs (elastic)"
        if job.first_started_at is None:
            job.first_started_at = now
    # QUEUED -> STARTING, conditional although the rows are locked: a job that moved on
    # anyway makes the count short, and the caller retries gang by gang.
    moved = bulk_set(
        Job,
        ["state", "reason", "first_started_at"],
        [(job.id, job.state, job.reason, job.first_started_at) for _, job, _ in accepted],
        where={"state": Job.State.QUEUED},
    )
    if moved != len(accepted):
        raise ClaimConflict(f"{len(accepted) - moved} job(s) left QUEUED during the claim")


def _record_starts(accepted, attempts: list[Attempt], *, now: datetime) -> None:
    """The started events (and shrunk ones for elastic gangs), and the claimants of executed
    preemptions marked started: their reclaim time ends here."""
    ids = [job.id for _, job, _ in accepted]
    Event.objects.bulk_create(
        [
            Event(
                kind=EventKind.ATTEMPT_STARTED,
                message=job.reason[:2000],
                job=job,
                attempt=attempt,
                team=team,
            )
            for (_, job, team), attempt in zip(accepted, attempts, strict=True)
        ]
        + [
            Event(
                kind=EventKind.ATTEMPT_SHRUNK,
                message=(
                    f"attempt {attempt.number} runs on {attempt.world_size} of the job's "
                    f"{job.gpus} GPUs: the cluster is short of {job.gpus} and the job is elastic "
                    f"(min {job.min_gpus}); the global batch is kept by gradient accumulation"
                    + (
                        f", resuming step {attempt.resumed_from_step} resharded"
                        if attempt.resumed_from_id
                        else ""
                    )
                ),
                job=job,
                attempt=attempt,
                team=team,
            )
            for (_, job, team), attempt in zip(accepted, attempts, strict=True)
            if attempt.world_size < job.gpus
        ],
        batch_size=500,
    )
    by_job = {job.id: (job, team) for _, job, team in accepted}
    for request in PreemptionRequest.objects.filter(
        claimant_id__in=ids,
        state=PreemptionRequest.State.EXECUTED,
        claimant_started_at__isnull=True,
    ):
        job, team = by_job[request.claimant_id]
        request.claimant_started_at = now
        request.save(update_fields=["claimant_started_at"])
        record_event(
            EventKind.PREEMPTION_CLAIMANT_STARTED,
            f"job {job.id} started {request.reclaim_s:.0f}s after its {request.kind} of job "
            f"{request.victim_id} was decided",
            job=job,
            team=team,
            data={"request": request.id, "kind": request.kind, "reclaim_s": request.reclaim_s},
        )
