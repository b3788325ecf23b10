"""Who may see the console, and what: one rule for every console page. Cluster admins see
and act on everything; team leads on the teams they lead; anyone else gets the 404 a missing
page gets (a denial that leaks nothing, DESIGN.md section 10)."""

from __future__ import annotations

from functools import wraps

from django.contrib.auth.views import redirect_to_login
from django.db.models import Q
from django.http import Http404

from jobs.models import (
    Event,
    Job,
)
from teams.access import is_cluster_admin
from teams.models import Membership, Team


class Scope:
    """What one console user may see: everything (a cluster admin) or the teams they lead."""

    def __init__(self, user):
        self.admin = is_cluster_admin(user)
        self.team_ids = (
            None
            if self.admin
            else set(
                Membership.objects.filter(user=user, role=Membership.Role.LEAD).values_list(
                    "team_id", flat=True
                )
            )
        )

    def teams(self):
        teams = Team.objects.order_by("name")
        return teams if self.admin else teams.filter(id__in=self.team_ids)

    def jobs(self):
        return Job.objects.all() if self.admin else Job.objects.filter(team_id__in=self.team_ids)

    def events(self):
        if self.admin:
            return Event.objects.all()
        mine = self.team_ids
        return Event.objects.filter(Q(team_id__in=mine) | Q(job__team_id__in=mine))


def is_console_user(user) -> bool:
    """Admins, and leads of at least one team (the nav shows them the console)."""
    if not user.is_authenticated:
        return False
    return (
        is_cluster_admin(user)
        or Membership.objects.filter(user=user, role=Membership.Role.LEAD).exists()
    )


def console_view(*, admin_only: bool = False):
    """Anonymous users are sent to log in; anyone outside the page's audience gets the 404 a
    missing page gets (a denial that leaks nothing, DESIGN.md section 10)."""

    def decorate(view):
        @wraps(view)
        def wrapped(request, *args, **kwargs):
            if not request.user.is_authenticated:
                return redirect_to_login(request.get_full_path())
            scope = Scope(request.user)
            if not scope.admin and (admin_only or not scope.team_ids):
                raise Http404("No such page.")
            return view(request, scope, *args, **kwargs)

        return wrapped

    return decorate
