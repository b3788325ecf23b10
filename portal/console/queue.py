"""The console's queue: every live job in start order, with what it waits for and holds, and
priority changes for leads and admins."""

from __future__ import annotations

from django import forms
from django.contrib import messages
from django.shortcuts import redirect, render
from django.utils import timezone

from jobs import actions, queries
from jobs.event_kinds import EventKind
from jobs.models import (
    PRIORITY_RANK,
    Job,
    Priority,
)
from jobs.queries import SAFETY_WINDOW
from jobs.reports.estimates import band_text, recent_estimate_bands
from jobs.scheduling.vocab import WaitReason
from portal.console.access import console_view
from portal.formatting import duration

QUEUE_STATES = (
    Job.State.QUEUED,
    Job.State.RESTARTING,
    Job.State.STARTING,
    Job.State.RUNNING,
    Job.State.PREEMPTING,
)


def reservation_of(wait: dict) -> str | None:
    """What a queued job holds, from the scheduler's wait reason as data (Job.wait): the nodes
    of its reservation, or the GPUs of the jobs stopping for it."""
    if not wait:
        return None
    reason = WaitReason.from_json(wait)
    if reason.code in ("reserved", "reserved_starving"):
        return "nodes " + ", ".join(reason.reserved_nodes)
    if reason.code == "ending":
        ending = ", ".join(f"job {j}" for j in reason.data["ending"])
        return f"the GPUs of {ending}, once ended (nothing stopped)"
    if reason.victims:
        victims = ", ".join(f"job {victim}" for victim in reason.victims)
        return f"the GPUs of {victims}, once preempted (checkpoint, then stop)"
    return None


class PriorityForm(forms.Form):
    job = forms.IntegerField(widget=forms.HiddenInput)
    priority = forms.ChoiceField(choices=Priority.choices)

    def __init__(self, *args, jobs, **kwargs):
        super().__init__(*args, **kwargs)
        self.jobs = jobs

    def clean_job(self):
        job = self.jobs.filter(pk=self.cleaned_data["job"]).first()
        if job is None:  # not there, or not a team this user leads: the same answer
            raise forms.ValidationError("No such job in your teams.")
        if job.state not in QUEUE_STATES:
            raise forms.ValidationError(f"Job {job.id} has ended ({job.state}).")
        return job

    def clean(self):
        data = super().clean()
        job, priority = data.get("job"), data.get("priority")
        if job and priority and job.priority == priority:
            self.add_error("priority", f"Job {job.id} already has priority {priority}.")
        return data


@console_view()
def queue(request, scope):
    jobs = scope.jobs().filter(state__in=QUEUE_STATES)
    failed = None
    status = 200
    if request.method == "POST":
        form = PriorityForm(request.POST, jobs=scope.jobs())
        if form.is_valid():
            job = form.cleaned_data["job"]
            before = job.priority
            actions.do_set_job_priority(
                job, priority=form.cleaned_data["priority"], actor=request.user
            )
            messages.success(request, f"Job {job.id}: priority {before} -> {job.priority}.")
            return redirect("console_queue")
        failed, status = form, 400
    now = timezone.now()
    # The scheduler's alerts of the last day: preemptions its safety stop refused (a policy
    # that would have looped), and jobs their team's quota owed GPUs past the reclaim bound.
    # An admin should look at who claims the job, at quotas and at what holds the lent GPUs.
    alerts = list(
        scope.events()
        .filter(
            kind__in=[EventKind.PREEMPTION_SAFETY_STOP, EventKind.TEAM_QUOTA_OVERDUE],
            created_at__gte=now - SAFETY_WINDOW,
        )
        .order_by("-created_at")[:20]
    )
    rows = list(jobs.select_related("team", "owner"))
    rows.sort(
        key=lambda j: (
            j.state == Job.State.QUEUED or j.state == Job.State.RESTARTING,
            -PRIORITY_RANK[j.priority],
            j.submitted_at,
            j.id,
        )
    )
    held = queries.run_seconds([j.id for j in rows], now=now)
    posted = failed.data.get("job") if failed is not None else None
    table, reservations = [], []
    bands = recent_estimate_bands(now)
    for job in rows:
        is_failed = posted is not None and str(job.id) == str(posted)
        form = (
            failed
            if is_failed
            else PriorityForm(initial={"job": job.id, "priority": job.priority}, jobs=jobs)
        )
        waiting = job.state in (Job.State.QUEUED, Job.State.RESTARTING)
        reserved = reservation_of(job.wait) if waiting else None
        if reserved:
            reservations.append({"job": job, "holds": reserved})
        table.append(
            {
                "job": job,
                "form": form,
                "waiting": waiting,
                "wait": duration((now - job.submitted_at).total_seconds()) if waiting else "",
                "runtime": duration(held.get(job.id)) if job.id in held else "—",
                "band": band_text(job.gpus, bands) if waiting else "",
            }
        )
    # A refused row that is no longer listed (unknown job) still shows its error.
    orphan = failed if failed is not None and not any(r["form"] is failed for r in table) else None
    return render(
        request,
        "console_queue.html",
        {
            "rows": table,
            "alerts": alerts,
            "reservations": reservations,
            "orphan": orphan,
            "scope": scope,
            "running": sum(1 for r in table if not r["waiting"]),
            "queued": sum(1 for r in table if r["waiting"]),
        },
        status=status,
    )
