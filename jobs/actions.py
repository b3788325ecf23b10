"""Every state change of jobs, attempts, nodes, checkpoints and model versions.

One function per change; each runs in a transaction and writes an Event. Views, serializers,
the agent endpoints and the scheduler only validate input and call these. Side effects (waking
the scheduler, websocket pushes, queue work) go out on commit, never before.
"""

from __future__ import annotations

import logging
import secrets
import signal
from datetime import datetime, timedelta
from pathlib import Path
from typing import NamedTuple

from django.db import connection, transaction
from django.db.models import Max
from django.template.defaultfilters import filesizeformat

from jobs import rollup
from jobs.bulk_sql import insert_rows
from jobs.conf import lockstep_setting
from jobs.models import (
    GPU,
    Allocation,
    Attempt,
    Checkpoint,
    Event,
    GpuSample,
    Job,
    LogChunk,
    MetricPoint,
    ModelVersion,
    Node,
    PreemptionRequest,
)
from jobs.notify import on_commit_send
from jobs.scheduling.wake import wake_scheduler
from teams.models import Team, token_digest

log = logging.getLogger(__name__)

STEP_METRICS = ("loss", "tokens_per_s", "step_time_s", "compute_s")
# Steps and ranks are PositiveIntegerFields: 32 bits on PostgreSQL. A report beyond them is
# dropped as bad, rather than failing the whole heartbeat in the database.
MAX_COUNTER = 2**31 - 1


class ClaimRejected(Exception):
    """A placement could not be applied; the job stays queued."""


def _event(kind: str, message: str, **refs) -> Event:
    # Messages quote agent and trainer reports; PostgreSQL text cannot hold a NUL character.
    return Event.objects.create(kind=kind, message=message.replace("\x00", "\ufffd")[:2000], **refs)


def _push_state(job: Job) -> None:
    on_commit_send(
        job.id, {"type": "state", "state": job.state, "reason": job.reason, "job": job.id}
    )


def _wake(reason: str) -> None:
    transaction.on_commit(lambda: wake_scheduler(reason))


def describe_exit(code: int | None) -> str:
    if code is None:
        return "no exit code"
    if code < 0:
        try:
            return f"signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


# --- jobs ----------------------------------------------------------------------------------


@transaction.atomic
def do_submit_job(*, owner, team: Team, now: datetime, **fields) -> Job:
    job = Job.objects.create(
        owner=owner,
        team=team,
        submitted_at=now,
        state=Job.State.QUEUED,
        reason="queued; waiting for the scheduler's next pass",
        **fields,
    )
    _event(
        "job.submitted",
        f"{owner.username} submitted {job.name}: {job.gpus} GPUs, priority {job.priority}",
        job=job,
        team=team,
        actor=owner,
    )
    _wake("job submitted")
    return job


def _lock_job_for_stop(job_id: int) -> tuple[Job, Attempt | None]:
    """Lock the job's live attempt, then the job: the heartbeat's order (node, attempt, job).
    A stop that locked the job first and then waited for the attempt deadlocked with a
    heartbeat marking that attempt running or ended, which waits for the job. The live
    attempt is read again under the job's lock: one started meanwhile is locked then."""
    live = Attempt.objects.select_for_update(no_key=True).filter(job_id=job_id, ended_at=None)
    list(live.order_by("id"))
    job = Job.objects.select_for_update(no_key=True).get(pk=job_id)
    return job, live.order_by("id").first()


@transaction.atomic
def do_cancel_job(job: Job, *, actor, now: datetime, reason: str = "") -> Job:
    job, attempt = _lock_job_for_stop(job.pk)
    if job.is_terminal:
        return job
    why = reason or f"cancelled by {actor.username if actor else 'the system'}"
    if attempt is not None:
        # Checkpoint first: the agent sends SIGTERM, the trainer saves at the next step
        # boundary and exits; the GPUs are released when it does (or at the deadline).
        _begin_stop(attempt, now=now, reason=why)
    job.state = Job.State.CANCELLED
    job.reason = why
    job.finished_at = now
    job.save(update_fields=["state", "reason", "finished_at"])
    _event("job.cancelled", why, job=job, team_id=job.team_id, actor=actor)
    _push_state(job)
    _wake("job cancelled")
    return job


def run_seconds(job_ids, *, now: datetime, live: bool = True) -> dict[int, float]:
    """Seconds each job has held GPUs so far, summed over its attempts (the live one up to
    `now` unless live=False). Time spent queued, preempted or backing off is not counted."""
    totals: dict[int, float] = {}
    attempts = Attempt.objects.filter(job_id__in=job_ids)
    if not live:
        attempts = attempts.filter(ended_at__isnull=False)
    for job_id, started, ended in attempts.values_list("job_id", "created_at", "ended_at"):
        totals[job_id] = totals.get(job_id, 0.0) + max(
            ((ended or now) - started).total_seconds(), 0.0
        )
    return totals


@transaction.atomic
def do_enforce_time_limit(job: Job, *, now: datetime) -> bool:
    """A job past its time limit is stopped checkpoint-first and ends FAILED, like Slurm's
    TIMEOUT. The limit counts the job's run time over all its attempts: a job that waited
    through a preemption or a failure does not lose that time from its limit."""
    job, attempt = _lock_job_for_stop(job.pk)
    if job.is_terminal or not job.time_limit_s or job.first_started_at is None:
        return False
    if run_seconds([job.id], now=now).get(job.id, 0.0) < job.time_limit_s:
        return False
    why = f"time limit of {job.time_limit_s}s reached"
    if attempt is not None:
        _begin_stop(attempt, now=now, reason=why)
    job.state, job.reason, job.finished_at = Job.State.FAILED, why, now
    job.save(update_fields=["state", "reason", "finished_at"])
    _event("job.time_limit", why, job=job, team_id=job.team_id)
    _push_state(job)
    _wake("time limit")
    return True


@transaction.atomic
def do_set_job_priority(job: Job, *, priority: str, actor) -> Job:
    before = job.priority
    job.priority = priority
    job.save(update_fields=["priority"])
    _event(
        "job.priority_changed",
        f"priority {before} -> {priority}",
        job=job,
        team_id=job.team_id,
        actor=actor,
    )
    _wake("priority changed")
    return job


def _begin_stop(attempt: Attempt, *, now: datetime, reason: str) -> None:
    if attempt.state == Attempt.State.STOPPING:
        return
    attempt.state = Attempt.State.STOPPING
    attempt.stop_deadline = now + timedelta(seconds=lockstep_setting("STOP_GRACE_S"))
    attempt.end_reason = reason
    attempt.save(update_fields=["state", "stop_deadline", "end_reason"])
    _event(
        "attempt.stopping",
        f"attempt {attempt.number}: checkpoint-and-stop, deadline {attempt.stop_deadline:%H:%M:%S}",
        job_id=attempt.job_id,
        attempt=attempt,
    )


@transaction.atomic
def do_requeue_job(job: Job, *, now: datetime) -> bool:
    """RESTARTING -> QUEUED once the backoff has passed."""
    updated = Job.objects.filter(
        pk=job.pk, state=Job.State.RESTARTING, restart_after__lte=now
    ).update(state=Job.State.QUEUED, reason="requeued after a failure; waiting to be placed")
    if updated:
        job.refresh_from_db()
        _event(
            "job.requeued",
            f"requeued for restart {job.restart_count}",
            job=job,
            team_id=job.team_id,
        )
        _push_state(job)
    return bool(updated)


# --- the claim -----------------------------------------------------------------------------


def _master_port(master: Node, attempt_id: int, taken: set[int]) -> int:
    """A rendezvous port on the master node that no live attempt there uses (`taken`: the
    ports of the live attempts on its address): random within [MASTER_PORT_BASE,
    +MASTER_PORT_SPAN) so that two portals on one host rarely meet either."""
    import random

    base = lockstep_setting("MASTER_PORT_BASE")
    span = max(int(lockstep_setting("MASTER_PORT_SPAN")), 1)
    rng = random.Random(f"{master.id}-{attempt_id}")
    for _ in range(100):
        port = base + rng.randrange(span)
        if port not in taken:
            return port
    return base + attempt_id % span


def adopt_unreported_checkpoints(job: Job, *, now: datetime) -> list[Checkpoint]:
    """Committed saves of ended attempts that the portal never heard of (rank 0's node was lost
    before its agent reported them): the COMMITTED marker is the proof, so record them and
    resume from the newest instead of redoing their steps."""
    from trainer.checkpoint import read_marker

    latest = latest_checkpoint(job.id)
    known = set(Checkpoint.objects.filter(job=job).values_list("path", flat=True))
    root = Path(lockstep_setting("CHECKPOINT_ROOT")).resolve() / f"job-{job.id}"
    adopted = []
    for attempt in job.attempts.filter(ended_at__isnull=False).order_by("number"):
        directory = root / f"attempt-{attempt.number}"
        if not directory.is_dir():
            continue
        for step_dir in sorted(directory.glob("step-*")):
            marker = read_marker(step_dir)
            if marker is None or str(step_dir) in known:
                continue
            step = int(marker.get("step", 0))
            if latest is not None and step <= latest.step:
                continue
            size = sum(f.stat().st_size for f in step_dir.rglob("*") if f.is_file())
            checkpoint = Checkpoint.objects.create(
                job=job,
                attempt=attempt,
                step=step,
                path=str(step_dir),
                bytes=size,
                created_at=now,
            )
            adopted.append(checkpoint)
            _event(
                "checkpoint.recovered",
                f"committed checkpoint at step {step} of attempt {attempt.number} found on "
                "disk (its report was lost with its node)",
                job=job,
                attempt=attempt,
                data={"step": step},
            )
    return adopted


def latest_checkpoint(job_id: int) -> Checkpoint | None:
    return (
        Checkpoint.objects.filter(job_id=job_id, deleted_at__isnull=True)
        .order_by("-step", "-id")
        .first()
    )


class ClaimConflict(Exception):
    """A batch of claims met a concurrent change after its checks: retry it in smaller batches."""


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


def allowed_sizes(job: Job) -> set[int]:
    """GPU counts an attempt of the job may have: all it asked for, or, elastic, a divisor of
    that down to min_gpus (jobs.scheduling.policy.shrink_sizes)."""
    low = job.min_gpus or job.gpus
    return {job.gpus} | {n for n in range(max(low, 1), job.gpus) if job.gpus % n == 0}


def world_size(attempt: Attempt) -> int:
    """Ranks of the attempt (attempts from before elastic jobs have world_size 0: all)."""
    return attempt.world_size or attempt.job.gpus


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
    from django.db.models import Count

    from jobs.bulk import bulk_set
    from jobs.checkpoint_policy import checkpoint_advice

    assert transaction.get_connection().in_atomic_block, "claims run inside a transaction"
    placements = list(placements)
    started: dict[int, Attempt] = {}
    rejected: dict[int, str] = {}
    if not placements:
        return started, rejected
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
    nodes = {
        n.id: n
        for n in Node.objects.filter(
            id__in={s.node_id for p in placements for s in p.slots}, state=Node.State.UP
        )
    }
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
        elif len(placement.slots) not in allowed_sizes(job):
            why = f"placement has {len(placement.slots)} GPUs, job needs {job.gpus}" + (
                f" (or, elastic, a divisor of it down to {job.min_gpus})" if job.min_gpus else ""
            )
        elif used.get(team.id, 0) + len(placement.slots) > team.gpu_cap:
            why = f"team {team.name} would exceed {team.gpu_cap} GPUs"
        elif any(slot.node_id not in nodes for slot in placement.slots):
            why = "a node of the placement is no longer up"
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
    if not accepted:
        return started, rejected

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
    Event.objects.bulk_create(
        [
            Event(
                kind="attempt.started",
                message=job.reason[:2000],
                job=job,
                attempt=attempt,
                team=team,
            )
            for (_, job, team), attempt in zip(accepted, attempts, strict=True)
        ]
        + [
            Event(
                kind="attempt.shrunk",
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
        _event(
            "preemption.claimant_started",
            f"job {job.id} started {request.reclaim_s:.0f}s after its {request.kind} of job "
            f"{request.victim_id} was decided",
            job=job,
            team=team,
            data={"request": request.id, "kind": request.kind, "reclaim_s": request.reclaim_s},
        )
    # Last, after every write that can fail: pushes queued in a savepoint that rolls back
    # would otherwise go out for jobs that did not start.
    for (_, job, _), attempt in zip(accepted, attempts, strict=True):
        _push_state(job)
        started[job.id] = attempt
    return started, rejected


# --- attempts ------------------------------------------------------------------------------


def _backoff(restart_count: int) -> float:
    base = lockstep_setting("RESTART_BACKOFF_S")
    return min(base * (2 ** max(restart_count - 1, 0)), lockstep_setting("RESTART_BACKOFF_MAX_S"))


def _early_failures(job: Job, limit: int) -> list[Attempt]:
    """The job's latest ended attempts if the last `limit` all failed before their first step."""
    recent = list(job.attempts.filter(ended_at__isnull=False).order_by("-number")[:limit])
    if len(recent) < limit or any(
        a.state != Attempt.State.FAILED or a.first_step_at is not None for a in recent
    ):
        return []
    return recent


def do_end_attempt(
    attempt: Attempt,
    *,
    state: str,
    reason: str,
    now: datetime,
    failed_at: datetime | None = None,
    blame_node: Node | None = None,
    data: dict | None = None,
) -> Attempt:
    """End a live attempt, release its GPUs, and move the job on (restart, finish or fail).

    `failed_at` is when the failure happened (for a hang: the last progress; for a lost node:
    its last heartbeat), so time to detect = now - failed_at. `blame_node` is the node the
    failure is attributed to: it gets a strike, unless the attempt never made a step (then the
    job's own code is the likelier cause).
    """
    with transaction.atomic():
        attempt = Attempt.objects.select_for_update(no_key=True).get(pk=attempt.pk)
        if attempt.ended_at is not None:
            return attempt
        was_stopping = attempt.state == Attempt.State.STOPPING
        failure = state in (Attempt.State.FAILED, Attempt.State.LOST)
        attempt.state = state
        attempt.ended_at = now
        attempt.end_reason = reason
        attempt.failed_at = (failed_at or now) if failure else None
        attempt.save(update_fields=["state", "ended_at", "end_reason", "failed_at"])
        Allocation.objects.filter(attempt=attempt, released_at__isnull=True).update(released_at=now)
        job = Job.objects.select_for_update(no_key=True).get(pk=attempt.job_id)
        _event(
            f"attempt.{state}",
            f"attempt {attempt.number} {state}: {reason}",
            job=job,
            attempt=attempt,
            node=blame_node,
            team_id=job.team_id,
            data={
                **(data or {}),
                "detect_s": round((now - attempt.failed_at).total_seconds(), 3)
                if attempt.failed_at
                else None,
                "last_step": attempt.last_step,
            },
        )
        if blame_node is not None and (
            attempt.first_step_at is not None or state == Attempt.State.LOST
        ):
            _strike(
                blame_node,
                f"job {job.id} attempt {attempt.number}: {reason}",
                now=now,
                attempt=attempt,
            )
        early = (
            _early_failures(job, lockstep_setting("EARLY_FAILURES_USER_ERROR"))
            if state == Attempt.State.FAILED
            else []
        )
        if job.is_terminal:
            pass  # cancelled while running: the job already says so
        elif state == Attempt.State.SUCCEEDED:
            job.state, job.reason, job.finished_at = Job.State.SUCCEEDED, "finished", now
            _event(
                "job.succeeded",
                f"succeeded after {attempt.number} attempt(s)",
                job=job,
                team_id=job.team_id,
            )
        elif state == Attempt.State.PREEMPTED or (was_stopping and state != Attempt.State.FAILED):
            job.state = Job.State.QUEUED
            job.reason = (
                f"requeued: {reason}"
                if reason.startswith(GROW_REASON)
                else f"requeued after preemption: {reason}"
            )
        elif early:
            # Several attempts in a row died before their first step: the job's command,
            # image or data is the likelier cause than the hardware; stop burning restarts.
            job.state, job.finished_at = Job.State.FAILED, now
            job.reason = (
                f"user error: the last {len(early)} attempts failed before their first step; "
                f"last: {reason}"
            )
            _event(
                "job.failed",
                job.reason,
                job=job,
                team_id=job.team_id,
                data={"class": "user_error"},
            )
        elif job.restart_count < job.max_restarts:
            job.restart_count += 1
            delay = _backoff(job.restart_count)
            job.state = Job.State.RESTARTING
            job.restart_after = now + timedelta(seconds=delay)
            checkpoint = latest_checkpoint(job.id)
            job.reason = (
                f"{reason}; restart {job.restart_count}/{job.max_restarts} in {delay:.0f}s from "
                + (f"checkpoint at step {checkpoint.step}" if checkpoint else "step 0")
            )
            _event("job.restarting", job.reason, job=job, team_id=job.team_id)
        else:
            job.state, job.finished_at = Job.State.FAILED, now
            job.reason = f"{reason}; no restarts left ({job.max_restarts} used)"
            _event("job.failed", job.reason, job=job, team_id=job.team_id)
        job.save(update_fields=["state", "reason", "restart_count", "restart_after", "finished_at"])
        _push_state(job)
        _wake("attempt ended")
        return attempt


@transaction.atomic
def do_mark_attempt_running(attempt: Attempt, *, now: datetime) -> None:
    if not Attempt.objects.filter(pk=attempt.pk, state=Attempt.State.STARTING).update(
        state=Attempt.State.RUNNING, running_at=now
    ):
        return
    job = Job.objects.get(pk=attempt.job_id)
    if job.state == Job.State.STARTING:
        job.state = Job.State.RUNNING
        job.reason = f"attempt {attempt.number} running, all {world_size(attempt)} ranks up"
        job.save(update_fields=["state", "reason"])
        _push_state(job)
    _event(
        "attempt.running",
        f"attempt {attempt.number}: all {world_size(attempt)} ranks up",
        job=job,
        attempt=attempt,
        team_id=job.team_id,
    )


def stopped_state(job: Job) -> str:
    """How a checkpoint-and-stop ends: the job was ended (cancel, time limit) or preempted."""
    return Attempt.State.CANCELLED if job.is_terminal else Attempt.State.PREEMPTED


# Exits this close together are one event seen at slightly different moments (agents poll their
# workers every 0.25 s and report on their own heartbeats).
SIMULTANEOUS_EXITS_S = 1.0


def _culprit(failed: list[Allocation]) -> Allocation:
    """The rank to blame among those that failed: among the first exits, one killed by a signal
    (SIGKILL, a segfault, the OOM killer) before one that exited with an error code, and a code
    other than 1 before 1: when a rank dies, the others' collectives break and they raise and
    exit 1 a moment later, often within the same poll of their agent."""
    first = min(a.exited_at for a in failed)
    near = [a for a in failed if (a.exited_at - first).total_seconds() <= SIMULTANEOUS_EXITS_S]
    return min(near, key=lambda a: (a.exit_code >= 0, a.exit_code == 1, a.exited_at, a.rank))


# How long after a failed attempt ended the other nodes' reports of its exits may still change
# which rank it blames (a few heartbeats).
REVISE_CAUSE_S = 30.0


def _failure_reason(allocation: Allocation) -> str:
    return (
        f"rank {allocation.rank} on {allocation.node.name} exited with "
        f"{describe_exit(allocation.exit_code)}"
    )


def _revise_cause(attempt: Attempt, node: Node, report: dict, *, now: datetime) -> None:
    """An attempt ends on the first report of a failed rank, so that the rest of the gang is
    stopped at once. That report may come from a rank that only exited because its peer on
    another node died (its collective broke) a moment earlier: when that node's report arrives
    just after, with the real cause, the attempt's reason (and the job's) name it instead, and
    an Event says so. Nothing else about the ended attempt changes."""
    if attempt.ended_at is None or (now - attempt.ended_at).total_seconds() > REVISE_CAUSE_S:
        return
    mine = {a.rank: a for a in attempt.allocations.filter(node=node, exit_code__isnull=True)}
    for item in report.get("ranks") or []:
        allocation = mine.get(item.get("rank"))
        if allocation is None or item.get("state") != "exited" or item.get("exit_code") is None:
            continue
        allocation.exit_code = int(item["exit_code"])
        allocation.exited_at = _agent_time(item.get("exited_at"), now)
        allocation.save(update_fields=["exit_code", "exited_at"])
    # Exits after the attempt ended are the fencing's doing (its ranks killed), not a cause.
    failed = [
        a
        for a in attempt.allocations.select_related("node")
        if a.exit_code not in (None, 0)
        and a.exited_at is not None
        and a.exited_at <= attempt.ended_at
    ]
    if not failed or not attempt.end_reason.startswith("rank "):
        return  # a hang or a lost node: not an exit to re-attribute
    reason = _failure_reason(_culprit(failed))
    if reason == attempt.end_reason:
        return
    old = attempt.end_reason
    Attempt.objects.filter(pk=attempt.pk).update(end_reason=reason)
    job = Job.objects.select_for_update(no_key=True).get(pk=attempt.job_id)
    if job.reason.startswith(old):
        job.reason = reason + job.reason[len(old) :]
        job.save(update_fields=["reason"])
    _event(
        "attempt.cause_revised",
        f"attempt {attempt.number}: {reason} (first reported: {old})",
        job=job,
        attempt=attempt,
        node=node,
        team_id=job.team_id,
    )
    # After this heartbeat commits, in a transaction of its own: it writes rows that point at
    # the first node, whose own heartbeat may hold that node's lock while it waits for this
    # attempt's (a deadlock on PostgreSQL if done here).
    culprit_id, attempt_id = _culprit(failed).node_id, attempt.id
    transaction.on_commit(lambda: _move_strike(attempt_id, culprit_id, reason, now=now))


def _move_strike(attempt_id: int, culprit_id: int, reason: str, *, now: datetime) -> None:
    """The strike for an attempt's end follows a revised cause to the culprit's node: the
    node first blamed only saw its rank die of the broken collective. If that strike had
    cordoned the node automatically and the node is now under the limit, it is back up."""
    with transaction.atomic():
        strike = (
            Event.objects.filter(kind="node.strike", attempt_id=attempt_id, data__attempt_end=True)
            .order_by("-id")
            .first()
        )
        if strike is None or strike.node_id == culprit_id:
            return
        attempt = Attempt.objects.get(pk=attempt_id)
        first = Node.objects.select_for_update(no_key=True).get(pk=strike.node_id)
        _event(
            "node.strike_withdrawn",
            f"strike on {first.name} withdrawn: job {attempt.job_id} attempt "
            f"{attempt.number} failed because of {reason}",
            node=first,
            attempt=attempt,
            data={"strike": strike.id},
        )
        last_cordon = Event.objects.filter(node=first, kind="node.cordoned").order_by("-id").first()
        if (
            first.state == Node.State.CORDONED
            and last_cordon is not None
            and last_cordon.id > strike.id
            and last_cordon.data.get("automatic")
            and node_strikes(first, now) < lockstep_setting("STRIKES_TO_CORDON")
        ):
            first.state, first.state_reason = Node.State.UP, ""
            first.save(update_fields=["state", "state_reason"])
            _event(
                "node.uncordoned",
                f"node {first.name} uncordoned automatically: the strike that cordoned it "
                "was withdrawn",
                node=first,
                data={"automatic": True},
            )
            _wake("node uncordoned")
        _strike(
            Node.objects.select_for_update(no_key=True).get(pk=culprit_id),
            f"job {attempt.job_id} attempt {attempt.number}: {reason}",
            now=now,
            attempt=attempt,
        )


def _record_exits(
    attempt: Attempt, node: Node, exits: dict[int, tuple[int, datetime]], *, now: datetime
) -> None:
    """Apply reported rank exits (code, when the agent saw it) and end the attempt when the
    gang's fate is known. The first rank to die is blamed: the others usually die after it,
    of a broken collective."""
    allocations = list(attempt.allocations.select_related("node"))
    mine = {a.rank: a for a in allocations if a.node_id == node.id}
    for rank, (code, exited_at) in exits.items():
        allocation = mine.get(rank)
        if allocation is None or allocation.exit_code is not None:
            continue
        allocation.exit_code, allocation.exited_at = code, min(exited_at, now)
        allocation.save(update_fields=["exit_code", "exited_at"])
        _event(
            "rank.exited",
            f"rank {rank} on {node.name} ended with {describe_exit(code)}",
            job_id=attempt.job_id,
            attempt=attempt,
            node=node,
            data={"rank": rank, "exit_code": code},
        )
    codes = [a.exit_code for a in allocations]
    failed = [a for a in allocations if a.exit_code not in (None, 0)]
    if attempt.state == Attempt.State.STOPPING:
        if all(c is not None for c in codes):
            do_end_attempt(
                attempt,
                state=stopped_state(attempt.job),
                reason=attempt.end_reason or "stopped",
                now=now,
            )
    elif failed:
        first = _culprit(failed)
        do_end_attempt(
            attempt,
            state=Attempt.State.FAILED,
            now=now,
            failed_at=first.exited_at,
            blame_node=first.node,
            reason=_failure_reason(first),
        )
    elif all(c == 0 for c in codes):
        do_end_attempt(attempt, state=Attempt.State.SUCCEEDED, reason="all ranks exited 0", now=now)


# --- checkpoints, metrics, logs ------------------------------------------------------------


def _record_checkpoint(attempt: Attempt, record: dict, *, now: datetime) -> Checkpoint | None:
    path = str(record.get("path", ""))
    root = Path(lockstep_setting("CHECKPOINT_ROOT")).resolve()
    job_dir = root / f"job-{attempt.job_id}"
    resolved = Path(path).resolve()
    # Only paths inside the job's own checkpoint directory, and only committed saves.
    if not resolved.is_relative_to(job_dir) or not (resolved / "COMMITTED").exists():
        log.warning("ignoring checkpoint record outside %s or uncommitted: %s", job_dir, path)
        return None
    if not 0 <= int(record["step"]) <= MAX_COUNTER or not 0 <= int(record.get("bytes", 0)) < 2**63:
        raise ValueError(f"checkpoint step or size out of range: {record}")
    checkpoint, created = Checkpoint.objects.get_or_create(
        job_id=attempt.job_id,
        path=str(resolved),
        defaults={
            "attempt": attempt,
            "preemption": attempt.state == Attempt.State.STOPPING,
            "step": int(record["step"]),
            "bytes": int(record.get("bytes", 0)),
            "save_s": float(record.get("save_s", 0)),
            "created_at": now,
        },
    )
    if created:
        _event(
            "checkpoint.committed",
            f"checkpoint at step {checkpoint.step} ({filesizeformat(checkpoint.bytes)}, "
            f"saved in {checkpoint.save_s:.2f}s)",
            job_id=attempt.job_id,
            attempt=attempt,
            data={"step": checkpoint.step},
        )
        on_commit_send(
            attempt.job_id, {"type": "checkpoint", "step": checkpoint.step, "id": checkpoint.id}
        )
        from jobs.tasks import enqueue_prune

        enqueue_prune(attempt.job_id)
    return checkpoint


class _Point(NamedTuple):
    """A metric point on its way in: what `rollup.record` reads, without a model instance."""

    rank: int
    step: int
    name: str
    value: float
    time: datetime


def _insert_points(job_id: int, attempt_id: int, points: list[_Point]) -> None:
    """Plain tuples, inserted in bulk (jobs.bulk_sql): `bulk_create` spent most of a
    heartbeat's CPU building a model instance per point (the portal's share of the platform
    overhead, docs/training-benchmarks.md); the values here are already typed and checked."""
    adapt_time = connection.ops.adapt_datetimefield_value
    insert_rows(
        MetricPoint,
        ("job_id", "attempt_id", "rank", "step", "name", "value", "time"),
        [(job_id, attempt_id, p.rank, p.step, p.name, p.value, adapt_time(p.time)) for p in points],
    )


def _ingest_records(attempt: Attempt, records: list, *, now: datetime) -> list[dict]:
    points, pushed = [], []
    for record in records:
        if not isinstance(record, dict):
            continue
        kind = record.get("kind")
        try:
            rank = int(record.get("rank", 0))
            if not 0 <= rank <= MAX_COUNTER:
                raise ValueError(f"rank {rank} out of range")
            if kind == "step":
                step = int(record["step"])
                if not 0 <= step <= MAX_COUNTER:
                    raise ValueError(f"step {step} out of range")
                when = datetime.fromtimestamp(
                    float(record.get("time", now.timestamp())), now.tzinfo
                )
                for name in STEP_METRICS:
                    if isinstance(record.get(name), int | float):
                        value = float(record[name])
                        points.append(_Point(rank, step, name, value, when))
                        pushed.append(
                            {
                                "rank": rank,
                                "step": step,
                                "name": name,
                                "value": value,
                                "attempt": attempt.number,
                            }
                        )
                attempt.last_step = max(attempt.last_step, step)
            elif kind == "checkpoint":
                _record_checkpoint(attempt, record, now=now)
            elif kind == "start" and rank == 0:
                _event(
                    "attempt.trainer_started",
                    f"trainer up: world size {record.get('world_size')}"
                    + (f" on {record['device']}" if record.get("device") else "")
                    + f", resumed from step {record.get('resumed_from_step', 0)}",
                    job_id=attempt.job_id,
                    attempt=attempt,
                )
            elif kind == "end" and rank == 0:
                _event(
                    "attempt.trainer_ended",
                    f"trainer ended at step {record.get('step')}: {record.get('reason')}",
                    job_id=attempt.job_id,
                    attempt=attempt,
                )
        except (KeyError, TypeError, ValueError, OverflowError, OSError) as exc:
            # OverflowError, OSError: a timestamp out of the platform's range.
            log.warning("bad metric record from attempt %s: %s (%s)", attempt.id, record, exc)
    if points:
        # Delivery is at least once: a heartbeat the portal committed but whose answer the
        # agent never got (the portal restarted in between) is sent again. A step of one rank
        # is stored once per attempt; the attempt's row lock keeps two heartbeats from racing.
        stored = set(
            MetricPoint.objects.filter(
                job_id=attempt.job_id,
                name__in=STEP_METRICS,
                step__in={p.step for p in points},
                attempt=attempt,
            ).values_list("rank", "step", "name")
        )
        if stored:
            points = [p for p in points if (p.rank, p.step, p.name) not in stored]
            pushed = [p for p in pushed if (p["rank"], p["step"], p["name"]) not in stored]
    if points:
        _insert_points(attempt.job_id, attempt.id, points)
        rollup.record(attempt.job_id, points)
        # Progress is what the hang detector watches: the portal's clock, not the workers'.
        attempt.last_progress_at = now
        attempt.first_step_at = attempt.first_step_at or now
        Attempt.objects.filter(pk=attempt.pk).update(
            last_step=attempt.last_step,
            last_progress_at=now,
            first_step_at=attempt.first_step_at,
        )
    return pushed


# --- nodes and agents ----------------------------------------------------------------------


@transaction.atomic
def do_register_node(
    *,
    name: str,
    gpus: int,
    address: str,
    hostname: str = "",
    rack: str = "default",
    gpu_kind: str = "cpu",
    boot_id: str = "",
    killed_orphans: int = 0,
    now: datetime,
) -> tuple[Node, str]:
    """Create or re-bind a node; returns it with a fresh node token (shown once)."""
    raw = "node_" + secrets.token_urlsafe(32)
    node = Node.objects.select_for_update(no_key=True).filter(name=name).first()
    if node is None:
        node = Node.objects.create(
            name=name,
            address=address,
            hostname=hostname,
            rack=rack,
            gpu_kind=gpu_kind,
            token_digest=token_digest(raw),
            boot_id=boot_id,
            registered_at=now,
            last_heartbeat_at=now,
        )
        _event("node.registered", f"node {name} registered with {gpus} {gpu_kind} GPUs", node=node)
    else:
        # A new boot means the agent restarted: any workers it had are gone (it kills them on
        # exit, and fencing kills leftovers), so attempts placed here cannot go on.
        if node.boot_id != boot_id:
            for attempt in Attempt.objects.filter(
                ended_at__isnull=True, allocations__node=node
            ).distinct():
                do_end_attempt(
                    attempt,
                    state=Attempt.State.LOST,
                    now=now,
                    failed_at=node.last_heartbeat_at,
                    blame_node=node,
                    reason=f"agent on {name} restarted; it killed {killed_orphans} worker(s) "
                    "left by its previous process (workers are not re-adopted)",
                )
        was_down = node.state == Node.State.DOWN
        node.address, node.hostname, node.rack, node.gpu_kind = address, hostname, rack, gpu_kind
        node.token_digest, node.boot_id = token_digest(raw), boot_id
        node.registered_at = node.last_heartbeat_at = now
        if was_down:
            node.state, node.state_reason = Node.State.UP, ""
        node.save()
        _event(
            "node.reregistered",
            f"node {name} re-registered ({gpus} GPUs)"
            + ("; back up" if was_down else "")
            + (
                f"; its agent killed {killed_orphans} orphaned worker(s) on start"
                if killed_orphans
                else ""
            ),
            node=node,
            data={"killed_orphans": killed_orphans},
        )
    existing = set(node.gpus.values_list("index", flat=True))
    GPU.objects.bulk_create([GPU(node=node, index=i) for i in range(gpus) if i not in existing])
    # GPUs the node no longer reports are removed only when free.
    node.gpus.filter(index__gte=gpus).exclude(allocations__released_at__isnull=True).delete()
    _wake("node registered")
    return node, raw


def launch_spec(attempt: Attempt, node: Node) -> dict:
    job = attempt.job
    allocations = [a for a in attempt.allocations.all() if a.node_id == node.id]
    group_ranks = {a.group_rank for a in attempt.allocations.all()}
    # One directory per attempt: a zombie worker of an earlier attempt (on a node declared lost
    # but still running) can never write into, or mix files with, the live attempt's saves.
    checkpoint_dir = (
        Path(lockstep_setting("CHECKPOINT_ROOT")).resolve()
        / f"job-{job.id}"
        / f"attempt-{attempt.number}"
    )
    return {
        "job_id": job.id,
        "attempt": attempt.number,
        "command": list(job.command),
        # The job's checkpoint interval rides in the env the trainer reads (users may not set
        # LOCKSTEP_* themselves, so this cannot be overridden by job.env).
        "env": {
            **job.env,
            **(
                {"LOCKSTEP_CHECKPOINT_INTERVAL_S": str(attempt.checkpoint_interval_s)}
                if attempt.checkpoint_interval_s
                else {}
            ),
        },
        "world_size": world_size(attempt),
        # The size the job asked for: an elastic attempt on fewer GPUs keeps the global batch
        # of that size (the trainer accumulates gradients).
        "job_gpus": job.gpus,
        "local_world_size": len(allocations),
        "group_rank": allocations[0].group_rank if allocations else 0,
        "group_world_size": len(group_ranks),
        "master_addr": attempt.master_addr,
        "master_port": attempt.master_port,
        "run_id": f"job{job.id}-attempt{attempt.number}",
        "restart_count": attempt.number - 1,
        "max_restarts": job.max_restarts,
        "checkpoint_dir": str(checkpoint_dir),
        "resume_from": attempt.resumed_from.path if attempt.resumed_from else "",
        "dataset": job.dataset,
        "ranks": [
            {"rank": a.rank, "local_rank": a.local_rank, "gpu_index": a.gpu.index}
            for a in sorted(allocations, key=lambda a: a.rank)
        ],
    }


def desired_for_node(node: Node, now: datetime) -> list[dict]:
    desired = []
    attempts = (
        Attempt.objects.filter(ended_at__isnull=True, allocations__node=node)
        .distinct()
        .select_related("job", "resumed_from")
        .prefetch_related("allocations__gpu")
    )
    for attempt in attempts:
        if attempt.dump_requested_at is not None and attempt.state != Attempt.State.STOPPING:
            desired.append({"attempt_id": attempt.id, "action": "dump"})
        elif attempt.state == Attempt.State.STOPPING:
            remaining = max((attempt.stop_deadline - now).total_seconds(), 0.0)
            desired.append({"attempt_id": attempt.id, "action": "stop", "deadline_s": remaining})
        else:
            desired.append(
                {"attempt_id": attempt.id, "action": "run", "launch": launch_spec(attempt, node)}
            )
    return desired


def _agent_time(value, now: datetime) -> datetime:
    """An agent's wall-clock timestamp, trusted only if plausible (clocks drift)."""
    # Compared as numbers first: fromtimestamp() raises on values out of the platform's range.
    if isinstance(value, int | float) and now.timestamp() - 3600 <= value <= now.timestamp():
        return datetime.fromtimestamp(value, now.tzinfo)
    return now


def _report_order(report) -> int:
    attempt_id = report.get("attempt_id") if isinstance(report, dict) else None
    return attempt_id if isinstance(attempt_id, int) else -1


def do_heartbeat(node: Node, body: dict, *, now: datetime) -> dict:
    """Apply one agent heartbeat; returns the response (what should run on the node)."""
    acked = []
    with transaction.atomic():
        node = Node.objects.select_for_update(no_key=True).get(pk=node.pk)
        if node.state == Node.State.DOWN:
            node.state, node.state_reason = Node.State.UP, ""
            _event("node.up", f"node {node.name} is back (heartbeat resumed)", node=node)
            _wake("node up")
        node.last_heartbeat_at = now
        node.telemetry = body.get("telemetry") or []
        node.save(update_fields=["state", "state_reason", "last_heartbeat_at", "telemetry"])

        # In attempt id order, so two heartbeats lock shared attempts in one order (no deadlock).
        for report in sorted(body.get("attempts") or [], key=_report_order):
            attempt_id = report.get("attempt_id")
            # Locked: the nodes of one gang report at the same moment (every rank exits at
            # the end, or on a stop), each in its own transaction. Unlocked, on PostgreSQL each
            # saw the other nodes' ranks still running and none ended the attempt (or marked it
            # RUNNING), leaving it to the stop deadline or the start timeout.
            attempt = (
                Attempt.objects.select_for_update(of=("self",), no_key=True)
                .select_related("job")
                .filter(pk=attempt_id)
                .first()
                if isinstance(attempt_id, int)
                else None
            )
            if (
                attempt is None
                or attempt.ended_at is not None
                or not attempt.allocations.filter(node=node).exists()
            ):
                # Fencing on the portal side: reports from attempts that are no longer live
                # (or never were on this node) change nothing, except the cause of a failure
                # just ended on another node's report (`_revise_cause`).
                if attempt is not None and attempt.state == Attempt.State.FAILED:
                    _revise_cause(attempt, node, report, now=now)
                acked.append(attempt_id)
                continue
            pushed = _ingest_records(attempt, report.get("records") or [], now=now)
            chunks = [
                LogChunk(
                    attempt=attempt,
                    rank=int(item["rank"]),
                    # A worker may print NUL characters; PostgreSQL text cannot store them.
                    text=str(item["text"]).replace("\x00", "\ufffd"),
                    created_at=now,
                )
                for item in report.get("logs") or []
                if isinstance(item, dict) and item.get("text")
            ]
            LogChunk.objects.bulk_create(chunks)
            ranks = report.get("ranks") or []
            started = [int(r["rank"]) for r in ranks if r.get("state") in ("running", "exited")]
            if started:
                attempt.allocations.filter(
                    node=node, rank__in=started, started_at__isnull=True
                ).update(started_at=now)
                if (
                    attempt.state == Attempt.State.STARTING
                    and not attempt.allocations.filter(started_at__isnull=True).exists()
                ):
                    do_mark_attempt_running(attempt, now=now)
                    attempt.refresh_from_db()
            exits = {
                int(r["rank"]): (int(r["exit_code"]), _agent_time(r.get("exited_at"), now))
                for r in ranks
                if r.get("state") == "exited" and r.get("exit_code") is not None
            }
            if exits:
                _record_exits(attempt, node, exits, now=now)
            if pushed:
                on_commit_send(attempt.job_id, {"type": "metrics", "points": pushed})
            for chunk in chunks:
                on_commit_send(
                    attempt.job_id,
                    {
                        "type": "log",
                        "rank": chunk.rank,
                        "attempt": attempt.number,
                        "text": chunk.text,
                    },
                )
        _sample_gpus(node, now)
    return {
        "heartbeat_s": lockstep_setting("HEARTBEAT_S"),
        "desired": desired_for_node(node, now),
        "acked": acked,
    }


def _reading_number(value, kind=float):
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = kind(value)
    except (OverflowError, ValueError):  # inf, nan as an int
        return None
    return number if number == number and abs(number) < 2**62 else None


def _sample_gpus(node: Node, now: datetime) -> None:
    """Keep the node's latest telemetry for every rank of a live attempt on it, at most every
    GPU_SAMPLE_S: the heartbeat's readings are otherwise overwritten by the next one. One
    sample per rank per period whatever the heartbeat rate (4,096 GPUs: ~410 rows a second
    at the default 10 s)."""
    every = lockstep_setting("GPU_SAMPLE_S")
    last = node.telemetry_sampled_at
    if not every or (last is not None and (now - last).total_seconds() < every):
        return
    readings = {
        reading.get("index"): reading for reading in node.telemetry if isinstance(reading, dict)
    }
    allocations = Allocation.objects.filter(
        node=node, started_at__isnull=False, released_at__isnull=True, attempt__ended_at=None
    ).values_list("attempt__job_id", "attempt_id", "rank", "gpu__index")
    samples = [
        GpuSample(
            job_id=job_id,
            attempt_id=attempt_id,
            rank=rank,
            t=int(now.timestamp()),
            util=_reading_number(reading.get("util")),
            mem_used=_reading_number(reading.get("mem_used"), int),
            mem_total=_reading_number(reading.get("mem_total"), int),
        )
        for job_id, attempt_id, rank, index in allocations
        if (reading := readings.get(index)) is not None
    ]
    GpuSample.objects.bulk_create(samples)
    Node.objects.filter(pk=node.pk).update(telemetry_sampled_at=now)


@transaction.atomic
def do_mark_node_lost(node: Node, *, now: datetime, reason: str) -> None:
    node = Node.objects.select_for_update(no_key=True).get(pk=node.pk)
    if node.state == Node.State.DOWN:
        return
    node.state, node.state_reason = Node.State.DOWN, reason
    node.save(update_fields=["state", "state_reason"])
    _event("node.down", f"node {node.name} down: {reason}", node=node)
    for attempt in Attempt.objects.filter(ended_at__isnull=True, allocations__node=node).distinct():
        do_end_attempt(
            attempt,
            state=Attempt.State.LOST,
            now=now,
            reason=f"node {node.name} lost ({reason})",
            failed_at=node.last_heartbeat_at,
            blame_node=node,
        )
    _wake("node down")


def node_strikes(node: Node, now: datetime) -> int:
    """Strikes against the node in the window, less those withdrawn (`_move_strike`)."""
    window = now - timedelta(seconds=lockstep_setting("STRIKE_WINDOW_S"))
    withdrawn = {
        int(ref)
        for ref in Event.objects.filter(
            node=node, kind="node.strike_withdrawn", created_at__gte=window
        ).values_list("data__strike", flat=True)
        if ref is not None
    }
    strikes = Event.objects.filter(node=node, kind="node.strike", created_at__gte=window)
    return strikes.exclude(id__in=withdrawn).count()


def _strike(node: Node, reason: str, *, now: datetime, attempt: Attempt | None = None) -> None:
    """Attribute a failure to a node; enough strikes in the window cordon it for admins.
    `attempt`: the attempt whose end is blamed on the node (a strike `_move_strike` can move
    when the cause is revised)."""
    _event(
        "node.strike",
        f"strike on {node.name}: {reason}",
        node=node,
        attempt=attempt,
        data={"attempt_end": attempt is not None},
    )
    strikes = node_strikes(node, now)
    limit = lockstep_setting("STRIKES_TO_CORDON")
    if strikes < limit:
        return
    hours = lockstep_setting("STRIKE_WINDOW_S") / 3600
    why = f"{strikes} failures in {hours:.0f}h; an admin should check it"
    # Conditional: the caller's Node may be stale (another transaction set it down or
    # draining meanwhile); only a node that is up is cordoned.
    if Node.objects.filter(pk=node.pk, state=Node.State.UP).update(
        state=Node.State.CORDONED, state_reason=why
    ):
        node.state, node.state_reason = Node.State.CORDONED, why
        _event(
            "node.cordoned",
            f"node {node.name} cordoned automatically: {node.state_reason}",
            node=node,
            data={"strikes": strikes, "automatic": True},
        )


@transaction.atomic
def do_cordon_node(node: Node, *, actor, reason: str, drain: bool = False, now: datetime) -> Node:
    """No new work on the node; with `drain`, its attempts also checkpoint, stop and requeue."""
    node = Node.objects.select_for_update(no_key=True).get(pk=node.pk)
    node.state = Node.State.DRAINING if drain else Node.State.CORDONED
    node.state_reason = reason
    node.save(update_fields=["state", "state_reason"])
    _event(
        f"node.{node.state}",
        f"node {node.name} {node.state} by {actor}: {reason}",
        node=node,
        actor=actor,
    )
    if drain:
        for attempt in Attempt.objects.filter(
            ended_at__isnull=True, allocations__node=node
        ).distinct():
            _begin_stop(attempt, now=now, reason=f"node {node.name} draining: {reason}")
    _wake("node cordoned")
    return node


@transaction.atomic
def do_uncordon_node(node: Node, *, actor, reason: str = "") -> Node:
    node = Node.objects.select_for_update(no_key=True).get(pk=node.pk)
    if node.state == Node.State.DOWN:
        return node  # it comes back up with its next heartbeat
    node.state, node.state_reason = Node.State.UP, ""
    node.save(update_fields=["state", "state_reason"])
    _event(
        "node.uncordoned",
        f"node {node.name} uncordoned by {actor}" + (f": {reason}" if reason else ""),
        node=node,
        actor=actor,
    )
    _wake("node uncordoned")
    return node


# --- hangs and stragglers ------------------------------------------------------------------


@transaction.atomic
def do_request_stack_dump(attempt: Attempt, *, reason: str, now: datetime) -> bool:
    """A hang was seen: ask the agents for every rank's stacks before the attempt is killed."""
    if not Attempt.objects.filter(
        pk=attempt.pk, ended_at__isnull=True, dump_requested_at__isnull=True
    ).update(dump_requested_at=now, end_reason=reason):
        return False
    _event(
        "attempt.hang_detected",
        f"attempt {attempt.number}: {reason}; capturing stacks before restart",
        job_id=attempt.job_id,
        attempt=attempt,
        data={"last_step": attempt.last_step},
    )
    return True


def stacks_since(attempt: Attempt, since: datetime, *, limit: int = 20_000) -> dict[str, str]:
    """Per rank, the stack dumps (faulthandler's output) shipped in the logs since `since`."""
    by_rank: dict[int, list[str]] = {}
    for rank, text in LogChunk.objects.filter(attempt=attempt, created_at__gte=since).values_list(
        "rank", "text"
    ):
        by_rank.setdefault(rank, []).append(text)
    stacks = {}
    for rank, parts in sorted(by_rank.items()):
        text = "".join(parts)
        start = min(
            (i for i in (text.find("Thread 0x"), text.find("Current thread")) if i >= 0),
            default=-1,
        )
        if start >= 0:
            stacks[str(rank)] = text[start:][:limit]
    return stacks


def do_end_hung_attempt(attempt: Attempt, *, now: datetime) -> Attempt:
    stacks = stacks_since(attempt, attempt.dump_requested_at)
    reason = attempt.end_reason or "hung"
    # A rank that could not even dump its stacks (stopped, stuck in the kernel) is the likely
    # culprit: when such ranks sit on one node, that node takes the strike.
    silent = attempt.allocations.exclude(rank__in=[int(r) for r in stacks]).select_related("node")
    silent_nodes = {a.node for a in silent}
    blame = silent_nodes.pop() if stacks and len(silent_nodes) == 1 else None
    silent_ranks = sorted(a.rank for a in silent)
    if stacks and silent_ranks:
        reason += f"; no stacks from rank(s) {', '.join(map(str, silent_ranks))}"
    return do_end_attempt(
        attempt,
        state=Attempt.State.FAILED,
        now=now,
        reason=f"{reason} (stacks from {len(stacks)} of {world_size(attempt)} ranks)",
        failed_at=attempt.last_progress_at or attempt.running_at,
        blame_node=blame,
        data={"stacks": stacks, "silent_ranks": silent_ranks},
    )


@transaction.atomic
def do_flag_straggler(
    attempt: Attempt,
    *,
    rank: int,
    node: Node,
    seconds: float,
    gang_seconds: float,
    window: int,
    now: datetime,
) -> None:
    attempt = Attempt.objects.select_for_update(no_key=True).get(pk=attempt.pk)
    if rank in attempt.stragglers:
        return
    attempt.stragglers = [*attempt.stragglers, rank]
    attempt.save(update_fields=["stragglers"])
    message = (
        f"rank {rank} on {node.name} is a straggler: {seconds * 1000:.0f} ms/step of compute "
        f"vs {gang_seconds * 1000:.0f} ms for the rest of the gang (median, last {window} steps)"
    )
    _event(
        "attempt.straggler",
        message,
        job_id=attempt.job_id,
        attempt=attempt,
        node=node,
        data={"rank": rank, "compute_s": seconds, "gang_compute_s": gang_seconds},
    )
    _strike(node, f"job {attempt.job_id}: {message}", now=now)


# --- preemption ---------------------------------------------------------------------------


def do_propose_preemption(
    *, victim_id: int, claimant_id: int, kind: str, reason: str, now: datetime
) -> PreemptionRequest | None:
    """Record a planned preemption; reclaims and starvation claims are approved and carried
    out at once, priority preemptions wait for an admin or for their auto-approve deadline.
    None if the victim already has an open request or is no longer running."""
    with transaction.atomic():
        victim, _ = _lock_job_for_stop(victim_id)
        if victim.state not in (Job.State.STARTING, Job.State.RUNNING):
            return None
        if PreemptionRequest.objects.filter(
            victim=victim, state__in=PreemptionRequest.OPEN
        ).exists():
            return None
        since = (
            latest_checkpoint(victim.id).created_at
            if latest_checkpoint(victim.id)
            else (victim.first_started_at or now)
        )
        request = PreemptionRequest.objects.create(
            victim=victim,
            claimant_id=claimant_id,
            kind=kind,
            reason=reason[:500],
            created_at=now,
            work_at_risk_s=max((now - since).total_seconds(), 0.0),
            auto_approve_at=None
            if kind in PreemptionRequest.AUTOMATIC
            else now + timedelta(seconds=lockstep_setting("PREEMPTION_APPROVAL_DELAY_S")),
        )
        _event(
            "preemption.proposed",
            f"{kind} preemption of job {victim.id} proposed for job {claimant_id}: {reason}",
            job=victim,
            team_id=victim.team_id,
            data={"request": request.id, "claimant": claimant_id, "kind": kind},
        )
        if kind in PreemptionRequest.AUTOMATIC:
            # Reclaims are automatic: lent GPUs go back to their owner without asking anyone;
            # so are starvation claims (they take no team below its quota).
            # In the proposal's transaction: a reclaim has no approval deadline, so one left
            # proposed (its approval a deadlock victim) would block every later proposal for
            # this victim and never be carried out. Rolled back whole, the next pass proposes
            # it again.
            do_decide_preemption(request, approve=True, actor=None, now=now)
    return request


def do_decide_preemption(
    request: PreemptionRequest, *, approve: bool, actor, now: datetime
) -> PreemptionRequest:
    with transaction.atomic():
        request = PreemptionRequest.objects.select_for_update(no_key=True).get(pk=request.pk)
        if request.state != PreemptionRequest.State.PROPOSED:
            return request
        request.state = (
            PreemptionRequest.State.APPROVED if approve else PreemptionRequest.State.REJECTED
        )
        request.decided_by, request.decided_at = actor, now
        request.save(update_fields=["state", "decided_by", "decided_at"])
        who = (
            actor.username
            if actor
            else (
                f"automatic ({request.kind})"
                if request.kind in PreemptionRequest.AUTOMATIC
                else "automatic (approval deadline passed)"
            )
        )
        _event(
            f"preemption.{request.state}",
            f"preemption of job {request.victim_id} for job {request.claimant_id} "
            f"{request.state} by {who}",
            job_id=request.victim_id,
            actor=actor,
            data={"request": request.id},
        )
        if approve:
            _execute_preemption(request, now=now)
        else:
            _wake("preemption rejected")
    return request


def _execute_preemption(request: PreemptionRequest, *, now: datetime) -> None:
    victim, attempt = _lock_job_for_stop(request.victim_id)
    request.state, request.executed_at = PreemptionRequest.State.EXECUTED, now
    request.save(update_fields=["state", "executed_at"])
    if attempt is None:
        return
    why = f"preempted ({request.kind}) for job {request.claimant_id}: {request.reason}"
    _stop_to_requeue(
        victim,
        attempt,
        why=why,
        now=now,
        kind="job.preempting",
        data={"request": request.id, "kind": request.kind},
    )


def _stop_to_requeue(
    job: Job, attempt: Attempt, *, why: str, now: datetime, kind: str, data: dict, message=None
) -> None:
    """Checkpoint-and-stop the job's live attempt; the job is requeued when it exits
    (`do_end_attempt`). `message` is the Event's text (default: the job's new reason)."""
    _begin_stop(attempt, now=now, reason=why)
    job.state, job.reason = Job.State.PREEMPTING, f"checkpointing and stopping: {why}"
    job.save(update_fields=["state", "reason"])
    _event(kind, message or job.reason, job=job, team_id=job.team_id, data=data)
    _push_state(job)


GROW_REASON = "growing back to"


def do_grow_job(*, job_id: int, gpus: int, reason: str, now: datetime) -> bool:
    """Scheduling rule 8 carried out: checkpoint-and-stop a running elastic job that runs on
    fewer GPUs than it asked for, so that it is requeued and restarts at its full size from
    that checkpoint. False (nothing changed) if it no longer runs shrunk."""
    with transaction.atomic():
        job, attempt = _lock_job_for_stop(job_id)
        if (
            job.state != Job.State.RUNNING
            or attempt is None
            or attempt.state != Attempt.State.RUNNING
            or world_size(attempt) >= job.gpus
        ):
            return False
        why = f"{GROW_REASON} {gpus} GPUs ({reason})"
        held = world_size(attempt)
        _stop_to_requeue(
            job,
            attempt,
            why=why,
            now=now,
            kind="job.growing",
            data={"from_gpus": held, "to_gpus": gpus},
            message=f"attempt {attempt.number} runs on {held} of {job.gpus} GPUs; {why}",
        )
    return True


@transaction.atomic
def do_withdraw_stale_preemptions(*, now: datetime) -> None:
    """Proposals whose claimant no longer waits (started, cancelled) are withdrawn, each with
    its Event (atomic: a crash between the two lost the Event)."""
    for request in PreemptionRequest.objects.filter(state=PreemptionRequest.State.PROPOSED).exclude(
        claimant__state=Job.State.QUEUED
    ):
        PreemptionRequest.objects.filter(pk=request.pk).update(
            state=PreemptionRequest.State.WITHDRAWN, decided_at=now
        )
        _event(
            "preemption.withdrawn",
            f"preemption of job {request.victim_id} withdrawn: "
            f"job {request.claimant_id} no longer waits",
            job_id=request.victim_id,
        )


# --- model registry ------------------------------------------------------------------------


@transaction.atomic
def do_register_model_version(
    *, name: str, checkpoint: Checkpoint, actor, now: datetime, notes: str = ""
) -> ModelVersion:
    latest = (
        ModelVersion.objects.select_for_update(no_key=True)
        .filter(name=name)
        .aggregate(v=Max("version"))["v"]
        or 0
    )
    at_step = {
        p.name: p.value
        for p in MetricPoint.objects.filter(job_id=checkpoint.job_id, step=checkpoint.step, rank=0)
    }
    version = ModelVersion.objects.create(
        name=name,
        version=latest + 1,
        checkpoint=checkpoint,
        job_id=checkpoint.job_id,
        step=checkpoint.step,
        created_by=actor,
        created_at=now,
        notes=notes,
        metrics=at_step,
    )
    _event(
        "model.registered",
        f"{name} v{version.version} registered from job {checkpoint.job_id} step {checkpoint.step}",
        job_id=checkpoint.job_id,
        actor=actor,
    )
    import django_rq

    from jobs.tasks import export_model_version

    django_rq.enqueue(export_model_version, version.id)
    return version


@transaction.atomic
def do_finish_model_export(version: ModelVersion, *, path: str | None, error: str = "") -> None:
    if path:
        version.export_state, version.export_path = ModelVersion.ExportState.READY, path
        message = f"{version} exported to {path}"
    else:
        version.export_state = ModelVersion.ExportState.FAILED
        message = f"{version} export failed: {error}"
    version.save(update_fields=["export_state", "export_path"])
    _event("model.exported", message, job_id=version.job_id)
