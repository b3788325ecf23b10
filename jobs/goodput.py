"""Goodput figures for a job: how much of its wall time was spent training."""

from django.utils import timezone


def job_goodput(job, now=None) -> dict:
    """Running time (all ranks up) over wall time since the first start, plus restarts."""
    now = now or timezone.now()
    if job.first_started_at is None:
        return {"wall_s": 0.0, "running_s": 0.0, "effective": None, "restarts": 0}
    end = job.finished_at or now
    wall = max((end - job.first_started_at).total_seconds(), 0.0)
    running = 0.0
    for attempt in job.attempts.all():
        if attempt.running_at is not None:
            running += ((attempt.ended_at or end) - attempt.running_at).total_seconds()
    return {
        "wall_s": round(wall, 1),
        "running_s": round(running, 1),
        "effective": round(running / wall, 4) if wall > 0 else None,
        "restarts": job.restart_count,
    }
