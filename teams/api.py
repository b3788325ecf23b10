"""REST API for teams: quotas and usage for members, quota changes for cluster admins."""

from datetime import timedelta

from django.utils import timezone
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import PermissionDenied
from rest_framework.response import Response

from jobs.queries import teams_with_usage
from jobs.reports import REPORT_DAYS
from jobs.reports.goodput import team_goodput
from jobs.reports.reclaim import reclaim_summary
from jobs.serializers import _django
from jobs.validation import validate_dataset_paths
from teams.access import is_cluster_admin, visible_teams
from teams.actions import (
    do_remove_registry_credential,
    do_set_registry_credential,
    do_set_team_dataset_paths,
    do_set_team_isolated_only,
    do_set_team_quota,
)
from teams.models import RegistryCredential, Team


class TeamSerializer(serializers.ModelSerializer):
    used = serializers.IntegerField(read_only=True)
    goodput = serializers.SerializerMethodField()
    reclaim = serializers.SerializerMethodField(
        help_text="Reclaim times of the team's claims over the last 7 days against their bound, "
        "and its jobs' waits for GPUs its quota owed past that bound, ended (owed_overdue) or "
        "not (owed_overdue_now) (jobs.reports.reclaim.reclaim_summary)"
    )

    class Meta:
        model = Team
        fields = [
            "id",
            "name",
            "quota",
            "borrow_limit",
            "weight",
            "dataset_paths",
            "isolated_only",
            "used",
            "goodput",
            "reclaim",
        ]
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
    dataset_paths = serializers.JSONField(
        required=False,
        validators=[_django(validate_dataset_paths)],
        help_text="Directories on shared storage this team's jobs read, read-only",
    )
    isolated_only = serializers.BooleanField(
        required=False,
        help_text="Run the team's jobs on container-runtime (isolated) nodes only, never on "
        "process-runtime nodes",
    )


class RegistryCredentialSerializer(serializers.ModelSerializer):
    """What anyone who sees the team may know of a credential: never the secret."""

    class Meta:
        model = RegistryCredential
        fields = ["registry", "username", "updated_at"]


class RegistryCredentialInputSerializer(serializers.Serializer):
    registry = serializers.RegexField(
        r"^(localhost|[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)+)(:[0-9]{1,5})?$",
        max_length=255,
        error_messages={"invalid": "A registry host, such as registry.example.org:5000."},
    )
    username = serializers.CharField(max_length=255)
    password = serializers.CharField(max_length=4000, write_only=True, trim_whitespace=False)


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
        if "dataset_paths" in values:
            paths = sorted(set(values["dataset_paths"]))
            do_set_team_dataset_paths(team, paths=paths, actor=request.user)
        if values.get("isolated_only", team.isolated_only) != team.isolated_only:
            do_set_team_isolated_only(
                team, isolated_only=values["isolated_only"], actor=request.user
            )
        if values.keys() - {"dataset_paths", "isolated_only"} or not values:
            do_set_team_quota(
                team,
                quota=values.get("quota", team.quota),
                borrow_limit=values.get("borrow_limit"),
                weight=values.get("weight"),
                actor=request.user,
            )
        return Response(TeamSerializer(self.get_queryset().get(pk=team.pk)).data)

    @extend_schema(methods=["GET"], responses=RegistryCredentialSerializer(many=True))
    @extend_schema(
        methods=["POST"],
        request=RegistryCredentialInputSerializer,
        responses={201: RegistryCredentialSerializer},
    )
    @extend_schema(
        methods=["DELETE"],
        parameters=[OpenApiParameter("registry", str, description="the registry host")],
        responses={204: None},
    )
    @action(
        detail=True,
        methods=["get", "post", "delete"],
        url_path="registry-credentials",
        pagination_class=None,
    )
    def registry_credentials(self, request, pk=None):
        """GET: the team's registry credentials (registry and user, never the secret);
        POST {registry, username, password}: set or replace one; DELETE ?registry=: remove
        one. Setting and removing are for cluster admins."""
        team = self.get_object()
        if request.method != "GET":
            if not is_cluster_admin(request.user):
                raise PermissionDenied("Only cluster admins set registry credentials.")
            if request.method == "DELETE":
                registry = request.query_params.get("registry") or str(
                    request.data.get("registry", "") if isinstance(request.data, dict) else ""
                )
                if not do_remove_registry_credential(team, registry=registry, actor=request.user):
                    return Response(
                        {"detail": f"Team {team.name} has no credential for {registry!r}."},
                        status=status.HTTP_404_NOT_FOUND,
                    )
                return Response(status=status.HTTP_204_NO_CONTENT)
            body = RegistryCredentialInputSerializer(data=request.data)
            body.is_valid(raise_exception=True)
            credential = do_set_registry_credential(
                team,
                registry=body.validated_data["registry"],
                username=body.validated_data["username"],
                secret=body.validated_data["password"],
                actor=request.user,
            )
            return Response(
                RegistryCredentialSerializer(credential).data, status=status.HTTP_201_CREATED
            )
        return Response(
            RegistryCredentialSerializer(team.registry_credentials.all(), many=True).data
        )
