"""Admins' what-if: the platform's own recorded jobs of a window, replayed by the simulator
(jobs.scheduling.simulate, through the real plan()) under the current quotas and cluster and
again under changed ones, side by side. Writes nothing but its WhatIfRun row and an Event.
"""

from __future__ import annotations

import logging
import math
import statistics
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from django.db import transaction
from django.db.models import Count
from django.utils import timezone

from jobs import queue
from jobs.conf import lockstep_setting
from jobs.event_kinds import EventKind
from jobs.models import PRIORITY_RANK, Attempt, Event, Job, Node, WhatIfRun
from jobs.reports.reclaim import reclaim_bound_s
from jobs.scheduling.report import binned
from jobs.scheduling.simulate import SimConfig, SimResult, run
from jobs.scheduling.trace import SIZE_CLASSES, TeamQuota, TraceJob
from teams.models import Team

log = logging.getLogger(__name__)

DEFAULT_WINDOW_DAYS = 7
MAX_WINDOW_DAYS = 92
MAX_GPUS = 1_000_000
FALLBACK_DURATION_S = 3600.0  # a never-started job without a time limit, when none finished
CHART_BINS = 200
CURRENT, CHANGED = "current", "changed"
COLORS = {CURRENT: "#94a3b8", CHANGED: "#2563eb"}


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
    return {key: bool(lockstep_setting(name)) for key, name in POLICY_SETTINGS.items()}


def sim_config(
    gpus: int, gpus_per_node: int, teams: dict[str, dict], policy: dict | None = None
) -> SimConfig:
    """The simulator set up like the live system: its grace, approval delay, reclaim backoff,
    fair-share half-life and every protection setting (minimum run, restart cost, the day's
    preemption limit, drained-for gangs' exemption), and `policy` (POLICY_SETTINGS; today's
    where not given); victims save when told to stop (the trainer does on SIGTERM)."""
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
        preempt_exempt_s=float(lockstep_setting("PREEMPT_EXEMPT_S")),
        safety_stop=int(lockstep_setting("PREEMPT_MAX_PER_DAY")),
        gang_reclaim_exempt_s=float(lockstep_setting("RECLAIM_GANG_EXEMPT_S")),
        checkpoint_on_stop=True,
        **{**current_policy(), **(policy or {})},
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
    metrics = {side: _finite(r.metrics) for side, r in results.items()}
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


# ---------------------------------------------------------------------------------------------
# Results: side-by-side rows and figures

# (label, path into the metrics, unit, which way is better). Waits, completion times and
# fairness are over finished jobs only: with none finished they are shown as unknown.
SUMMARY = (
    ("GPUs", ("gpus",), "n", None),
    ("jobs replayed", ("jobs",), "n", None),
    ("jobs finished", ("completed",), "n", "higher"),
    ("jobs never started", ("never_started",), "n", "lower"),
    ("dropped (larger than the cluster)", ("dropped",), "n", "lower"),
    ("utilization", ("utilization",), "%", "higher"),
    ("utilization while work waited", ("utilization_when_backlogged",), "%", "higher"),
    ("mean wait", ("wait_mean_s",), "s", "lower"),
    ("median wait", ("wait_median_s",), "s", "lower"),
    ("p99 wait", ("wait_p99_s",), "s", "lower"),
    ("mean job completion time", ("jct_mean_s",), "s", "lower"),
    ("p99 job completion time", ("jct_p99_s",), "s", "lower"),
    ("finish-time fairness, worst", ("ftf_max",), "x", "lower"),
    ("reclaim time, p99", ("reclaim_p99_s",), "s", "lower"),
    ("reclaim time, max", ("reclaim_max_s",), "s", "lower"),
    ("preemptions carried out", ("preemptions", "executed"), "n", "lower"),
    ("GPU-hours lost to preemption", ("preempted_gpu_hours",), "h", "lower"),
    ("starved jobs", ("starved",), "n", "lower"),
) + tuple(
    (f"mean wait, {cls} GPU jobs", ("by_size", cls, "wait_mean_s"), "s", "lower")
    for cls in SIZE_CLASSES
)
OVER_FINISHED = ("wait_", "jct_", "ftf_", "by_size")
TEAM_KEYS = (
    "jobs",
    "completed",
    "wait_mean_s",
    "wait_median_s",
    "wait_p99_s",
    "wait_max_s",
    "reclaims",
    "reclaim_median_s",
    "reclaim_max_s",
    "ftf_max",
)


def _get(metrics: dict, path: tuple[str, ...]):
    if path[0].startswith(OVER_FINISHED) and not metrics.get("completed"):
        return None  # an average over no finished job
    for key in path:
        metrics = metrics.get(key) if isinstance(metrics, dict) else None
    return metrics


def _verdict(before, after, better: str | None) -> str:
    if better is None or before is None or after is None or math.isclose(before, after):
        return "same"
    improved = after < before if better == "lower" else after > before
    return "better" if improved else "worse"


def summary_rows(current: dict, changed: dict) -> list[dict]:
    rows = []
    for label, path, unit, better in SUMMARY:
        if path[0] == "by_size" and not current["by_size"][path[1]]["jobs"]:
            continue  # no job of that size finished in the window
        before, after = _get(current, path), _get(changed, path)
        rows.append(
            {
                "label": label,
                "unit": unit,
                CURRENT: before,
                CHANGED: after,
                "verdict": _verdict(before, after, better),
            }
        )
    return rows


def team_rows(current: dict, changed: dict, inputs: dict) -> list[dict]:
    """Per team with jobs in the window: its inputs and wait/reclaim figures on each side."""
    rows = []
    for name in sorted(set(current["teams"]) | set(changed["teams"])):
        before = current["teams"].get(name, {})
        after = changed["teams"].get(name, {})
        values = {
            side: {k: _get(figures, (k,)) for k in TEAM_KEYS}
            for side, figures in ((CURRENT, before), (CHANGED, after))
        }
        rows.append(
            {
                "team": name,
                "inputs": {side: inputs[side]["teams"].get(name) for side in (CURRENT, CHANGED)},
                **values,
                "wait_verdict": _verdict(
                    values[CURRENT]["wait_mean_s"], values[CHANGED]["wait_mean_s"], "lower"
                ),
            }
        )
    return rows


def _time_unit(seconds: float) -> tuple[float, str]:
    if seconds >= 2 * 3600:
        return 3600.0, "hours"
    if seconds >= 120:
        return 60.0, "minutes"
    return 1.0, "seconds"


def figures(results: dict[str, SimResult], since: datetime) -> dict[str, dict]:
    """Plotly figures as plain {"data", "layout"} dicts (drawn by the page's local plotly.js);
    virtual time t is the date `since` + t."""
    teams = sorted(set(results[CURRENT].metrics["teams"]) | set(results[CHANGED].metrics["teams"]))

    def team_bars(key: str, title: str, line_at: float | None = None) -> dict:
        values = {
            side: [results[side].metrics["teams"].get(t, {}).get(key, 0.0) for t in teams]
            for side in (CURRENT, CHANGED)
        }
        scale, unit = _time_unit(max([0.0, *values[CURRENT], *values[CHANGED]]))
        layout = {
            "title": {"text": title},
            "barmode": "group",
            "yaxis": {"title": {"text": unit}, "rangemode": "tozero"},
            "margin": {"l": 55, "r": 10, "t": 40, "b": 40},
            "legend": {"orientation": "h"},
        }
        if line_at is not None:
            y = round(line_at / scale, 2)
            layout["shapes"] = [
                {
                    "type": "line",
                    "xref": "paper",
                    "x0": 0,
                    "x1": 1,
                    "y0": y,
                    "y1": y,
                    "line": {"color": "#b91c1c", "dash": "dash", "width": 1},
                }
            ]
        return {
            "data": [
                {
                    "type": "bar",
                    "name": side,
                    "x": teams,
                    "y": [round(v / scale, 2) for v in values[side]],
                    "marker": {"color": COLORS[side]},
                }
                for side in (CURRENT, CHANGED)
            ],
            "layout": layout,
        }

    def over_time(pick, title: str, ytitle: str) -> dict:
        data = []
        for side, result in results.items():
            ts, busy, queued = result.series
            x, y = binned(ts, pick(result, busy, queued), bins=CHART_BINS)
            data.append(
                {
                    "type": "scatter",
                    "mode": "lines",
                    "name": side,
                    "x": [_plotly_date(since + timedelta(seconds=t)) for t in x],
                    "y": [round(v, 4) for v in y],
                    "line": {"color": COLORS[side]},
                }
            )
        return {
            "data": data,
            "layout": {
                "title": {"text": f"{title} (UTC)"},
                "xaxis": {"type": "date"},
                "yaxis": {"title": {"text": ytitle}, "rangemode": "tozero"},
                "margin": {"l": 55, "r": 10, "t": 40, "b": 70},
                "legend": {"orientation": "h", "y": -0.3},
            },
        }

    return {
        "team_wait": team_bars("wait_mean_s", "Mean wait by team"),
        "team_reclaim": team_bars(
            "reclaim_max_s",
            "Longest reclaim by team (dashed: the live bound)",
            line_at=reclaim_bound_s("reclaim"),
        ),
        "utilization": over_time(
            lambda r, busy, queued: [b / max(r.metrics["gpus"], 1) for b in busy],
            "GPU utilization over time",
            "busy GPUs / GPUs",
        ),
        "queue": over_time(lambda r, busy, queued: queued, "Queued jobs over time", "jobs queued"),
    }


def _plotly_date(moment: datetime) -> str:
    """plotly.js reads dates without a zone (it would drop the offset): UTC, to the ms."""
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def _finite(value):
    """The metrics with non-finite floats as None (PostgreSQL's JSON has no Infinity)."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
