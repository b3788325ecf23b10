"""A what-if's results (jobs.whatif runs it): the two runs' metrics side by side with which way
each moved, a row per team, and the Plotly figures of the results page, all plain JSON."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

from jobs.reports.reclaim import reclaim_bound_s
from jobs.scheduling.report import binned
from jobs.scheduling.simulate import SimResult
from jobs.scheduling.trace import SIZE_CLASSES

CURRENT, CHANGED = "current", "changed"
COLORS = {CURRENT: "#94a3b8", CHANGED: "#2563eb"}
CHART_BINS = 200


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


def finite(value):
    """The metrics with non-finite floats as None (PostgreSQL's JSON has no Infinity)."""
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
