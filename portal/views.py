"""Server-rendered portal pages. State changes go through jobs.actions / teams.actions."""

from datetime import timedelta
from functools import wraps
from pathlib import Path

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.contrib.auth.views import redirect_to_login
from django.db.models import Count, Prefetch, Q
from django.http import FileResponse, Http404, HttpResponseBadRequest, JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_POST

from jobs import actions, whatif
from jobs.checkpoint_policy import checkpoint_advice
from jobs.goodput import job_goodput
from jobs.models import (
    PRIORITY_RANK,
    Allocation,
    Attempt,
    Checkpoint,
    Job,
    ModelVersion,
    Node,
    PreemptionRequest,
    WhatIfRun,
)
from jobs.reclaim import KINDS, reclaim_bound_s, reclaim_summary
from portal.forms import (
    JobForm,
    JobSpecForm,
    RegisterModelForm,
    TeamQuotaForm,
    WhatIfForm,
    job_spec,
    spec_as_form_data,
)
from teams import actions as team_actions
from teams.access import is_cluster_admin, visible_jobs, visible_teams
from teams.models import Team


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


def _queue_positions() -> dict[int, int]:
    """Queued job id -> its place in the start order the scheduler estimates (1 = next):
    by estimated start, then priority, then submit time; jobs without an estimate last."""
    queued = Job.objects.filter(state=Job.State.QUEUED).values_list(
        "id", "estimated_start_at", "priority", "submitted_at"
    )
    order = sorted(
        queued,
        key=lambda row: (
            row[1] is None,
            row[1] or row[3],
            -PRIORITY_RANK.get(row[2], 0),
            row[3],
            row[0],
        ),
    )
    return {row[0]: place for place, row in enumerate(order, start=1)}


def _runtime_s(job: Job, now) -> float:
    """Seconds the job's attempts have run (start-up included), all attempts together."""
    total = 0.0
    for attempt in job.attempts.all():
        start = attempt.running_at or attempt.created_at
        total += max(((attempt.ended_at or now) - start).total_seconds(), 0.0)
    return total


@login_required
def home(request):
    now = timezone.now()
    jobs = list(
        visible_jobs(request.user)
        .select_related("team", "owner")
        .prefetch_related(Prefetch("attempts", queryset=Attempt.objects.order_by("number")))
        .order_by("-id")[:100]
    )
    positions = _queue_positions() if any(j.state == Job.State.QUEUED for j in jobs) else {}
    rows = []
    for job in jobs:
        goodput = job_goodput(job, now=now) if job.first_started_at else None
        rows.append(
            {
                "job": job,
                "position": positions.get(job.id),
                "runtime": _seconds(_runtime_s(job, now)) if job.first_started_at else "—",
                "goodput": goodput["effective"] if goodput else None,
            }
        )
    teams = []
    for team in _team_usage(visible_teams(request.user)).order_by("name"):
        scale = max(team.gpu_cap, team.used, 1)
        teams.append(
            {
                "team": team,
                "used_pct": round(100 * min(team.used, team.quota) / scale, 1),
                "borrowed_pct": round(100 * max(team.used - team.quota, 0) / scale, 1),
                "quota_pct": round(100 * team.quota / scale, 1),
                "queued": sum(
                    1 for j in jobs if j.team_id == team.id and j.state == Job.State.QUEUED
                ),
            }
        )
    return render(request, "home.html", {"rows": rows, "teams": teams, "now": now})


@login_required
def submit_job(request):
    teams = visible_teams(request.user)
    spec_form = JobSpecForm()
    status = 200
    if request.method == "POST" and "load_spec" in request.POST:
        # A saved spec fills the form; it is checked like a submission but never submitted.
        spec_form = JobSpecForm(request.POST, request.FILES)
        if spec_form.is_valid():
            # Fields the spec leaves out take the form's defaults, as if typed in.
            data = {
                name: field.initial
                for name, field in JobForm.base_fields.items()
                if field.initial is not None
            }
            data.update(spec_as_form_data(spec_form.cleaned_data["spec"]))
            form = JobForm(data, teams=teams)
            if form.is_valid():
                messages.info(request, "Spec loaded: check the fields, then submit.")
            else:
                status = 400
        else:
            form = JobForm(initial=_submit_initial(request, teams), teams=teams)
            status = 400
    elif request.method == "POST":
        form = JobForm(request.POST, teams=teams)
        if form.is_valid():
            data = dict(form.cleaned_data)
            team = data.pop("team")
            job = actions.do_submit_job(owner=request.user, team=team, now=timezone.now(), **data)
            messages.success(request, f"Job {job.id} submitted.")
            return redirect("job", job_id=job.id)
        status = 400
    else:
        form = JobForm(initial=_submit_initial(request, teams), teams=teams)
    source = request.GET.get("from", "") if request.method == "GET" else ""
    return render(
        request,
        "submit.html",
        {"form": form, "spec_form": spec_form, "from_job": source if source.isdigit() else ""},
        status=status,
    )


def _submit_initial(request, teams) -> dict:
    """Resubmit (?from=<job id>): that job's fields, if the user may see it."""
    source = request.GET.get("from", "")
    if source.isdigit():
        previous = visible_jobs(request.user).select_related("team").filter(pk=int(source)).first()
        if previous is not None:
            return spec_as_form_data(job_spec(previous))
    if teams.count() == 1:
        return {"team": teams.first().name}
    return {}


@login_required
def job_spec_download(request, job_id: int):
    job = _job_or_404(request.user, job_id)
    response = JsonResponse(job_spec(job), json_dumps_params={"indent": 2})
    response["Content-Disposition"] = f'attachment; filename="job-{job.id}-spec.json"'
    return response


# Event kinds on the job page's timeline, by what they mean to the person watching the job.
TIMELINE_KINDS = {
    "start": (
        "job.submitted",
        "attempt.started",
        "attempt.running",
        "attempt.trainer_started",
        "job.succeeded",
    ),
    "failure": (
        "attempt.failed",
        "attempt.lost",
        "attempt.hang_detected",
        "attempt.straggler",
        "job.failed",
        "job.time_limit",
    ),
    "restart": (
        "job.restarting",
        "job.requeued",
        "checkpoint.recovered",
        "attempt.shrunk",  # elastic: restarted smaller
        "job.growing",  # elastic: stopped to restart at full size
    ),
    "preemption": ("job.preempting", "attempt.preempted", "attempt.stopping"),
    "checkpoint": ("checkpoint.committed", "model.registered", "model.exported"),
}


def _timeline_kind(kind: str) -> str:
    if kind.startswith("preemption."):
        return "preemption"
    for group, kinds in TIMELINE_KINDS.items():
        if kind in kinds:
            return group
    return "other"


@login_required
def job_page(request, job_id: int):
    job = _job_or_404(request.user, job_id)
    now = timezone.now()
    attempts = list(
        job.attempts.order_by("number").prefetch_related(
            Prefetch("allocations", queryset=Allocation.objects.select_related("node", "gpu"))
        )
    )
    events = list(job.events.select_related("node").order_by("-id")[:500])
    checkpoints = list(
        job.checkpoints.filter(deleted_at__isnull=True)
        .select_related("attempt")
        .annotate(registered=Count("versions"))
        .order_by("-step")
    )
    world = max((len(a.allocations.all()) for a in attempts), default=job.gpus) or job.gpus
    timeline = {
        "now": now.isoformat(),
        "attempts": [
            {
                "number": a.number,
                "state": a.state,
                "start": a.created_at.isoformat(),
                "running": a.running_at.isoformat() if a.running_at else None,
                "end": a.ended_at.isoformat() if a.ended_at else None,
                "reason": a.end_reason,
                "resumed_from_step": a.resumed_from_step,
                "last_step": a.last_step,
            }
            for a in attempts
        ],
        "events": [
            {
                "time": e.created_at.isoformat(),
                "kind": e.kind,
                "group": _timeline_kind(e.kind),
                "message": e.message,
            }
            for e in reversed(events)
        ],
    }
    goodput = job_goodput(job, now=now)
    return render(
        request,
        "job.html",
        {
            "job": job,
            "attempts": attempts,
            "events": events,
            "checkpoints": checkpoints,
            "goodput": goodput,
            "advice": checkpoint_advice(job),
            "ranks": list(range(world)),
            "page_data": {
                "job": job.id,
                "name": job.name,
                "state": job.state,
                "ranks": world,
                "timeline": timeline,
                "max_points": CHART_POINTS,
            },
        },
    )


CHART_POINTS = 2000  # points per rank a chart asks for; the server keeps each bucket's min/max


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
        messages.error(
            request,
            f"Checkpoint at step {checkpoint.step} not registered: "
            + "; ".join(e for errs in form.errors.values() for e in errs),
        )
        return redirect(reverse("job", args=[checkpoint.job_id]) + "#checkpoints")
    version = actions.do_register_model_version(
        name=form.cleaned_data["name"],
        checkpoint=checkpoint,
        actor=request.user,
        now=timezone.now(),
        notes=form.cleaned_data["notes"],
    )
    messages.success(request, f"Registered {version.name} v{version.version}.")
    return redirect(reverse("models") + f"#v{version.id}")


@login_required
def model_registry(request):
    versions = list(
        ModelVersion.objects.filter(job__in=visible_jobs(request.user))
        .select_related("job__team", "checkpoint__attempt", "created_by")
        .order_by("name", "-version")
    )
    models = {}
    for version in versions:
        models.setdefault(version.name, []).append(version)
    return render(request, "models.html", {"models": models, "count": len(versions)})


@login_required
def model_weights(request, version_id: int):
    """The version's consolidated state dict (one torch.save file, written by the export)."""
    version = (
        ModelVersion.objects.filter(pk=version_id, job__in=visible_jobs(request.user))
        .only("name", "version", "export_state", "export_path")
        .first()
    )
    if version is None:
        raise Http404("No such model version.")
    path = Path(version.export_path) if version.export_path else None
    if version.export_state != ModelVersion.ExportState.READY or not path or not path.is_file():
        raise Http404("The weights are not exported (yet).")
    return FileResponse(
        path.open("rb"),
        as_attachment=True,
        filename=f"{version.name}-v{version.version}-state_dict.pt",
    )


# Team colours on the cluster grid: stable per team (by id), readable with white text.
TEAM_COLOURS = (
    "#2563eb",
    "#059669",
    "#d97706",
    "#7c3aed",
    "#db2777",
    "#0891b2",
    "#65a30d",
    "#dc2626",
    "#4f46e5",
    "#0d9488",
)


@login_required
def cluster(request):
    nodes = Node.objects.prefetch_related("gpus").order_by("rack", "name")
    live = {
        a.gpu_id: a
        for a in Allocation.objects.filter(released_at__isnull=True).select_related(
            "attempt__job__team"
        )
    }
    visible = set(visible_jobs(request.user).values_list("id", flat=True))
    legend = {}
    rows = []
    counts = {"gpus": 0, "busy": 0, "nodes": 0, "down": 0}
    for node in nodes:
        readings = {t.get("index"): t for t in node.telemetry or [] if isinstance(t, dict)}
        cells = []
        for gpu in node.gpus.all():
            allocation = live.get(gpu.id)
            job = allocation.attempt.job if allocation else None
            shown = job is not None and job.id in visible
            reading = readings.get(gpu.index, {})
            colour = TEAM_COLOURS[job.team_id % len(TEAM_COLOURS)] if shown else None
            if shown:
                legend[job.team.name] = colour
            cells.append(
                {
                    "index": gpu.index,
                    "job": job if shown else None,
                    "busy": job is not None,
                    "rank": allocation.rank if allocation else None,
                    "colour": colour,
                    "util": reading.get("util"),
                    "mem_used": reading.get("mem_used"),
                    "mem_total": reading.get("mem_total"),
                }
            )
            counts["gpus"] += 1
            counts["busy"] += job is not None
        counts["nodes"] += 1
        counts["down"] += node.state == Node.State.DOWN
        rows.append({"node": node, "gpus": cells})
    return render(
        request,
        "cluster.html",
        {"rows": rows, "legend": sorted(legend.items()), "counts": counts},
    )


@console_staff_required
def team_quotas(request):
    if request.method == "POST":
        team_id = request.POST.get("team_id", "")
        team = Team.objects.filter(pk=int(team_id)).first() if team_id.isdigit() else None
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


@console_staff_required
def preemptions(request):
    if request.method == "POST":
        request_id = request.POST.get("request_id", "")
        preemption = (
            PreemptionRequest.objects.filter(pk=int(request_id)).first()
            if request_id.isdigit()
            else None
        )
        if preemption is None:
            raise Http404("No such preemption.")
        decision = request.POST.get("decision")
        if decision not in ("approve", "reject"):
            # Only an explicit choice decides: a missing or mistyped one must not reject.
            return HttpResponseBadRequest("decision must be 'approve' or 'reject'")
        preemption = actions.do_decide_preemption(
            preemption, approve=decision == "approve", actor=request.user, now=timezone.now()
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
