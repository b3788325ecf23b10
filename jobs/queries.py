"""Reads and builders over the job models that the actions, the scheduler's snapshot reader,
the agent API and the pages share: run time, the latest checkpoint, an attempt's world size and
launch spec, what should run on a node and how a stop ends. Nothing here writes."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.db.models import Count, Max, OuterRef, Q, Subquery
from django.db.models.functions import Coalesce

from jobs.conf import lockstep_setting
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
from jobs.progress import fraction, pace
from jobs.scheduling.protection import min_run_s
from jobs.validation import dataset_mounts, image_registry
from trainer.checkpoint_layout import attempt_dir


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


def job_events(job: Job):
    """A job's timeline: its own events and those about its attempts that name no job (a
    node's strike for an attempt's failure: why the job moved), oldest first.

    The attempts' ids are read first: `job_id = J OR attempt_id IN (...)` is two index scans,
    where an OR across a join to the attempts would read the whole (large) events table."""
    attempts = list(Attempt.objects.filter(job=job).values_list("id", flat=True))
    events = Event.objects.filter(Q(job=job) | Q(attempt_id__in=attempts))
    return events.select_related("node").order_by("id")


def latest_checkpoint(job_id: int) -> Checkpoint | None:
    return (
        Checkpoint.objects.filter(job_id=job_id, deleted_at__isnull=True)
        .order_by("-step", "-id")
        .first()
    )


def world_size(attempt: Attempt) -> int:
    """Ranks of the attempt (attempts from before elastic jobs have world_size 0: all)."""
    return attempt.world_size or attempt.job.gpus


def launch_spec(attempt: Attempt, node: Node) -> dict:
    job = attempt.job
    # This node's allocations, and the gang's node count, without loading the whole gang's
    # rows: a whole-cluster attempt has 4,096, and each of its 512 nodes gets a launch.
    allocations = list(attempt.allocations.filter(node=node).select_related("gpu"))
    group_world_size = attempt.allocations.values("group_rank").distinct().count()
    # One directory per attempt: a zombie worker of an earlier attempt (on a node declared lost
    # but still running) can never write into, or mix files with, the live attempt's saves.
    checkpoint_dir = attempt_dir(lockstep_setting("CHECKPOINT_ROOT"), job.id, attempt.number)
    spec = {
        "job_id": job.id,
        "team_id": job.team_id,
        "image": job.image,
        "image_pull_policy": job.image_pull_policy,
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
        "group_world_size": group_world_size,
        "master_addr": attempt.master_addr,
        "master_port": attempt.master_port,
        "run_id": f"job{job.id}-attempt{attempt.number}",
        "restart_count": attempt.number - 1,
        "max_restarts": job.max_restarts,
        "checkpoint_dir": str(checkpoint_dir),
        "resume_from": attempt.resumed_from.path if attempt.resumed_from else "",
        # A framework's save is laid out where the framework looks (nodeagent/saves.py).
        "resume_format": (
            attempt.resumed_from.format
            if attempt.resumed_from and attempt.resumed_from.format != Checkpoint.Format.DCP
            else ""
        ),
        "dataset": job.dataset,
        "layout": job.layout,
        "ranks": [
            {"rank": a.rank, "local_rank": a.local_rank, "gpu_index": a.gpu.index}
            for a in sorted(allocations, key=lambda a: a.rank)
        ],
    }
    # Shared storage the team's jobs read (a container gets each read-only at the same path).
    spec["mounts"] = dataset_mounts(job.team)
    # The team's credential for the image's registry, for the pull only: the agent keeps it
    # in a file of its own and passes nothing of it into the container.
    registry = image_registry(job.image)
    credential = next(
        (c for c in job.team.registry_credentials.all() if c.registry == registry), None
    )
    if credential is not None:
        spec["registry_auth"] = {
            "registry": registry,
            "username": credential.username,
            "password": credential.secret,
        }
    return spec


def desired_for_node(node: Node, now: datetime, known: frozenset[int] = frozenset()) -> list[dict]:
    """What should run on `node`. A `run` carries the attempt's launch spec only when the
    agent did not report the attempt in this heartbeat (`known`): an agent that reports it
    already runs it and ignores the spec, and rebuilding it every beat cost every node of a
    gang a read of the whole gang's allocations, every second (bench/hollow.py, issue 20)."""
    desired = []
    attempts = (
        Attempt.objects.filter(ended_at__isnull=True, allocations__node=node)
        .distinct()
        .select_related("job__team", "resumed_from")
    )
    for attempt in attempts:
        if attempt.dump_requested_at is not None and attempt.state != Attempt.State.STOPPING:
            desired.append({"attempt_id": attempt.id, "action": "dump"})
        elif attempt.state == Attempt.State.STOPPING:
            remaining = max((attempt.stop_deadline - now).total_seconds(), 0.0)
            desired.append({"attempt_id": attempt.id, "action": "stop", "deadline_s": remaining})
        elif attempt.id in known:
            desired.append({"attempt_id": attempt.id, "action": "run"})
        else:
            desired.append(
                {"attempt_id": attempt.id, "action": "run", "launch": launch_spec(attempt, node)}
            )
    return desired


def stopped_state(job: Job) -> str:
    """How a checkpoint-and-stop ends: the job was ended (cancel, time limit) or preempted."""
    return Attempt.State.CANCELLED if job.is_terminal else Attempt.State.PREEMPTED


def teams_with_usage(teams):
    """The teams, each annotated with `used`: the GPUs its live allocations hold. Counted
    from the held allocations alone (the partial index of invariant 1), not by joining every
    job, attempt and allocation the team ever had, which grows with the cluster's age."""
    held = (
        Allocation.objects.filter(released_at__isnull=True, attempt__job__team=OuterRef("pk"))
        .order_by()
        .values("attempt__job__team")
        .annotate(gpus=Count("id"))
        .values("gpus")
    )
    return teams.annotate(used=Coalesce(Subquery(held), 0))


# -- preemption protection (jobs.scheduling.protection's inputs) --------------------------------

SAFETY_WINDOW = timedelta(days=1)


def restart_costs(job_ids) -> dict[int, float]:
    """Each job's measured start-up cost: its latest attempt that reached a first step, from
    the attempt's creation to that step (image, rendezvous, restore). RESTART_COST_S where
    none did."""
    default = float(lockstep_setting("RESTART_COST_S"))
    costs = dict.fromkeys(job_ids, default)
    rows = (
        Attempt.objects.filter(job_id__in=job_ids, first_step_at__isnull=False)
        .order_by("job_id", "number")
        .values_list("job_id", "created_at", "first_step_at")
    )
    for job_id, created, first_step in rows:  # the latest attempt of each job wins
        costs[job_id] = max(0.0, (first_step - created).total_seconds())
    return costs


def recent_preemptions(job_ids, *, now: datetime) -> dict[int, int]:
    """How many preemptions stopped each job within the safety window (a day)."""
    rows = (
        PreemptionRequest.objects.filter(
            victim_id__in=job_ids,
            state=PreemptionRequest.State.EXECUTED,
            executed_at__gte=now - SAFETY_WINDOW,
        )
        .values("victim_id")
        .annotate(n=Count("id"))
        .values_list("victim_id", "n")
    )
    return dict(rows)


def recent_backfill_stops(job_ids, *, now: datetime) -> set[int]:
    """The jobs a reservation stopped as its fillers within the safety window: a job is a
    filler at most once a day (scheduling rule 4)."""
    return set(
        PreemptionRequest.objects.filter(
            victim_id__in=job_ids,
            state=PreemptionRequest.State.EXECUTED,
            kind=PreemptionRequest.Kind.BACKFILL,
            executed_at__gte=now - SAFETY_WINDOW,
        ).values_list("victim_id", flat=True)
    )


def last_reclaims(job_ids) -> dict[int, datetime]:
    """When a reclaim last stopped each job (protection rule 2)."""
    rows = (
        PreemptionRequest.objects.filter(
            victim_id__in=job_ids,
            state=PreemptionRequest.State.EXECUTED,
            kind=PreemptionRequest.Kind.RECLAIM,
        )
        .values("victim_id")
        .annotate(last=Max("executed_at"))
        .values_list("victim_id", "last")
    )
    return dict(rows)


def attempt_protected_until(attempt: Attempt, restart_s: float) -> datetime:
    """The end of a live attempt's minimum run: start-up plus one checkpoint interval (the
    attempt's, else its job's), never below PREEMPT_EXEMPT_S."""
    interval = attempt.checkpoint_interval_s or attempt.job.checkpoint_interval_s
    protect = min_run_s(interval, restart_s, float(lockstep_setting("PREEMPT_EXEMPT_S")))
    return attempt.created_at + timedelta(seconds=protect)


def protection(job: Job, *, now: datetime) -> dict | None:
    """For the job's pages: until when its live attempt is protected from preemption and why,
    None when it runs none."""
    attempt = job.attempts.filter(ended_at__isnull=True).select_related("job").first()
    if attempt is None:
        return None
    restart_s = restart_costs([job.id])[job.id]
    until = attempt_protected_until(attempt, restart_s)
    return {
        "protected_until": until,
        "protected": now < until,
        "restart_s": round(restart_s, 1),
        "checkpoint_interval_s": attempt.checkpoint_interval_s or job.checkpoint_interval_s,
        "preemptions_today": recent_preemptions([job.id], now=now).get(job.id, 0),
        "safety_stop": int(lockstep_setting("PREEMPT_MAX_PER_DAY")),
        "filler": attempt.filler,
    }


def remaining_estimate(job: Job, *, now: datetime) -> tuple[float, str]:
    """The job's remaining run time and how it was estimated: the steps it has left at its
    pace (jobs.progress), no later than its time limit; else its time limit less what it has
    run; with neither, as long again as it has run so far (a job that has run an hour is as
    likely as not to run another)."""
    ran = run_seconds([job.id], now=now).get(job.id, 0.0)
    limit = _limit_left(job, ran)
    attempt = job.attempts.filter(ended_at__isnull=True).first()
    at_pace = pace(attempt) if attempt is not None else None
    if at_pace is not None:
        left = max((at_pace.projected_end - now).total_seconds(), 0.0)
        if limit is None or left <= limit:
            return left, f"at its pace: step {at_pace.step} of {at_pace.total_steps}"
    if limit is not None:
        return limit, "its time limit"
    return ran, "no time limit: as long again as it has run"


def progress(job: Job, *, now: datetime) -> dict | None:
    """For the job's pages: how far its live attempt is in the steps its script said the run
    takes, and when it should end at its pace (jobs.progress); None when it runs none or its
    script gave no total. `time_limit_end` is set when the time limit stops it before that."""
    attempt = job.attempts.filter(ended_at__isnull=True).first()
    if attempt is None or not attempt.total_steps:
        return None
    at_pace = pace(attempt)
    out = {
        "step": attempt.last_step,
        "total_steps": attempt.total_steps,
        "fraction": round(fraction(attempt.last_step, attempt.total_steps), 4),
        "steps_per_s": round(at_pace.steps_per_s, 3) if at_pace else None,
        "projected_end": at_pace.projected_end if at_pace else None,
        "time_limit_end": None,
    }
    if at_pace is not None and job.time_limit_s:
        ran = run_seconds([job.id], now=now).get(job.id, 0.0)
        limit_end = now + timedelta(seconds=_limit_left(job, ran))
        if limit_end < at_pace.projected_end:
            out["time_limit_end"] = limit_end
    return out


def _limit_left(job: Job, ran_s: float) -> float | None:
    """Seconds of its time limit left after `ran_s` of run time; None without a limit."""
    return max(job.time_limit_s - ran_s, 0.0) if job.time_limit_s else None


def capacity_without(attempt: Attempt, node: Node) -> bool:
    """Whether the attempt's whole gang would fit on the schedulable nodes other than `node`,
    counting its own GPUs there as free (they are, once it stops)."""
    # Two counts over all those nodes, not two queries per node.
    elsewhere = {"node__state": Node.State.UP}
    total = GPU.objects.filter(**elsewhere).exclude(node=node).count()
    busy = (
        Allocation.objects.filter(released_at__isnull=True, **elsewhere)
        .exclude(node=node)
        .exclude(attempt=attempt)
        .values("gpu")
        .distinct()
        .count()
    )
    free = total - busy
    return free >= world_size(attempt)
