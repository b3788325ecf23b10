"""REST API for teams: quotas and usage for members, quota changes for cluster admins."""

from datetime import timedelta

from django.db.models import Count, Q
from django.utils import timezone
from rest_framework import mixins, serializers, viewsets
from rest_framework.exceptions import PermissionDenied
from rest_framework.response import Response

from jobs.goodput import team_goodput
from teams.access import is_cluster_admin, visible_teams
from teams.actions import do_set_team_quota
from teams.models import Team


class TeamSerializer(serializers.ModelSerializer):
    used = serializers.IntegerField(read_only=True)
    goodput = serializers.SerializerMethodField()

    class Meta:
        model = Team
        fields = ["id", "name", "quota", "borrow_limit", "weight", "used", "goodput"]
        read_only_fields = ["id", "name", "used", "goodput"]

    def get_goodput(self, team) -> dict:
        return team_goodput(team, since=timezone.now() - timedelta(days=7))


class TeamQuotaSerializer(serializers.Serializer):
    quota = serializers.IntegerField(min_value=0, max_value=1_000_000, required=False)
    borrow_limit = serializers.IntegerField(min_value=0, max_value=1_000_000, required=False)
    weight = serializers.FloatField(min_value=0.0, max_value=1_000.0, required=False)


class TeamViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    serializer_class = TeamSerializer

    def get_queryset(self):
        return (
            visible_teams(self.request.user)
            .annotate(
                used=Count(
                    "jobs__attempts__allocations",
                    filter=Q(jobs__attempts__allocations__released_at__isnull=True),
                )
            )
            .order_by("name")
        )

    def partial_update(self, request, *args, **kwargs):
        team = self.get_object()
        if not is_cluster_admin(request.user):
            raise PermissionDenied("Only cluster admins change quotas.")
        body = TeamQuotaSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        values = body.validated_data
        do_set_team_quota(
            team,
            quota=values.get("quota", team.quota),
            borrow_limit=values.get("borrow_limit"),
            weight=values.get("weight"),
            actor=request.user,
        )
        return Response(TeamSerializer(self.get_queryset().get(pk=team.pk)).data)
