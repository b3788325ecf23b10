"""What the failure tests (tests/test_failures*.py) share: a job running on two nodes, and
its step records."""

from jobs.scheduling.loop import run_pass
from tests.heartbeats import beat, live_attempt, submit


def _run(setup, **fields):
    team, user, (a, b), root = setup
    job = submit(team, user, **fields)
    run_pass()
    attempt = live_attempt(job)
    beat(a, attempt, {0: None, 1: None})
    beat(b, attempt, {2: None, 3: None})
    job.refresh_from_db()
    return job, attempt, a, b, root


def _steps(first, last, rank=0, step_time=0.1, compute=0.05):
    return [
        {
            "kind": "step",
            "rank": rank,
            "step": s,
            "loss": 1.0,
            "tokens_per_s": 1.0,
            "step_time_s": step_time,
            "compute_s": compute,
        }
        for s in range(first, last + 1)
    ]
