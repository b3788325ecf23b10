"""Server-rendered portal pages. State changes go through jobs.actions / teams.actions."""

import json
from datetime import timedelta
from functools import wraps

from django.contrib import messages
from django.contrib.admin.views.decorators import staff_member_required
from django.contrib.auth.decorators import login_required
from django.contrib.auth.views import redirect_to_login
from django.db.models import Count, Prefetch, Q
from django.http import Http404
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from jobs import actions, whatif
from jobs.checkpoint_policy import checkpoint_advice
from jobs.goodput import job_goodput
from jobs.models import (
    Allocation,
    Checkpoint,
    Job,
    ModelVersion,
    Node,
    PreemptionRequest,
    WhatIfRun,
)
from jobs.reclaim import KINDS, reclaim_bound_s, reclaim_summary
from portal.forms import JobForm, RegisterModelForm, TeamQuotaForm, WhatIfForm
from teams import actions as team_actions
from teams.access import is_cluster_admin, visible_jobs, visible_teams
from teams.models import Team


def _job_or_404(user, job_id: int) -> Job:
    job = visible_jobs(user).select_related("team", "owner").filter(pk=job_id).first()
    if job is None:
        raise Http404("No such job.")
    return job


def _team_usage(teams):
    return teams.annotate(
        used=Count(
            "jobs__attempts__allocations",
            filter=Q(jobs__attempts__allocations__released_at__isnull=True),
        )
    )


@login_required
def home(request):
    jobs = visible_jobs(request.user).select_related("team", "owner").order_by("-id")[:100]
    return render(
        request,
        "home.html",
        {
            "jobs": jobs,
            "teams": _team_usage(visible_teams(request.user)),
        },
    )


@login_required
def submit_job(request):
    teams = visible_teams(request.user)
    initial = {}
    source = request.GET.get("from")
    if source and source.isdigit():
        previous = visible_jobs(request.user).filter(pk=int(source)).first()
        if previous:
            import shlex

            initial = {
                "name": previous.name,
                "team": previous.team.name,
                "image": previous.image,
                "command": shlex.join(previous.command),
                "dataset": previous.dataset,
                "gpus": previous.gpus,
                "priority": previous.priority,
                "max_restarts": previous.max_restarts,
                "time_limit_s": previous.time_limit_s,
                "env": json.dumps(previous.env) if previous.env else "",
            }
    if request.method == "POST":
        form = JobForm(request.POST, teams=teams)
        if form.is_valid():
            data = dict(form.cleaned_data)
            team = data.pop("team")
            job = actions.do_submit_job(owner=request.user, team=team, now=timezone.now(), **data)
            messages.success(request, f"Job {job.id} submitted.")
            return redirect("job", job_id=job.id)
    else:
        if not initial and teams.count() == 1:
            initial["team"] = teams.first().name
        form = JobForm(initial=initial, teams=teams)
    return render(request, "submit.html", {"form": form})


@login_required
def job_page(request, job_id: int):
    job = _job_or_404(request.user, job_id)
    attempts = job.attempts.order_by("number").prefetch_related(
        Prefetch("allocations", queryset=Allocation.objects.select_related("node", "gpu"))
    )
    return render(
        request,
        "job.html",
        {
            "job": job,
            "attempts": attempts,
            "events": job.events.select_related("node").order_by("-id")[:200],
            "checkpoints": job.checkpoints.filter(deleted_at__isnull=True).order_by("-step"),
            "goodput": job_goodput(job),
            "advice": checkpoint_advice(job),
            "register_form": RegisterModelForm(initial={"name": job.name}),
        },
    )


@login_required
@require_POST
def cancel_job(request, job_id: int):
    job = _job_or_404(request.user, job_id)
    actions.do_cancel_job(job, actor=request.user, now=timezone.now())
    messages.info(request, f"Job {job.id} cancelled.")
    return redirect("job", job_id=job.id)


@login_required
@require_POST
def register_model(request, checkpoint_id: int):
    checkpoint = (
        Checkpoint.objects.filter(
            pk=checkpoint_id, job__in=visible_jobs(request.user), deleted_at__isnull=True
        )
        .select_related("job")
        .first()
    )
    if checkpoint is None:
        raise Http404("No such checkpoint.")
    form = RegisterModelForm(request.POST)
    if not form.is_valid():
        messages.error(request, "; ".join(e for errs in form.errors.values() for e in errs))
        return redirect("job", job_id=checkpoint.job_id)
    version = actions.do_register_model_version(
        name=form.cleaned_data["name"],
        checkpoint=checkpoint,
        actor=request.user,
        now=timezone.now(),
        notes=form.cleaned_data["notes"],
    )
    messages.success(request, f"Registered {version.name} v{version.version}.")
    return redirect("models")


@login_required
def model_registry(request):
    versions = (
        ModelVersion.objects.filter(job__in=visible_jobs(request.user))
        .select_related("job__team", "checkpoint__attempt", "created_by")
        .order_by("name", "-version")
    )
    return render(request, "models.html", {"versions": versions})


@login_required
def cluster(request):
    nodes = Node.objects.prefetch_related("gpus").order_by("name")
    live = {
        a.gpu_id: a
        for a in Allocation.objects.filter(released_at__isnull=True).select_related(
            "attempt__job__team"
        )
    }
    visible = set(visible_jobs(request.user).values_list("id", flat=True))
    rows = []
    for node in nodes:
        cells = []
        for gpu in node.gpus.all():
            allocation = live.get(gpu.id)
            job = allocation.attempt.job if allocation else None
            cells.append(
                {"index": gpu.index, "job": job, "visible": job is not None and job.id in visible}
            )
        rows.append({"node": node, "gpus": cells})
    return render(request, "cluster.html", {"rows": rows})


@staff_member_required
def team_quotas(request):
    if request.method == "POST":
        team = Team.objects.filter(pk=request.POST.get("team_id")).first()
        if team is None:
            raise Http404("No such team.")
        form = TeamQuotaForm(request.POST, instance=Team.objects.get(pk=team.pk))
        if form.is_valid():
            team_actions.do_set_team_quota(
                team,
                quota=form.cleaned_data["quota"],
                borrow_limit=form.cleaned_data["borrow_limit"],
                weight=form.cleaned_data["weight"],
                actor=request.user,
            )
            messages.success(request, f"Team {team.name}: quota {form.cleaned_data['quota']}.")
            return redirect("team_quotas")
        errors = {team.pk: form}
    else:
        errors = {}
    teams = _team_usage(Team.objects.all())
    rows = [{"team": t, "form": errors.get(t.pk) or TeamQuotaForm(instance=t)} for t in teams]
    return render(request, "team_quotas.html", {"rows": rows})


@staff_member_required
def preemptions(request):
    if request.method == "POST":
        preemption = PreemptionRequest.objects.filter(pk=request.POST.get("request_id")).first()
        if preemption is None:
            raise Http404("No such preemption.")
        approve = request.POST.get("decision") == "approve"
        preemption = actions.do_decide_preemption(
            preemption, approve=approve, actor=request.user, now=timezone.now()
        )
        messages.success(request, f"Preemption {preemption.id}: {preemption.state}.")
        return redirect("preemptions")
    requests = PreemptionRequest.objects.select_related(
        "victim__team", "claimant__team", "decided_by"
    ).order_by("-id")[:200]
    days = request.GET.get("days", "")
    days = int(days) if days.isdigit() and 1 <= int(days) <= 365 else REPORT_DAYS
    now = timezone.now()
    reclaim = reclaim_summary(since=now - timedelta(days=days), now=now)
    return render(
        request,
        "preemptions.html",
        {
            "requests": requests,
            "reclaim": [
                {
                    **row,
                    "median": _seconds(row["median_s"]),
                    "max": _seconds(row["max_s"]),
                    "oldest": _seconds(row["oldest_waiting_s"]),
                }
                for row in sorted(reclaim.values(), key=lambda r: r["team"])
            ],
            "reclaim_days": days,
            "bounds": [(kind, _seconds(reclaim_bound_s(kind))) for kind in KINDS],
        },
    )


REPORT_DAYS = 7  # console reports look back this far unless ?days= says otherwise


def console_staff_required(view):
    """Cluster admins only. Anonymous users are sent to log in; anyone else gets the 404 a
    missing page gets (a denial that leaks nothing, DESIGN.md section 10)."""

    @wraps(view)
    def wrapped(request, *args, **kwargs):
        if not request.user.is_authenticated:
            return redirect_to_login(request.get_full_path())
        if not is_cluster_admin(request.user):
            raise Http404("No such page.")
        return view(request, *args, **kwargs)

    return wrapped


def _seconds(value) -> str:
    """A duration for people: 42 s, 12.5 min, 3.2 h, 2.1 d."""
    if value is None:
        return "—"
    value = float(value)
    if value < 120:
        return f"{value:.0f} s"
    if value < 2 * 3600:
        return f"{value / 60:.1f} min"
    if value < 2 * 86400:
        return f"{value / 3600:.1f} h"
    return f"{value / 86400:.1f} d"


def _format(value, unit: str) -> str:
    if value is None:
        return "—"
    if unit == "s":
        return _seconds(value)
    if unit == "%":
        return f"{100 * value:.1f}%"
    if unit == "h":
        return f"{value:,.1f} GPU-h"
    if unit == "x":
        return f"{value:.2f}x"
    return f"{value:,}"


@console_staff_required
def whatif_form(request):
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


@console_staff_required
def whatif_result(request, run_id: int):
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
                    "current_text": _format(row["current"], row["unit"]),
                    "changed_text": _format(row["changed"], row["unit"]),
                }
                for row in result["summary"]
            ],
            teams=[
                {
                    **row,
                    "cells": [
                        (
                            _format(row["current"][key], unit),
                            _format(row["changed"][key], unit),
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
