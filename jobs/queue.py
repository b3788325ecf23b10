"""Work handed to the rq worker. Tasks are named by their dotted path, so the domain that
queues them never imports jobs.tasks (which imports the domain to do the work)."""

from __future__ import annotations

import django_rq

# An rmtree of a few large checkpoints on a network filesystem takes seconds, not minutes.
PRUNE_TIMEOUT_S = 600

# A pending prune's mark outlives a lost enqueue (a rolled-back commit) by at most this.
PRUNE_MARK_TTL_S = 300


def prune_mark(job_id: int) -> str:
    return f"lockstep:prune-pending:{job_id}"


def enqueue_prune(job_id: int) -> bool:
    """Queue a retention pass for the job unless one is already waiting: that one reads the
    checkpoints when it starts (after clearing the mark), so it covers this commit too. One
    prune per commit cost a forked rq work horse per checkpoint (0.01-0.02 cores with a save
    every second or two in bench/overhead.py). True if a job was queued."""
    if not django_rq.get_connection().set(prune_mark(job_id), 1, nx=True, ex=PRUNE_MARK_TTL_S):
        return False
    # It runs inside the worker process (jobs/worker.py), which no other job can use meanwhile.
    django_rq.enqueue("jobs.tasks.prune_checkpoints", job_id, job_timeout=PRUNE_TIMEOUT_S)
    return True


def enqueue_export(version_id: int) -> None:
    """Consolidate a model version's checkpoint into one file, in a forked work horse."""
    django_rq.enqueue("jobs.tasks.export_model_version", version_id)


def enqueue_whatif(run_id: int) -> None:
    """An admin's what-if too large to run inside the request."""
    django_rq.enqueue("jobs.tasks.run_whatif", run_id)
