"""Goodput for a job: how much of its wall time went into steps that count, and what each
failure cost (time to detect, time to recover, steps recomputed)."""

from __future__ import annotations

from django.db.models import Prefetch, Q
from django.utils import timezone

from jobs.models import Attempt

FAILURES = (Attempt.State.FAILED, Attempt.State.LOST)


def effective_share(productive_s: float, wall_s: float) -> float | None:
    """Goodput, the one definition: the share of wall (or GPU) time that went into work that
    counts, within [0, 1]; None without any time. Reports round it to 4 places."""
    if not wall_s:
        return None
    return min(max(productive_s, 0.0) / wall_s, 1.0)


def _step_seconds(attempt: Attempt) -> float | None:
    """Mean seconds per step of an attempt, from its first and last progress. The first
    progress came with a batch of steps (`first_step`, its latest: ingest._note_progress), so
    the pace is over the steps after it; without `first_step`, over those after the first."""
    if not attempt.first_step_at or not attempt.last_progress_at:
        return None
    first = attempt.resumed_from_step + 1 if attempt.first_step is None else attempt.first_step
    steps = attempt.last_step - first
    if steps < 1:
        return None
    return (attempt.last_progress_at - attempt.first_step_at).total_seconds() / steps


def _steps_by_first_progress(attempt: Attempt) -> int:
    """How many steps the attempt had done when its first progress came."""
    if attempt.first_step is None:
        return 1
    return max(attempt.first_step - attempt.resumed_from_step, 0)


# Where a job's wall time went (`breakdown`), in the order the job page stacks it.
TIME_USES = (
    ("productive_s", "training", "steps whose results survive"),
    ("recomputed_s", "recomputed", "steps after the checkpoint the next attempt resumed from"),
    (
        "starting_s",
        "starting",
        "from an attempt's launch to its first step: image, rendezvous, loading",
    ),
    (
        "ending_s",
        "ending",
        "from an attempt's last step to its end: a save at stop, a failure's detection",
    ),
    ("after_failure_s", "waiting after failures", "restart backoff, then queued for GPUs"),
    (
        "after_stop_s",
        "waiting after stops",
        "queued again after a preemption or a planned restart (the platform's downtime too)",
    ),
    (
        "other_s",
        "other",
        "what the attempts' records do not place: saves between steps, gaps in reports",
    ),
)


def job_goodput(job, now=None) -> dict:
    """Effective training time = productive step time / wall time since the first start.

    Productive steps are those whose results survive: an attempt's steps up to the checkpoint
    the next attempt resumed from. Steps after it were recomputed, and count as lost. The rest
    of the wall time is placed by `breakdown` (TIME_USES).
    """
    now = now or timezone.now()
    attempts = sorted(job.attempts.all(), key=lambda a: a.number)
    result = {
        "wall_s": 0.0,
        "productive_s": 0.0,
        "effective": None,
        "restarts": job.restart_count,
        "incidents": [],
        "breakdown": [],  # where the wall time went (TIME_USES), once the job has started
        # Time the nodes spent pulling the job's image before its containers could start.
        "image_pull_s": round(sum(a.pull_s or 0.0 for a in attempts), 1),
    }
    if job.first_started_at is None:
        return result
    end = job.finished_at or now
    wall = max((end - job.first_started_at).total_seconds(), 0.0)
    productive = 0.0
    uses = dict.fromkeys((key for key, _label, _what in TIME_USES), 0.0)
    for index, attempt in enumerate(attempts):
        following = attempts[index + 1] if index + 1 < len(attempts) else None
        per_step = _step_seconds(attempt)
        kept_until = following.resumed_from_step if following else attempt.last_step
        kept = max(min(kept_until, attempt.last_step) - attempt.resumed_from_step, 0)
        if per_step:
            productive += kept * per_step
            recomputed = max(attempt.last_step - attempt.resumed_from_step - kept, 0)
            uses["recomputed_s"] += recomputed * per_step
        _place_attempt(uses, attempt, per_step, following, end)
        if attempt.state in FAILURES and attempt.ended_at:
            lost_steps = max(attempt.last_step - kept_until, 0) if following else None
            recovered_at = following.first_step_at if following else None
            result["incidents"].append(
                {
                    "attempt": attempt.number,
                    "state": attempt.state,
                    "reason": attempt.end_reason,
                    "failed_at": attempt.failed_at,
                    "detect_s": _seconds(attempt.failed_at, attempt.ended_at),
                    "recover_s": _seconds(attempt.ended_at, recovered_at),
                    "lost_steps": lost_steps,
                    "lost_s": round(lost_steps * per_step, 1) if per_step and lost_steps else None,
                }
            )
    share = effective_share(productive, wall)
    uses["productive_s"] = productive
    # Start-up is the one estimated part (its first steps' time taken out at the pace of the
    # rest): where the parts overrun the wall time, by a step or two, start-up gives it back.
    overrun = sum(uses.values()) - wall
    if overrun > 0:
        uses["starting_s"] = max(uses["starting_s"] - overrun, 0.0)
    uses["other_s"] = max(wall - sum(uses.values()), 0.0)
    result.update(
        wall_s=round(wall, 1),
        productive_s=round(productive, 1),
        effective=None if share is None else round(share, 4),
        breakdown=[
            {"key": key, "label": label, "what": what, "seconds": round(uses[key], 1)}
            for key, label, what in TIME_USES
        ],
    )
    return result


def _place_attempt(uses: dict, attempt: Attempt, per_step, following, end) -> None:
    """Add `attempt`'s time outside its steps to `uses`: its start-up (launch to first
    progress, less the steps done by then, at the attempt's pace: those count with the
    steps), its end (last step to its end) and, once ended, the wait until the `following`
    attempt's launch (or until `end`, the job's end or now, while it waits again)."""
    ended = min(attempt.ended_at, end) if attempt.ended_at else None
    if attempt.first_step_at is None:
        uses["starting_s"] += _span(attempt.created_at, ended or end)
    else:
        early = _steps_by_first_progress(attempt) * (per_step or 0.0)
        uses["starting_s"] += max(_span(attempt.created_at, attempt.first_step_at) - early, 0.0)
        if ended is not None and attempt.last_progress_at is not None:
            uses["ending_s"] += _span(attempt.last_progress_at, ended)
    if ended is None:
        return
    waited = _span(ended, following.created_at if following else end)
    key = "after_failure_s" if attempt.state in FAILURES else "after_stop_s"
    uses[key] += waited


def _span(start, end) -> float:
    return max((end - start).total_seconds(), 0.0)


def _seconds(start, end) -> float | None:
    if start is None or end is None:
        return None
    return round((end - start).total_seconds(), 1)


def team_goodput(team, *, since, now=None) -> dict:
    """Goodput summed over the team's jobs that ran since `since`."""
    now = now or timezone.now()
    jobs = (
        team.jobs.filter(first_started_at__isnull=False)
        .filter(Q(finished_at__isnull=True) | Q(finished_at__gte=since))
        .prefetch_related(Prefetch("attempts", queryset=Attempt.objects.order_by("number")))
    )
    wall = productive = 0.0
    incidents = 0
    for job in jobs:
        figures = job_goodput(job, now=now)
        wall += figures["wall_s"]
        productive += figures["productive_s"]
        incidents += len(figures["incidents"])
    share = effective_share(productive, wall)
    return {
        "since": since,
        "jobs": len(jobs),
        "wall_s": round(wall, 1),
        "productive_s": round(productive, 1),
        "effective": None if share is None else round(share, 4),
        "incidents": incidents,
    }
