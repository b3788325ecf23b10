"""REST API v1 for jobs, checkpoints, metrics, logs, events, model versions and nodes.

Thin views: they check who may see what (teams.access), validate with serializers and call
jobs.actions. A job the caller may not see is a 404, exactly like one that does not exist.
"""

from django.db.models import Prefetch
from django.utils import timezone
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import PermissionDenied, ValidationError
from rest_framework.response import Response
from rest_framework.throttling import ScopedRateThrottle

from jobs import actions
from jobs.metrics_query import gpu_history, metric_names, metric_series
from jobs.metrics_spread import gpu_spread, metric_spread
from jobs.models import Allocation, Attempt, LogChunk, ModelVersion, Node
from jobs.queries import job_events
from jobs.serializers import (
    CheckpointSerializer,
    EventSerializer,
    JobCreateSerializer,
    JobDetailSerializer,
    JobPatchSerializer,
    JobSerializer,
    ModelVersionCreateSerializer,
    ModelVersionSerializer,
    NodeSerializer,
)
from teams.access import IsClusterAdmin, can_set_priority, visible_jobs


def _int_param(request, name: str, default: int | None, *, lo: int = 0, hi: int = 10**9):
    raw = request.query_params.get(name)
    if raw in (None, ""):
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValidationError({name: [f"{name} must be an integer."]}) from None
    if not lo <= value <= hi:
        raise ValidationError({name: [f"{name} must be between {lo} and {hi}."]})
    return value


# A job's events per answer, oldest first; `since_id` asks for the next page.
EVENTS_PAGE = 1000


class JobViewSet(
    mixins.CreateModelMixin,
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    viewsets.GenericViewSet,
):
    serializer_class = JobSerializer
    throttle_scope = "submit"  # per user, LOCKSTEP_THROTTLE_SUBMIT; a 429 beyond it

    def get_throttles(self):
        return [ScopedRateThrottle()] if self.action == "create" else []

    def get_queryset(self):
        jobs = visible_jobs(self.request.user).select_related("team", "owner")
        if self.action == "list":
            state = self.request.query_params.get("state")
            team = self.request.query_params.get("team")
            owner = self.request.query_params.get("owner")
            if state:
                jobs = jobs.filter(state__in=state.upper().split(","))
            if team:
                jobs = jobs.filter(team__name=team)
            if owner == "@me":  # as GitHub's CLI says it: no need to know one's username
                jobs = jobs.filter(owner=self.request.user)
            elif owner:
                jobs = jobs.filter(owner__username=owner)
        if self.action == "retrieve":
            jobs = jobs.prefetch_related(
                Prefetch(
                    "attempts",
                    queryset=Attempt.objects.order_by("number").prefetch_related(
                        Prefetch(
                            "allocations", queryset=Allocation.objects.select_related("node", "gpu")
                        )
                    ),
                ),
            )
        return jobs.order_by("-id")

    def get_serializer_class(self):
        return {
            "create": JobCreateSerializer,
            "retrieve": JobDetailSerializer,
            "partial_update": JobPatchSerializer,
        }.get(self.action, JobSerializer)

    def create(self, request, *args, **kwargs):
        serializer = JobCreateSerializer(data=request.data, context={"request": request})
        serializer.is_valid(raise_exception=True)
        data = dict(serializer.validated_data)
        team = data.pop("team")
        job = actions.do_submit_job(owner=request.user, team=team, now=timezone.now(), **data)
        return Response(JobSerializer(job).data, status=status.HTTP_201_CREATED)

    def partial_update(self, request, *args, **kwargs):
        job = self.get_object()
        if not can_set_priority(request.user, job.team):
            raise PermissionDenied("Only the team's leads and cluster admins set priorities.")
        serializer = JobPatchSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        actions.do_set_job_priority(
            job, priority=serializer.validated_data["priority"], actor=request.user
        )
        job.refresh_from_db()
        return Response(JobSerializer(job).data)

    @action(detail=True, methods=["post"])
    def cancel(self, request, pk=None):
        job = self.get_object()
        job = actions.do_cancel_job(job, actor=request.user, now=timezone.now())
        return Response(JobSerializer(job).data)

    # Plain lists, not pages: a job keeps a handful of checkpoints (KEEP_CHECKPOINTS plus the
    # registered ones), and events page with since_id; pagination_class=None says so to the
    # OpenAPI schema too.
    @action(detail=True, methods=["get"], pagination_class=None)
    def checkpoints(self, request, pk=None):
        job = self.get_object()
        return Response(
            CheckpointSerializer(
                job.checkpoints.filter(deleted_at__isnull=True)
                .select_related("attempt")
                .order_by("-step"),
                many=True,
            ).data
        )

    @action(detail=True, methods=["get"], pagination_class=None)
    def events(self, request, pk=None):
        job = self.get_object()
        events = job_events(job)
        since = _int_param(request, "since_id", None)
        if since is not None:
            events = events.filter(id__gt=since)
        return Response(EventSerializer(events[:EVENTS_PAGE], many=True).data)

    @action(detail=True, methods=["get"])
    def metrics(self, request, pk=None):
        job = self.get_object()
        name = request.query_params.get("name") or "loss"
        since = _int_param(request, "since_step", None)
        until = _int_param(request, "until_step", None)
        max_points = _int_param(request, "max_points", 2000, lo=2, hi=100_000)
        rank = _int_param(request, "rank", None, hi=100_000)
        attempt = _int_param(request, "attempt", None, lo=1)
        lines = _int_param(request, "lines", None, lo=1, hi=64)
        if lines is not None and rank is not None:
            raise ValidationError({"lines": ["Give either lines or rank, not both."]})
        if lines is not None:
            # A wide job's chart: the band across ranks and a few ranks' lines.
            return Response(
                metric_spread(
                    job.id,
                    name,
                    lines=lines,
                    since_step=since,
                    until_step=until,
                    max_points=max_points,
                    attempt=attempt,
                )
            )
        return Response(
            metric_series(
                job.id,
                name,
                since_step=since,
                until_step=until,
                max_points=max_points,
                rank=rank,
                attempt=attempt,
            )
        )

    @action(detail=True, methods=["get"], url_path="metrics/names")
    def metric_names(self, request, pk=None):
        """Every series name the job has: the steps' metrics and every scalar its script
        logged (each one readable with metrics/?name=...)."""
        job = self.get_object()
        return Response({"names": metric_names(job.id)})

    @action(detail=True, methods=["get"])
    def gpus(self, request, pk=None):
        """The live attempt's GPUs, per rank, with their node's latest telemetry reading."""
        job = self.get_object()
        attempt = job.attempts.filter(ended_at__isnull=True).first()
        if attempt is None:
            return Response({"attempt": None, "gpus": []})
        rows = []
        for a in attempt.allocations.select_related("node", "gpu").order_by("rank"):
            reading = next((t for t in a.node.telemetry or [] if t.get("index") == a.gpu.index), {})
            rows.append(
                {
                    "rank": a.rank,
                    "node": a.node.name,
                    "gpu": a.gpu.index,
                    "kind": reading.get("kind", a.node.gpu_kind),
                    "util": reading.get("util"),
                    "mem_used": reading.get("mem_used"),
                    "mem_total": reading.get("mem_total"),
                    "at": a.node.last_heartbeat_at,
                }
            )
        return Response({"attempt": attempt.number, "gpus": rows})

    @action(detail=True, methods=["get"], url_path="gpus/history")
    def gpu_history(self, request, pk=None):
        """The job's GPU readings over its whole run (every attempt), per rank, averaged into
        at most `points` time buckets; `since` (epoch seconds) narrows it. `lines`: the
        latest attempt's band across ranks and at most that many ranks' lines (a wide job)."""
        job = self.get_object()
        points = _int_param(request, "points", 300, lo=1, hi=5000)
        since = _int_param(request, "since", None, lo=0, hi=2**62)
        lines = _int_param(request, "lines", None, lo=1, hi=64)
        if lines is not None and since is not None:
            raise ValidationError({"lines": ["Give either lines or since, not both."]})
        if lines is not None:
            return Response(gpu_spread(job.id, lines=lines, max_points=points))
        return Response(gpu_history(job.id, max_points=points, since=since))

    @action(detail=True, methods=["get"])
    def logs(self, request, pk=None):
        job = self.get_object()
        rank = _int_param(request, "rank", 0, hi=100_000)
        tail = _int_param(request, "tail", 200, lo=1, hi=10_000)
        number = _int_param(request, "attempt", None, lo=1)
        after = _int_param(request, "after", None, lo=0, hi=2**63 - 1)
        attempts = job.attempts.order_by("-number")
        attempt = (attempts.filter(number=number) if number else attempts).first()
        answer = {"attempt": None, "rank": rank, "lines": [], "partial": "", "text": ""}
        if attempt is None:
            return Response({**answer, "cursor": after})
        chunks = LogChunk.objects.filter(attempt=attempt, rank=rank).order_by("id")
        answer["attempt"] = attempt.number
        if after is not None:
            # Following: the raw text after the cursor, a page at a time, lines unsplit
            # (a chunk may end mid-line); the caller passes the new cursor back.
            rows = list(chunks.filter(id__gt=after).values_list("id", "text")[:LOG_PAGE_CHUNKS])
            answer["text"] = "".join(text for _, text in rows)
            return Response({**answer, "cursor": rows[-1][0] if rows else after})
        rows = list(chunks.values_list("id", "text"))
        text = "".join(text for _, text in rows)
        answer["lines"] = text.splitlines()[-tail:]
        answer["partial"] = "" if text.endswith("\n") else text.rpartition("\n")[2]
        return Response({**answer, "cursor": rows[-1][0] if rows else 0})


# Chunks per page when following a log (each at most 64 KiB).
LOG_PAGE_CHUNKS = 256


class ModelVersionViewSet(
    mixins.CreateModelMixin,
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    viewsets.GenericViewSet,
):
    serializer_class = ModelVersionSerializer

    def get_queryset(self):
        return (
            ModelVersion.objects.filter(job__in=visible_jobs(self.request.user))
            .select_related("job__team", "checkpoint__attempt", "created_by")
            .order_by("name", "-version")
        )

    def create(self, request, *args, **kwargs):
        serializer = ModelVersionCreateSerializer(data=request.data, context={"request": request})
        serializer.is_valid(raise_exception=True)
        version = actions.do_register_model_version(
            name=serializer.validated_data["name"],
            checkpoint=serializer.validated_data["checkpoint"],
            notes=serializer.validated_data["notes"],
            actor=request.user,
            now=timezone.now(),
        )
        return Response(ModelVersionSerializer(version).data, status=status.HTTP_201_CREATED)


class NodeReasonSerializer(serializers.Serializer):
    reason = serializers.CharField(max_length=500, required=False, allow_blank=True, default="")


class NodeViewSet(viewsets.ReadOnlyModelViewSet):
    serializer_class = NodeSerializer
    queryset = Node.objects.prefetch_related("gpus").order_by("name")

    def get_queryset(self):
        # Everyone signed in sees the cluster's shape; only admins see node details change.
        if not self.request.user.is_authenticated:
            return Node.objects.none()
        return super().get_queryset()

    def _node_action(self, request, apply):
        node = self.get_object()
        body = NodeReasonSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        node = apply(node, body.validated_data["reason"] or f"by {request.user.username}")
        return Response(NodeSerializer(node).data)

    @action(detail=True, methods=["post"], permission_classes=[IsClusterAdmin])
    def cordon(self, request, pk=None):
        return self._node_action(
            request,
            lambda node, why: actions.do_cordon_node(
                node, actor=request.user, reason=why, now=timezone.now()
            ),
        )

    @action(detail=True, methods=["post"], permission_classes=[IsClusterAdmin])
    def drain(self, request, pk=None):
        return self._node_action(
            request,
            lambda node, why: actions.do_cordon_node(
                node, actor=request.user, reason=why, drain=True, now=timezone.now()
            ),
        )

    @action(detail=True, methods=["post"], permission_classes=[IsClusterAdmin])
    def uncordon(self, request, pk=None):
        return self._node_action(
            request,
            lambda node, why: actions.do_uncordon_node(node, actor=request.user, reason=why),
        )
