"""Server-rendered portal pages. State changes go through jobs.actions / teams.actions."""

import json

from django.contrib import messages
from django.contrib.admin.views.decorators import staff_member_required
from django.contrib.auth.decorators import login_required
from django.db.models import Count, Prefetch, Q
from django.http import Http404
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from jobs import actions
from jobs.checkpoint_policy import checkpoint_advice
from jobs.goodput import job_goodput
from jobs.models import Allocation, Checkpoint, Job, ModelVersion, Node, PreemptionRequest
from portal.forms import JobForm, RegisterModelForm, TeamQuotaForm
from teams import actions as team_actions
from teams.access import visible_jobs, visible_teams
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
    return render(request, "preemptions.html", {"requests": requests})
