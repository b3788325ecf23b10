"""Admins' what-if: the platform's own recorded jobs of a window, replayed by the simulator
(jobs.scheduling.simulate, through the real plan()) under the current quotas and cluster and
again under changed ones, side by side. Writes nothing but its WhatIfRun row and an Event.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.db import transaction
from django.db.models import Count
from django.utils import timezone

from jobs import queue
from jobs.conf import lockstep_setting
from jobs.event_kinds import EventKind
from jobs.models import PRIORITY_RANK, Attempt, Event, Job, Node, WhatIfRun
from jobs.scheduling.reader import live_rules
from jobs.scheduling.simulate import SimConfig, run
from jobs.scheduling.trace import TeamQuota, TraceJob
from jobs.whatif_results import CHANGED, CURRENT, figures, finite, summary_rows, team_rows
from teams.models import Team

log = logging.getLogger(__name__)

DEFAULT_WINDOW_DAYS = 7
MAX_WINDOW_DAYS = 92
MAX_GPUS = 1_000_000
FALLBACK_DURATION_S = 3600.0  # a never-started job without a time limit, when none finished


# ---------------------------------------------------------------------------------------------
# Inputs: the recorded jobs as a trace; the cluster and the quotas as they are now


@dataclass
class RecordedTrace:
    """The window's jobs as simulator trace rows, and how each one's run time was found."""

    jobs: list[TraceJob] = field(default_factory=list)
    finished: int = 0  # ended: the run time of all its attempts
    limit: int = 0  # not ended, with a time limit: that limit (at least what it has run)
    elapsed: int = 0  # not ended, started, no time limit: its run time so far (a lower bound)
    estimated: int = 0  # never started, no time limit: the median of the ended ones
    skipped: int = 0  # ended without ever running (cancelled or failed while queued)

    def summary(self) -> dict:
        return {
            "jobs": len(self.jobs),
            "finished": self.finished,
            "time_limit": self.limit,
            "elapsed_so_far": self.elapsed,
            "estimated": self.estimated,
            "skipped": self.skipped,
            "gpu_hours": round(sum(j.gpus * j.duration_s for j in self.jobs) / 3600, 1),
        }


def recorded_trace(since: datetime, until: datetime, *, now: datetime) -> RecordedTrace:
    """Jobs submitted in [since, until) as TraceJobs, submit times in seconds after `since`.

    A job's duration is the time its attempts held GPUs (claim to end; a live attempt up to
    `now`), summed over its attempts. A job not yet ended uses its time limit if it has one,
    else its run time so far; one that never started and has no limit gets the median run
    time of the window's ended jobs. Jobs that ended without running are left out. Work lost
    to past failures and preemptions counts as run time (it held the GPUs).
    """
    window = {"submitted_at__gte": since, "submitted_at__lt": until}
    ran: dict[int, float] = {}
    for job_id, started, ended in Attempt.objects.filter(
        job__submitted_at__gte=since, job__submitted_at__lt=until
    ).values_list("job_id", "created_at", "ended_at"):
        held = max(((ended or now) - started).total_seconds(), 0.0)
        ran[job_id] = ran.get(job_id, 0.0) + held
    out = RecordedTrace()
    rows = []
    ended_durations = []
    for job_id, submitted, gpus, team, priority, state, limit in (
        Job.objects.filter(**window)
        .order_by("submitted_at", "id")
        .values_list(
            "id", "submitted_at", "gpus", "team__name", "priority", "state", "time_limit_s"
        )
    ):
        if state in Job.TERMINAL:
            if job_id not in ran:
                out.skipped += 1
                continue
            duration = ran[job_id]
            out.finished += 1
            ended_durations.append(duration)
        elif limit:
            duration = max(float(limit), ran.get(job_id, 0.0))
            out.limit += 1
        elif job_id in ran:
            duration = ran[job_id]
            out.elapsed += 1
        else:
            duration = None
            out.estimated += 1
        rows.append((job_id, submitted, gpus, team, priority, duration))
    fill = statistics.median(ended_durations) if ended_durations else FALLBACK_DURATION_S
    out.jobs = [
        TraceJob(
            job_id=str(job_id),
            submit_s=(submitted - since).total_seconds(),
            gpus=gpus,
            duration_s=fill if duration is None else duration,
            team=team,
            priority=PRIORITY_RANK[priority],
        )
        for job_id, submitted, gpus, team, priority, duration in rows
    ]
    return out


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int
    nodes: int


def current_cluster() -> Cluster:
    """GPUs of every node that is not down (cordoned and draining ones count: they come back);
    the simulator's nodes all have the largest node's GPU count."""
    counts = [
        n
        for n in Node.objects.exclude(state=Node.State.DOWN)
        .annotate(n=Count("gpus"))
        .values_list("n", flat=True)
        if n
    ]
    return Cluster(gpus=sum(counts), gpus_per_node=max(counts, default=8), nodes=len(counts))


def current_quotas() -> dict[str, dict]:
    return {
        t.name: {"quota": t.quota, "borrow_limit": t.borrow_limit, "weight": t.weight}
        for t in Team.objects.order_by("name")
    }


def jobs_in_window(since: datetime, until: datetime) -> int:
    return Job.objects.filter(submitted_at__gte=since, submitted_at__lt=until).count()


def default_window(now: datetime) -> tuple[datetime, datetime]:
    end = now.replace(second=0, microsecond=0) + timedelta(minutes=1)
    return end - timedelta(days=DEFAULT_WINDOW_DAYS), end


def check_request(*, since: datetime, until: datetime) -> dict[str, str]:
    """What is wrong with a what-if request beyond single fields' ranges: {field: message},
    "__all__" for the request as a whole. Empty when it may run."""
    if since >= until:
        return {"until": "The window must end after it starts."}
    if until - since > timedelta(days=MAX_WINDOW_DAYS):
        return {"since": f"The window may be at most {MAX_WINDOW_DAYS} days long."}
    if current_cluster().gpus == 0:
        return {"gpus": "No node with GPUs is registered: there is no cluster to compare with."}
    if not jobs_in_window(since, until):
        return {
            "__all__": f"No jobs were submitted between {since:%Y-%m-%d %H:%M} and "
            f"{until:%Y-%m-%d %H:%M} UTC: there is nothing to replay."
        }
    return {}


# ---------------------------------------------------------------------------------------------
# Running it


# The admin settings of the policy's own rules a what-if may change: the quota promise's trade
# against utilization (docs/scheduling.md, rule 1; docs/thrash.md measures it). Field of
# SimConfig -> LOCKSTEP setting.
POLICY_SETTINGS = {
    "aged_borrowed_first": "AGED_BORROWED_FIRST",
    "quota_before_drain": "QUOTA_BEFORE_DRAIN",
}


def current_policy() -> dict[str, bool]:
    """Today's values of POLICY_SETTINGS."""
    rules = live_rules()
    return {key: rules[key] for key in POLICY_SETTINGS}


def sim_config(
    gpus: int, gpus_per_node: int, teams: dict[str, dict], policy: dict | None = None
) -> SimConfig:
    """The simulator set up like the live system: its grace, approval delay, reclaim backoff,
    fair-share half-life and every protection setting (minimum run, restart cost, the day's
    preemption limit, drained-for gangs' exemption), and `policy` (POLICY_SETTINGS; today's
    where not given); victims save when told to stop (the trainer does on SIGTERM)."""
    rules = live_rules()
    return SimConfig(
        gpus=gpus,
        gpus_per_node=gpus_per_node,
        quotas={
            name: TeamQuota(
                quota=int(q["quota"]), borrow_limit=int(q["borrow_limit"]), weight=q["weight"]
            )
            for name, q in teams.items()
        },
        grace_s=lockstep_setting("STOP_GRACE_S"),
        approval_delay_s=lockstep_setting("PREEMPTION_APPROVAL_DELAY_S"),
        reclaim_backoff_s=lockstep_setting("RECLAIM_BACKOFF_S"),
        usage_half_life_s=lockstep_setting("USAGE_HALF_LIFE_S"),
        restart_s=float(lockstep_setting("RESTART_COST_S")),
        preempt_exempt_s=float(rules["preempt_exempt_s"]),
        safety_stop=int(rules["max_preemptions"]),
        gang_reclaim_exempt_s=float(rules["gang_reclaim_exempt_s"]),
        checkpoint_on_stop=True,
        wait_for_ending=bool(rules["wait_for_ending"]),
        **{**{key: rules[key] for key in POLICY_SETTINGS}, **(policy or {})},
    )


def compare(trace: list[TraceJob], inputs: dict, *, since: datetime) -> dict:
    """Replay `trace` under inputs["current"] and inputs["changed"] (each: gpus,
    gpus_per_node, teams {name: {quota, borrow_limit, weight}}, policy {POLICY_SETTINGS
    field: bool}) and put the results side by
    side: every metric, per-team wait and reclaim, and Plotly figures (plain JSON). Trace
    times are seconds after `since`."""
    results = {
        side: run(
            trace,
            "lockstep",
            sim_config(
                inputs[side]["gpus"],
                inputs[side]["gpus_per_node"],
                inputs[side]["teams"],
                # Runs recorded before the policy settings were inputs replay with today's.
                inputs[side].get("policy"),
            ),
        )
        for side in (CURRENT, CHANGED)
    }
    metrics = {side: finite(r.metrics) for side, r in results.items()}
    return {
        "inputs": inputs,
        "metrics": metrics,
        "summary": summary_rows(metrics[CURRENT], metrics[CHANGED]),
        "teams": team_rows(metrics[CURRENT], metrics[CHANGED], inputs),
        "figures": figures(results, since),
    }


def run_window(since: datetime, until: datetime, *, now: datetime, inputs: dict) -> dict:
    """The what-if of one window: the recorded trace, then compare()."""
    recorded = recorded_trace(since, until, now=now)
    return {
        "window": {"since": since.isoformat(), "until": until.isoformat(), "now": now.isoformat()},
        "trace": recorded.summary(),
        **compare(recorded.jobs, inputs, since=since),
    }


def resolve_inputs(gpus: int | None, teams: dict[str, dict], policy: dict | None = None) -> dict:
    """Current inputs as they are now, and the changed ones: current with the overrides."""
    cluster = current_cluster()
    quotas = current_quotas()
    changed = {name: {**q, **teams.get(name, {})} for name, q in quotas.items()}
    per_node = cluster.gpus_per_node
    today = current_policy()
    return {
        CURRENT: {
            "gpus": cluster.gpus,
            "gpus_per_node": per_node,
            "teams": quotas,
            "policy": today,
        },
        CHANGED: {
            "gpus": gpus or cluster.gpus,
            "gpus_per_node": per_node,
            "teams": changed,
            "policy": {**today, **(policy or {})},
        },
    }


def inline_limit() -> int:
    return int(lockstep_setting("WHATIF_INLINE_MAX_JOBS"))


def do_request_whatif(
    *,
    actor,
    since: datetime,
    until: datetime,
    gpus: int | None,
    teams: dict[str, dict],
    now,
    policy: dict | None = None,
) -> WhatIfRun:
    """Record a what-if and run it: in this request when the window holds few jobs, else on
    the rq worker (the caller polls the run). Validate with check_request() first. `policy`:
    POLICY_SETTINGS to change (field -> bool)."""
    inputs = resolve_inputs(gpus, teams, policy)
    count = jobs_in_window(since, until)
    inline = count <= inline_limit()
    with transaction.atomic():
        whatif = WhatIfRun.objects.create(
            created_by=actor,
            created_at=now,
            since=since,
            until=until,
            params=inputs,
            jobs=count,
        )
        changes = describe_changes(inputs)
        Event.objects.create(
            kind=EventKind.WHATIF_REQUESTED,
            message=f"{actor.username if actor else 'someone'} ran what-if {whatif.id} over "
            f"{count} jobs ({since:%Y-%m-%d %H:%M} to {until:%Y-%m-%d %H:%M}): "
            f"{changes or 'no changes'}"[:2000],
            actor=actor,
            data={"whatif": whatif.id},
        )
        if not inline:
            queue.enqueue_whatif(whatif.id)  # deferred to commit (RQ COMMIT_MODE)
    if inline:
        execute_whatif(whatif.id)
        whatif.refresh_from_db()
    return whatif


def execute_whatif(run_id: int) -> WhatIfRun:
    """Run a queued what-if to completion, recording its result or why it failed. A run that
    is not queued any more (a retried task) is left as it is."""
    claimed = WhatIfRun.objects.filter(pk=run_id, state=WhatIfRun.State.QUEUED).update(
        state=WhatIfRun.State.RUNNING, started_at=timezone.now()
    )
    whatif = WhatIfRun.objects.get(pk=run_id)
    if not claimed:
        return whatif
    try:
        result = run_window(whatif.since, whatif.until, now=whatif.created_at, inputs=whatif.params)
    except Exception as exc:  # shown on the results page instead of a run stuck "running"
        log.exception("what-if %s failed", run_id)
        whatif.state, whatif.error = WhatIfRun.State.FAILED, f"{type(exc).__name__}: {exc}"[:2000]
    else:
        whatif.state, whatif.result = WhatIfRun.State.DONE, result
    whatif.finished_at = timezone.now()
    whatif.save(update_fields=["state", "error", "result", "finished_at"])
    return whatif


def describe_changes(inputs: dict) -> str:
    current, changed = inputs[CURRENT], inputs[CHANGED]
    parts = []
    if changed["gpus"] != current["gpus"]:
        parts.append(f"GPUs {current['gpus']} -> {changed['gpus']}")
    for name, after in changed["teams"].items():
        before = current["teams"].get(name, {})
        diff = [
            f"{key} {before.get(key)} -> {after[key]}"
            for key in ("quota", "borrow_limit", "weight")
            if before.get(key) != after[key]
        ]
        if diff:
            parts.append(f"{name}: {', '.join(diff)}")
    before, after = current.get("policy", {}), changed.get("policy", {})
    for key, setting in POLICY_SETTINGS.items():
        if key in after and before.get(key) != after[key]:
            parts.append(f"{setting} {_on_off(before.get(key))} -> {_on_off(after[key])}")
    return "; ".join(parts)


def _on_off(value) -> str:
    return {True: "true", False: "false"}.get(value, "today's")
