"""Helpers that play an agent's side of the protocol against the real actions."""

import json
from datetime import timedelta

from django.db.models import F
from django.utils import timezone

from jobs import actions
from jobs.models import Attempt


def submit(team, user, gpus=4, **fields):
    return actions.do_submit_job(
        owner=user,
        team=team,
        now=timezone.now(),
        **{
            "name": "j",
            "image": "lockstep/trainer:latest",
            "command": ["python", "-m", "trainer"],
            "gpus": gpus,
            **fields,
        },
    )


def beat(node, attempt, ranks, *, records=(), now=None, telemetry=None, cpu=None, logs=None):
    """One heartbeat from `node` reporting `ranks` = {rank: exit_code or None (running)};
    `cpu` = {rank: CPU seconds its session used so far}, `logs` = {rank: output text}."""
    body = {
        "boot_id": node.boot_id,
        "telemetry": telemetry or [],
        "attempts": [
            {
                "attempt_id": attempt.id,
                "ranks": [
                    {
                        "rank": r,
                        "pid": 100 + r,
                        "state": "running" if c is None else "exited",
                        "exit_code": c,
                        **({"cpu_s": cpu[r]} if cpu and r in cpu else {}),
                    }
                    for r, c in ranks.items()
                ],
                "records": list(records),
                "logs": [{"rank": r, "text": t} for r, t in (logs or {}).items()],
            }
        ],
    }
    return actions.do_heartbeat(node, body, now=now or timezone.now())


def step_records(rank: int, steps) -> list[dict]:
    """A rank's step records, as the trainer writes them, for `steps`."""
    return [
        {
            "kind": "step",
            "rank": rank,
            "step": s,
            "loss": 1.0,
            "tokens_per_s": 1.0,
            "step_time_s": 0.1,
            "compute_s": 0.05,
        }
        for s in steps
    ]


def launch_of(node, attempt, *, now=None):
    """The launch spec the portal gives `node` for `attempt` on a heartbeat that does not yet
    report it, as an agent's first beat after the placement."""
    body = {"boot_id": node.boot_id, "telemetry": [], "attempts": []}
    response = actions.do_heartbeat(node, body, now=now or timezone.now())
    (item,) = [d for d in response["desired"] if d["attempt_id"] == attempt.id]
    return item["launch"]


def commit_checkpoint(root, job, step):
    path = root / f"job-{job.id}" / f"step-{step:06d}"
    path.mkdir(parents=True)
    (path / "COMMITTED").write_text(json.dumps({"step": step}))
    return {
        "kind": "checkpoint",
        "rank": 0,
        "step": step,
        "path": str(path),
        "bytes": 10,
        "save_s": 0.1,
    }


def live_attempt(job):
    return Attempt.objects.get(job=job, ended_at__isnull=True)


def past_protection(seconds: float = 7200) -> None:
    """Make every live attempt `seconds` older: past its minimum run (a freshly started job is
    protected from priority and starvation preemption: jobs.scheduling.protection). Report
    the attempts running first (`beat`): one still starting would time out."""
    Attempt.objects.filter(ended_at__isnull=True).update(
        created_at=F("created_at") - timedelta(seconds=seconds)
    )
