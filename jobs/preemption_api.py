"""REST API for preemption requests: everyone sees those touching their teams' jobs; cluster
admins approve or reject priority preemptions."""

from django.db.models import Q
from django.utils import timezone
from rest_framework import mixins, serializers, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from jobs import actions
from jobs.models import PreemptionRequest
from teams.access import IsClusterAdmin, visible_jobs


class PreemptionSerializer(serializers.ModelSerializer):
    # allow_null: undecided (or auto-approved) requests have no decider, and reclaim_s is null
    # until the claimant starts; the OpenAPI schema must say both.
    decided_by = serializers.SlugRelatedField(
        slug_field="username", read_only=True, allow_null=True
    )
    reclaim_s = serializers.FloatField(read_only=True, allow_null=True)

    class Meta:
        model = PreemptionRequest
        fields = [
            "id",
            "kind",
            "state",
            "victim",
            "claimant",
            "reason",
            "work_at_risk_s",
            "created_at",
            "auto_approve_at",
            "decided_by",
            "decided_at",
            "executed_at",
            "claimant_started_at",
            "reclaim_s",
        ]
        read_only_fields = fields


class PreemptionViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    serializer_class = PreemptionSerializer

    def get_queryset(self):
        jobs = visible_jobs(self.request.user)
        requests = PreemptionRequest.objects.filter(Q(victim__in=jobs) | Q(claimant__in=jobs))
        state = self.request.query_params.get("state")
        if state:
            requests = requests.filter(state__in=state.lower().split(","))
        return requests.select_related("decided_by").order_by("-id")

    def _decide(self, request, approve: bool):
        preemption = self.get_object()
        if preemption.state != PreemptionRequest.State.PROPOSED:
            return Response(
                {"detail": f"This preemption is {preemption.state}, not proposed."}, status=409
            )
        preemption = actions.do_decide_preemption(
            preemption, approve=approve, actor=request.user, now=timezone.now()
        )
        return Response(PreemptionSerializer(preemption).data)

    @action(detail=True, methods=["post"], permission_classes=[IsClusterAdmin])
    def approve(self, request, pk=None):
        return self._decide(request, True)

    @action(detail=True, methods=["post"], permission_classes=[IsClusterAdmin])
    def reject(self, request, pk=None):
        return self._decide(request, False)
