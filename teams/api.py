"""REST API for teams: quotas and usage for members, quota changes for cluster admins."""

from datetime import timedelta

from django.utils import timezone
from rest_framework import mixins, serializers, viewsets
from rest_framework.exceptions import PermissionDenied
from rest_framework.response import Response

from jobs.queries import teams_with_usage
from jobs.reports import REPORT_DAYS
from jobs.reports.goodput import team_goodput
from jobs.reports.reclaim import reclaim_summary
from teams.access import is_cluster_admin, visible_teams
from teams.actions import do_set_team_quota
from teams.models import Team


class TeamSerializer(serializers.ModelSerializer):
    used = serializers.IntegerField(read_only=True)
    goodput = serializers.SerializerMethodField()
    reclaim = serializers.SerializerMethodField(
        help_text="Reclaim times of the team's claims over the last 7 days against their bound "
        "(jobs.reports.reclaim.reclaim_summary)"
    )

    class Meta:
        model = Team
        fields = ["id", "name", "quota", "borrow_limit", "weight", "used", "goodput", "reclaim"]
        read_only_fields = ["id", "name", "used", "goodput", "reclaim"]

    def get_goodput(self, team) -> dict:
        return team_goodput(team, since=timezone.now() - timedelta(days=REPORT_DAYS))

    def get_reclaim(self, team) -> dict:
        summaries = self.context.get("reclaim")
        if summaries is None:  # a lone serializer (after a quota change): this team only
            summaries = team_reclaim({team.id: team.name})
        row = dict(summaries[team.id])
        del row["team_id"], row["team"]
        return row


def team_reclaim(teams: dict[int, str]) -> dict[int, dict]:
    now = timezone.now()
    return reclaim_summary(
        since=now - timedelta(days=REPORT_DAYS), now=now, team_ids=list(teams), teams=teams
    )


class TeamQuotaSerializer(serializers.Serializer):
    quota = serializers.IntegerField(min_value=0, max_value=1_000_000, required=False)
    borrow_limit = serializers.IntegerField(min_value=0, max_value=1_000_000, required=False)
    weight = serializers.FloatField(min_value=0.0, max_value=1_000.0, required=False)


class TeamViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    serializer_class = TeamSerializer

    def get_queryset(self):
        return teams_with_usage(visible_teams(self.request.user)).order_by("name")

    def get_serializer_context(self):
        # One query for every team on the page rather than one per team.
        context = super().get_serializer_context()
        if self.action in ("list", "retrieve"):
            context["reclaim"] = team_reclaim(
                dict(visible_teams(self.request.user).values_list("id", "name"))
            )
        return context

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
