"""The console's preemptions page (admins): open proposals to approve or reject, and each
team's reclaim times against their bound."""

from __future__ import annotations

from datetime import timedelta

from django.contrib import messages
from django.http import Http404, HttpResponseBadRequest
from django.shortcuts import redirect, render
from django.utils import timezone

from jobs import actions
from jobs.models import (
    PreemptionRequest,
)
from jobs.reports import REPORT_DAYS
from jobs.reports.reclaim import KINDS, reclaim_bound_s, reclaim_summary
from portal.console.access import console_view
from portal.formatting import duration


@console_view(admin_only=True)
def preemptions(request, scope):
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
                    "median": duration(row["median_s"]),
                    "max": duration(row["max_s"]),
                    "oldest": duration(row["oldest_waiting_s"]),
                    "owed_max": duration(row["owed_overdue_max_s"]),
                    "owed_oldest": duration(row["owed_oldest_s"]),
                }
                for row in sorted(reclaim.values(), key=lambda r: r["team"])
            ],
            "reclaim_days": days,
            "bounds": [(kind, duration(reclaim_bound_s(kind))) for kind in KINDS],
        },
    )
