"""Server-rendered portal pages. State changes go through jobs.actions / teams.actions."""

from pathlib import Path

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.db.models import Count, Prefetch
from django.http import FileResponse, Http404, JsonResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_POST

from jobs import actions
from jobs.actions.ingest import STEP_METRICS
from jobs.checkpoint_policy import checkpoint_advice
from jobs.conf import lockstep_setting
from jobs.event_kinds import EventKind
from jobs.metrics_query import metric_names
from jobs.models import (
    PRIORITY_RANK,
    Allocation,
    Attempt,
    Checkpoint,
    Job,
    ModelVersion,
    Node,
)
from jobs.queries import job_events, progress, protection, teams_with_usage
from jobs.reports.estimates import band_text, recent_estimate_bands
from jobs.reports.goodput import job_goodput
from jobs.reports.layout import report as layout_report
from portal.formatting import duration
from portal.forms import (
    JobForm,
    JobSpecForm,
    RegisterModelForm,
    job_spec,
    spec_as_form_data,
)
from teams.access import visible_jobs, visible_teams


def _job_or_404(user, job_id: int) -> Job:
    job = visible_jobs(user).select_related("team", "owner").filter(pk=job_id).first()
    if job is None:
        raise Http404("No such job.")
    return job


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
    queued = any(j.state == Job.State.QUEUED for j in jobs)
    positions = _queue_positions() if queued else {}
    bands = recent_estimate_bands(now) if queued else {}
    rows = []
    for job in jobs:
        goodput = job_goodput(job, now=now) if job.first_started_at else None
        rows.append(
            {
                "job": job,
                "position": positions.get(job.id),
                "band": band_text(job.gpus, bands) if job.state == Job.State.QUEUED else "",
                "runtime": duration(_runtime_s(job, now)) if job.first_started_at else "—",
                "goodput": goodput["effective"] if goodput else None,
            }
        )
    teams = []
    for team in teams_with_usage(visible_teams(request.user)).order_by("name"):
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
def job_progress(request, job_id: int):
    """The job page's Progress row again (templates/job_progress.html): the page redraws it
    every few seconds while the job runs, so its step, pace and projected end stay current.
    Empty while the job runs no attempt that said how many steps it takes."""
    job = _job_or_404(request.user, job_id)
    return render(request, "job_progress.html", {"progress": progress(job, now=timezone.now())})


@login_required
def job_spec_download(request, job_id: int):
    job = _job_or_404(request.user, job_id)
    response = JsonResponse(job_spec(job), json_dumps_params={"indent": 2})
    response["Content-Disposition"] = f'attachment; filename="job-{job.id}-spec.json"'
    return response


# Event kinds on the job page's timeline, by what they mean to the person watching the job.
TIMELINE_KINDS = {
    "start": (
        EventKind.JOB_SUBMITTED,
        EventKind.ATTEMPT_STARTED,
        EventKind.ATTEMPT_RUNNING,
        EventKind.ATTEMPT_TRAINER_STARTED,
        EventKind.JOB_SUCCEEDED,
    ),
    "failure": (
        EventKind.ATTEMPT_FAILED,
        EventKind.ATTEMPT_LOST,
        EventKind.ATTEMPT_HANG_DETECTED,
        EventKind.JOB_FAILED,
        EventKind.JOB_TIME_LIMIT,
    ),
    "restart": (
        EventKind.JOB_RESTARTING,
        EventKind.JOB_REQUEUED,
        EventKind.CHECKPOINT_RECOVERED,
        EventKind.ATTEMPT_SHRUNK,  # elastic: restarted smaller
        EventKind.JOB_GROWING,  # elastic: stopped to restart at full size
    ),
    "preemption": (
        EventKind.JOB_PREEMPTING,
        EventKind.ATTEMPT_PREEMPTED,
        EventKind.ATTEMPT_STOPPING,
    ),
    # The attempt goes on: a slow rank is news, not a failure (a red mark on a healthy demo
    # job's timeline read as one).
    "warning": (EventKind.ATTEMPT_STRAGGLER,),
    "checkpoint": (
        EventKind.CHECKPOINT_COMMITTED,
        EventKind.MODEL_REGISTERED,
        EventKind.MODEL_EXPORTED,
    ),
}


def _timeline_kind(kind: str) -> str:
    if kind.startswith("preemption."):
        return "preemption"
    for group, kinds in TIMELINE_KINDS.items():
        if kind in kinds:
            return group
    return "other"


PLACEMENT_LISTED = 16  # ranks an attempt's row lists one by one; a wider one is summarised


def placement_text(allocations) -> str:
    """An attempt's GPUs for its row: "node-a:0→0, node-a:1→1" for a few ranks; for a wide
    gang (a whole-cluster job has 4,096) its rank and node counts and the first and last node."""
    if len(allocations) <= PLACEMENT_LISTED:
        return ", ".join(f"{a.node.name}:{a.gpu.index}→{a.rank}" for a in allocations)
    nodes = sorted({a.node.name for a in allocations})
    return f"{len(allocations):,} ranks on {len(nodes):,} nodes ({nodes[0]} … {nodes[-1]})"


@login_required
def job_page(request, job_id: int):
    job = _job_or_404(request.user, job_id)
    now = timezone.now()
    attempts = list(
        job.attempts.order_by("number").prefetch_related(
            Prefetch("allocations", queryset=Allocation.objects.select_related("node", "gpu"))
        )
    )
    events = list(job_events(job).reverse()[:500])
    checkpoints = list(
        job.checkpoints.filter(deleted_at__isnull=True)
        .select_related("attempt")
        .annotate(registered=Count("versions"))
        .order_by("-step")
    )
    world = max((len(a.allocations.all()) for a in attempts), default=job.gpus) or job.gpus
    for a in attempts:
        a.placement = placement_text(a.allocations.all())
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
    # The newest attempt whose trainer said how it spread the model.
    layout = next((layout_report(a) for a in reversed(attempts) if a.layout), None)
    return render(
        request,
        "job.html",
        {
            "job": job,
            "attempts": attempts,
            "events": events,
            "checkpoints": checkpoints,
            "goodput": goodput,
            "layout": layout,
            "advice": checkpoint_advice(job),
            "protection": protection(job, now=now),
            "progress": progress(job, now=now),
            # A list to choose from up to LOG_RANK_CHOICES_MAX ranks, a number field beyond:
            # 4,096 options made the page 120 kB heavier and the list unusable.
            "ranks": list(range(world)) if world <= LOG_RANK_CHOICES_MAX else None,
            "world": world,
            "page_data": {
                "job": job.id,
                "name": job.name,
                "state": job.state,
                "ranks": world,
                # Wider jobs push rank 0 live only; the page fetches the rest (job.js).
                "live_all_ranks": world <= lockstep_setting("LIVE_RANKS_MAX"),
                "live_refresh_s": lockstep_setting("LIVE_REFRESH_S"),
                # Rank lines a wider job's per-rank charts draw beside the band of all ranks.
                "rank_lines": RANK_LINES,
                "timeline": timeline,
                "max_points": CHART_POINTS,
                # Charts of their own for what the script logs besides the steps' metrics.
                "scalars": [n for n in metric_names(job.id) if n not in STEP_METRICS],
            },
        },
    )


CHART_POINTS = 2000  # points per rank a chart asks for; the server keeps each bucket's min/max
LOG_RANK_CHOICES_MAX = 64  # the log panel's rank list; wider jobs get a number field
RANK_LINES = 8  # a wide job's per-rank charts: rank 0 and the 7 ranks farthest from the rest


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
