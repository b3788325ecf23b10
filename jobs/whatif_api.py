"""REST API for admins' what-ifs (jobs.whatif): POST a window and changed quotas, get the
side-by-side result (at once for small windows, else poll GET /api/v1/whatif/{id}/)."""

from datetime import timedelta

from django.utils import timezone
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.response import Response

from jobs import whatif
from jobs.models import WhatIfRun
from teams.access import IsClusterAdmin
from teams.api import TeamQuotaSerializer
from teams.models import Team


class WhatIfRequestSerializer(serializers.Serializer):
    since = serializers.DateTimeField(required=False, help_text="Default: 7 days before until")
    until = serializers.DateTimeField(required=False, help_text="Default: now")
    gpus = serializers.IntegerField(
        min_value=1, max_value=whatif.MAX_GPUS, required=False, help_text="Default: today's"
    )
    teams = serializers.DictField(
        child=TeamQuotaSerializer(),
        required=False,
        default=dict,
        help_text='Per team name, what to change: {"vision": {"quota": 64}}',
    )
    # null and absent are today's value: DRF's BooleanField reads an absent field of a form
    # or multipart body as False, which would turn a setting off unasked.
    aged_borrowed_first = serializers.BooleanField(
        required=False,
        allow_null=True,
        default=None,
        help_text="Default: today's AGED_BORROWED_FIRST (rule 1: aged borrowed jobs before "
        "the guaranteed work of their priority)",
    )
    quota_before_drain = serializers.BooleanField(
        required=False,
        allow_null=True,
        default=None,
        help_text="Default: today's QUOTA_BEFORE_DRAIN (a job within its team's quota may start "
        "on the free GPUs of nodes a borrowing head is draining)",
    )

    def validate_teams(self, value):
        known = set(Team.objects.filter(name__in=list(value)).values_list("name", flat=True))
        unknown = sorted(set(value) - known)
        if unknown:
            raise serializers.ValidationError(f"Unknown team {', '.join(map(repr, unknown))}.")
        return value

    def validate(self, data):
        now = self.context["now"]
        _, default_until = whatif.default_window(now)
        data["until"] = data.get("until") or default_until
        if data.get("since") is None:
            try:
                data["since"] = data["until"] - timedelta(days=whatif.DEFAULT_WINDOW_DAYS)
            except OverflowError:  # an `until` in year 1: no default window before it
                raise serializers.ValidationError(
                    {"until": [f"Too early: no {whatif.DEFAULT_WINDOW_DAYS}-day window ends then."]}
                ) from None
        errors = whatif.check_request(since=data["since"], until=data["until"])
        if errors:
            raise serializers.ValidationError(
                {"non_field_errors" if k == "__all__" else k: [v] for k, v in errors.items()}
            )
        return data


class WhatIfRunSerializer(serializers.ModelSerializer):
    # allow_null: the creator's account may be gone (SET_NULL).
    created_by = serializers.SlugRelatedField(
        slug_field="username", read_only=True, allow_null=True
    )

    class Meta:
        model = WhatIfRun
        fields = [
            "id",
            "state",
            "created_by",
            "created_at",
            "since",
            "until",
            "jobs",
            "params",
            "started_at",
            "finished_at",
            "error",
            "result",
        ]
        read_only_fields = fields


class WhatIfRunListSerializer(WhatIfRunSerializer):
    class Meta(WhatIfRunSerializer.Meta):
        fields = [f for f in WhatIfRunSerializer.Meta.fields if f != "result"]
        read_only_fields = fields


class WhatIfViewSet(
    mixins.CreateModelMixin,
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    viewsets.GenericViewSet,
):
    """Cluster admins only. POST runs a what-if; 201 with state `done` and the result when
    it ran at once, 202 with state `queued` when it runs on the worker."""

    permission_classes = [IsClusterAdmin]
    queryset = WhatIfRun.objects.select_related("created_by").order_by("-id")

    def get_serializer_class(self):
        if self.action == "create":
            return WhatIfRequestSerializer
        if self.action == "list":
            return WhatIfRunListSerializer
        return WhatIfRunSerializer

    def get_serializer_context(self):
        return {**super().get_serializer_context(), "now": timezone.now()}

    def create(self, request, *args, **kwargs):
        body = self.get_serializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        run = whatif.do_request_whatif(
            actor=request.user,
            since=data["since"],
            until=data["until"],
            gpus=data.get("gpus"),
            teams={name: dict(values) for name, values in data["teams"].items()},
            now=body.context["now"],
            policy={key: data[key] for key in whatif.POLICY_SETTINGS if data.get(key) is not None},
        )
        done = run.state in (WhatIfRun.State.DONE, WhatIfRun.State.FAILED)
        return Response(
            WhatIfRunSerializer(run).data,
            status=status.HTTP_201_CREATED if done else status.HTTP_202_ACCEPTED,
        )
