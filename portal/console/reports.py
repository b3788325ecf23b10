"""The console's usage report page: GPU-hours per team and week as charts, a table and CSV
(the figures come from jobs.reports.usage)."""

from __future__ import annotations

import csv
from collections import defaultdict
from urllib.parse import urlencode

from django import forms
from django.http import HttpResponse
from django.shortcuts import render
from django.utils import timezone

from jobs.reports.usage import usage_report
from portal.console.access import console_view

MAX_WEEKS = 52
DEFAULT_WEEKS = 4


class ReportForm(forms.Form):
    weeks = forms.IntegerField(min_value=1, max_value=MAX_WEEKS, initial=DEFAULT_WEEKS)


PALETTE = ("#2563eb", "#ea580c", "#16a34a", "#9333ea", "#dc2626", "#0891b2", "#ca8a04", "#db2777")


def report_figures(report: dict, *, with_idle: bool) -> dict:
    """Plotly figures (plain dicts) of a usage report."""
    weeks = [str(w) for w in report["weeks"]]
    by_team: dict[str, dict] = defaultdict(dict)
    for row in report["rows"]:
        by_team[row["team"]][str(row["week"])] = row
    color = {team: PALETTE[i % len(PALETTE)] for i, team in enumerate(by_team)}
    usage = [
        {
            "type": "bar",
            "name": team,
            "x": weeks,
            "y": [cells[w]["used_h"] for w in weeks],
            "marker": {"color": color[team]},
        }
        for team, cells in by_team.items()
    ]
    if with_idle:
        usage.append(
            {
                "type": "bar",
                "name": "idle",
                "x": weeks,
                "y": [c["idle_h"] for c in report["cluster"]],
                "marker": {"color": "#d1d5db"},
            }
        )
    lost = []
    for team, cells in by_team.items():
        for key, cause, pattern in (
            ("lost_failure_h", "failures", ""),
            ("lost_preemption_h", "preemption", "/"),
        ):
            lost.append(
                {
                    "type": "bar",
                    "name": f"{team}: {cause}",
                    "x": weeks,
                    "y": [cells[w][key] for w in weeks],
                    "marker": {"color": color[team], "pattern": {"shape": pattern}},
                }
            )
    layout = {
        "barmode": "stack",
        "margin": {"l": 50, "r": 10, "t": 40, "b": 30},
        "legend": {"orientation": "h", "y": -0.15},
        "xaxis": {"type": "category"},
    }
    return {
        "usage": {
            "data": usage,
            "layout": {
                **layout,
                "title": {
                    "text": "GPU-hours used per week (from Monday, UTC)"
                    + (", and idle" if with_idle else "")
                },
                "yaxis": {"title": {"text": "GPU-hours"}},
            },
        },
        "lost": {
            "data": lost,
            "layout": {
                **layout,
                "title": {"text": "GPU-hours lost to failures and preemption"},
                "yaxis": {"title": {"text": "GPU-hours"}},
            },
        },
    }


CSV_COLUMNS = (
    "week",
    "team",
    "gpu_hours_used",
    "gpu_hours_lost_failures",
    "gpu_hours_lost_preemption",
    "goodput",
    "cluster_gpu_hours",
    "cluster_gpu_hours_idle",
)


def _csv(report: dict, *, with_cluster: bool) -> HttpResponse:
    response = HttpResponse(content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = 'attachment; filename="lockstep-usage.csv"'
    writer = csv.writer(response)
    writer.writerow(CSV_COLUMNS)
    for row in report["rows"]:
        writer.writerow(
            [
                row["week"],
                row["team"],
                row["used_h"],
                row["lost_failure_h"],
                row["lost_preemption_h"],
                "" if row["goodput"] is None else row["goodput"],
                "",
                "",
            ]
        )
    if with_cluster:
        for c in report["cluster"]:
            writer.writerow(
                [c["week"], "*", c["allocated_h"], "", "", "", c["capacity_h"], c["idle_h"]]
            )
    return response


@console_view()
def reports(request, scope):
    form = ReportForm(request.GET if "weeks" in request.GET else None)
    if form.is_bound and not form.is_valid():
        if request.GET.get("format") == "csv":
            return HttpResponse(
                "; ".join(form.errors["weeks"]), status=400, content_type="text/plain"
            )
        weeks, status = DEFAULT_WEEKS, 400
    else:
        weeks, status = (form.cleaned_data["weeks"] if form.is_bound else DEFAULT_WEEKS), 200
    report = usage_report(now=timezone.now(), weeks=weeks, teams=scope.teams())
    if request.GET.get("format") == "csv":
        return _csv(report, with_cluster=scope.admin)
    return render(
        request,
        "console_reports.html",
        {
            "form": form,
            "report": report,
            "weeks": weeks,
            "scope": scope,
            "figures": report_figures(report, with_idle=scope.admin),
            "csv_query": urlencode({"weeks": weeks, "format": "csv"}),
        },
        status=status,
    )
