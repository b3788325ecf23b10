"""The console's what-if pages (admins): replay the recent past under other quotas or a
bigger cluster through the simulator, and read the result beside what happened."""

from __future__ import annotations

from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone

from jobs import whatif
from jobs.models import (
    WhatIfRun,
)
from portal.console.access import console_view
from portal.formatting import duration
from portal.forms import WhatIfForm
from teams.models import Team


def format_value(value, unit: str) -> str:
    if value is None:
        return "—"
    if unit == "s":
        return duration(value)
    if unit == "%":
        return f"{100 * value:.1f}%"
    if unit == "h":
        return f"{value:,.1f} GPU-h"
    if unit == "x":
        return f"{value:.2f}x"
    return f"{value:,}"


@console_view(admin_only=True)
def whatif_form(request, scope):
    teams = Team.objects.order_by("name")
    cluster = whatif.current_cluster()
    now = timezone.now()
    if request.method == "POST":
        form = WhatIfForm(request.POST, teams=teams, cluster=cluster, now=now)
        if form.is_valid():
            data = form.cleaned_data
            run = whatif.do_request_whatif(
                actor=request.user,
                since=data["since"],
                until=data["until"],
                gpus=data["gpus"],
                teams=form.overrides(),
                now=now,
                policy=form.policy(),
            )
            return redirect("whatif_result", run_id=run.id)
        status = 400
    else:
        form = WhatIfForm(teams=teams, cluster=cluster, now=now)
        status = 200
    runs = WhatIfRun.objects.select_related("created_by").order_by("-id")[:20]
    return render(
        request,
        "whatif.html",
        {
            "form": form,
            "cluster": cluster,
            "runs": runs,
            "inline_max": whatif.inline_limit(),
            "max_days": whatif.MAX_WINDOW_DAYS,
        },
        status=status,
    )


@console_view(admin_only=True)
def whatif_result(request, scope, run_id: int):
    run = get_object_or_404(WhatIfRun.objects.select_related("created_by"), pk=run_id)
    context = {
        "run": run,
        "pending": run.state in (WhatIfRun.State.QUEUED, WhatIfRun.State.RUNNING),
    }
    result = run.result or {}
    if run.state == WhatIfRun.State.DONE and result:
        context.update(
            trace=result["trace"],
            inputs=result["inputs"],
            changes=whatif.describe_changes(result["inputs"]),
            summary=[
                {
                    **row,
                    "current_text": format_value(row["current"], row["unit"]),
                    "changed_text": format_value(row["changed"], row["unit"]),
                }
                for row in result["summary"]
            ],
            teams=[
                {
                    **row,
                    "cells": [
                        (
                            format_value(row["current"][key], unit),
                            format_value(row["changed"][key], unit),
                            row["current"][key] != row["changed"][key],
                        )
                        for key, _, unit in TEAM_COLUMNS
                    ],
                }
                for row in result["teams"]
            ],
            team_columns=[label for _, label, _ in TEAM_COLUMNS],
            figures=result["figures"],
            never_started={
                side: result["metrics"][side]["never_started"] for side in ("current", "changed")
            },
        )
    return render(request, "whatif_result.html", context)


TEAM_COLUMNS = (  # key in the result's per-team figures, heading, unit
    ("jobs", "Jobs", "n"),
    ("completed", "Finished", "n"),
    ("wait_mean_s", "Mean wait", "s"),
    ("wait_p99_s", "p99 wait", "s"),
    ("wait_max_s", "Longest wait", "s"),
    ("reclaims", "Reclaims", "n"),
    ("reclaim_median_s", "Median reclaim", "s"),
    ("reclaim_max_s", "Longest reclaim", "s"),
)
