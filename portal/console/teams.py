"""The console's team quotas page (admins): quota, borrow limit and weight per team, with the
GPUs each uses split into guaranteed and borrowed."""

from __future__ import annotations

from django.contrib import messages
from django.http import Http404
from django.shortcuts import redirect, render

from jobs.queries import teams_with_usage
from portal.console.access import console_view
from portal.forms import TeamQuotaForm
from teams import actions as team_actions
from teams.models import Team


def quota_split(used: int, quota: int) -> dict:
    """A team's GPUs in use split as the scheduler sees them: up to its quota guaranteed, the
    rest borrowed (reclaimable by teams under their quota)."""
    guaranteed = min(used, quota)
    return {"guaranteed": guaranteed, "borrowed": used - guaranteed}


@console_view(admin_only=True)
def team_quotas(request, scope):
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
            if form.cleaned_data["isolated_only"] != team.isolated_only:
                team_actions.do_set_team_isolated_only(
                    team, isolated_only=form.cleaned_data["isolated_only"], actor=request.user
                )
            where = "; isolated nodes only" if form.cleaned_data["isolated_only"] else ""
            quota = form.cleaned_data["quota"]
            messages.success(request, f"Team {team.name}: quota {quota}{where}.")
            return redirect("team_quotas")
        errors = {team.pk: form}
    else:
        errors = {}
    teams = teams_with_usage(Team.objects.all())
    rows = [{"team": t, "form": errors.get(t.pk) or TeamQuotaForm(instance=t)} for t in teams]
    return render(request, "team_quotas.html", {"rows": rows})
