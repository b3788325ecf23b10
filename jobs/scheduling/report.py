"""An HTML report of simulator runs: one self-contained file, plotly.js inlined, no CDN.

Charts: utilization over time, queue length over time (time-weighted means per bin), and the
wait distribution (CDF) per job-size class; one line per policy; a metrics table on top.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Sequence
from pathlib import Path

from jobs.scheduling.sim_metrics import pct_sorted
from jobs.scheduling.simulate import SimResult
from jobs.scheduling.trace import SIZE_CLASSES

BINS = 600
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")
TABLE_KEYS = (
    "utilization",
    "utilization_when_backlogged",
    "wait_mean_s",
    "wait_p99_s",
    "jct_mean_s",
    "jct_median_s",
    "jct_p99_s",
    "ftf_max",
    "reclaim_max_s",
    "reclaims_over_bound",
    "reclaims_over_their_bound",
    "preempted_gpu_hours",
    "starved",
    "jobs",
    "dropped",
    "makespan_s",
    "plan_calls",
    "plan_time_s",
    "wall_s",
)


def binned(ts: Sequence[float], values: Sequence[float], bins: int = BINS):
    """Time-weighted mean of a step function (value[k] holds on [t[k], t[k+1])) per bin."""
    if len(ts) < 2:
        return list(ts), list(values)
    start, end = ts[0], ts[-1]
    width = (end - start) / bins or 1.0
    sums = [0.0] * bins
    for k in range(len(ts) - 1):
        a, b, v = ts[k], ts[k + 1], values[k]
        i = min(int((a - start) / width), bins - 1)
        while a < b:
            edge = b if i == bins - 1 else min(b, start + (i + 1) * width)
            # A bin edge that rounds to `a` or below it (floats) means `a` is already in the
            # next bin: move on rather than stop, or the rest of the segment is lost.
            if edge > a:
                sums[i] += v * (edge - a)
                a = edge
            i += 1
    centers = [start + (i + 0.5) * width for i in range(bins)]
    return centers, [s / width for s in sums]


def _figures(results: Sequence[SimResult]):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    util = go.Figure()
    queue = go.Figure()
    waits = make_subplots(
        rows=1, cols=len(SIZE_CLASSES), subplot_titles=[f"{c} GPU(s)" for c in SIZE_CLASSES]
    )
    for n, result in enumerate(results):
        color = COLORS[n % len(COLORS)]
        ts, busy, queued = result.series
        gpus = result.metrics["gpus"]
        x, y = binned(ts, [b / gpus for b in busy])
        util.add_scatter(x=[t / 86400 for t in x], y=y, name=result.policy, line_color=color)
        x, y = binned(ts, queued)
        queue.add_scatter(x=[t / 86400 for t in x], y=y, name=result.policy, line_color=color)
        for col, cls in enumerate(SIZE_CLASSES, start=1):
            w = sorted(result.waits.get(cls, []))
            if not w:
                continue
            qs = [q / 2 for q in range(201)]
            waits.add_scatter(
                x=[pct_sorted(w, q) / 3600 for q in qs],
                y=[q / 100 for q in qs],
                name=result.policy,
                line_color=color,
                legendgroup=result.policy,
                showlegend=col == 1,
                row=1,
                col=col,
            )
    util.update_layout(
        title="GPU utilization over time (time-weighted mean per bin)",
        xaxis_title="day",
        yaxis_title="busy GPUs / GPUs",
        yaxis_range=[0, 1.02],
    )
    queue.update_layout(
        title="Queued jobs over time (time-weighted mean per bin)",
        xaxis_title="day",
        yaxis_title="jobs queued",
    )
    waits.update_layout(title="Wait time distribution by job size (CDF of completed jobs)")
    waits.update_xaxes(title_text="wait (hours)")
    waits.update_yaxes(title_text="fraction of jobs", col=1)
    return util, queue, waits


def _table(results: Sequence[SimResult]) -> str:
    head = "".join(f"<th>{html.escape(r.policy)}</th>" for r in results)
    rows = []
    for key in TABLE_KEYS:
        cells = "".join(f"<td>{html.escape(str(r.metrics.get(key, '')))}</td>" for r in results)
        rows.append(f"<tr><th>{key}</th>{cells}</tr>")
    for cls in SIZE_CLASSES:
        for key in ("jobs", "wait_mean_s", "jct_mean_s"):
            cells = "".join(
                f"<td>{r.metrics['by_size'][cls][key]}</td>"
                for r in results
                if "by_size" in r.metrics
            )
            rows.append(f"<tr><th>{cls} GPU(s): {key}</th>{cells}</tr>")
    return f"<table><tr><th>metric</th>{head}</tr>{''.join(rows)}</table>"


def write_report(results: Iterable[SimResult], path: str | Path, title: str = "") -> Path:
    """Write one self-contained HTML file; plotly.js comes from the installed plotly package."""
    import plotly.io as pio
    from plotly.offline import get_plotlyjs

    results = list(results)
    figures = _figures(results)
    divs = "\n".join(
        pio.to_html(fig, full_html=False, include_plotlyjs=False, config={"displaylogo": False})
        for fig in figures
    )
    title = title or "Lockstep scheduler simulation"
    page = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5em; }}
table {{ border-collapse: collapse; margin-bottom: 1em; }}
th, td {{ border: 1px solid #ccc; padding: 2px 8px; text-align: right; }}
</style>
<script>{get_plotlyjs()}</script>
</head><body>
<h1>{html.escape(title)}</h1>
{_table(results)}
{divs}
</body></html>
"""
    path = Path(path)
    path.write_text(page, encoding="utf-8")
    return path
