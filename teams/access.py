"""Who may see and do what: members act on their teams' jobs, leads also set priorities inside
their team, cluster admins (staff) do everything. Lookups outside what a user may see behave
exactly like lookups of things that do not exist."""

from django.db.models import QuerySet
from rest_framework.permissions import BasePermission

from jobs.models import Job
from teams.models import Membership, Team


def is_cluster_admin(user) -> bool:
    return bool(user and user.is_authenticated and (user.is_staff or user.is_superuser))


def visible_teams(user) -> QuerySet[Team]:
    if is_cluster_admin(user):
        return Team.objects.all()
    if not user or not user.is_authenticated:
        return Team.objects.none()
    return Team.objects.filter(memberships__user=user).distinct()


def visible_jobs(user):
    if is_cluster_admin(user):
        return Job.objects.all()
    if not user or not user.is_authenticated:
        return Job.objects.none()
    return Job.objects.filter(team__memberships__user=user).distinct()


def can_set_priority(user, team: Team) -> bool:
    if is_cluster_admin(user):
        return True
    return Membership.objects.filter(user=user, team=team, role=Membership.Role.LEAD).exists()


class IsClusterAdmin(BasePermission):
    """Cluster admins (staff or superusers), the same test as `is_cluster_admin` everywhere
    else: DRF's IsAdminUser looks at is_staff only, and a superuser who is not staff would be
    an admin on some pages and refused on others."""

    def has_permission(self, request, view) -> bool:
        return is_cluster_admin(request.user)
