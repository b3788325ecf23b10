"""Corrections to the OpenAPI schema that drf-spectacular cannot infer from the views: the
bearer-token scheme, request and response bodies of custom actions, query parameters.

Kept in one module (imported by portal.urls before the router is built) rather than as
decorators spread over the view modules, so the API code stays thin; tests/test_schema_fuzz.py
calls every operation and checks each response against what is said here.
"""

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import (
    OpenApiExample,
    OpenApiParameter,
    OpenApiResponse,
    extend_schema,
    extend_schema_view,
    inline_serializer,
)
from rest_framework import serializers

from jobs.agent_api import (
    AgentHeartbeatView,
    AgentRegisterView,
    HeartbeatSerializer,
    RegisterSerializer,
)
from jobs.api import JobViewSet, ModelVersionViewSet, NodeReasonSerializer, NodeViewSet
from jobs.plan_api import PlanRequestSerializer, PlanView
from jobs.preemption_api import PreemptionSerializer, PreemptionViewSet
from jobs.serializers import (
    CheckpointSerializer,
    EventSerializer,
    JobCreateSerializer,
    JobPatchSerializer,
    JobSerializer,
    ModelVersionCreateSerializer,
    ModelVersionSerializer,
    NodeSerializer,
)
from jobs.whatif_api import WhatIfRequestSerializer, WhatIfRunSerializer, WhatIfViewSet
from teams.api import TeamQuotaSerializer, TeamSerializer, TeamViewSet


class BearerTokenScheme(OpenApiAuthenticationExtension):
    target_class = "teams.auth.BearerTokenAuthentication"
    name = "bearerToken"

    def get_security_definition(self, auto_schema):
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "A user's API token (`lst_...`), from the portal or "
            "`manage.py issue_token`. Agent and node tokens are refused.",
        }


class DetailSerializer(serializers.Serializer):
    detail = serializers.CharField()


def _int(name: str, description: str) -> OpenApiParameter:
    return OpenApiParameter(name, OpenApiTypes.INT, OpenApiParameter.QUERY, description=description)


CONFLICT = OpenApiResponse(DetailSerializer, description="The resource is not in a state for it")


class SeriesSerializer(serializers.Serializer):
    step = serializers.ListField(child=serializers.IntegerField())
    value = serializers.ListField(child=serializers.FloatField())


class MetricSeriesSerializer(serializers.Serializer):
    name = serializers.CharField()
    ranks = serializers.DictField(child=SeriesSerializer(), help_text="Per rank (a string key)")
    downsampled = serializers.DictField(
        child=serializers.BooleanField(), help_text="Per rank: min/max downsampled or raw"
    )
    spread = serializers.DictField(
        required=False,
        allow_null=True,
        help_text="With lines: {step, low, high, ranks, bucket_steps}, the lowest and highest "
        "value of any rank per bucket of steps",
    )
    lines = serializers.DictField(
        child=serializers.CharField(),
        required=False,
        help_text='With lines: per drawn rank, why: "rank 0", "above" or "below" the median',
    )


class LogTailSerializer(serializers.Serializer):
    attempt = serializers.IntegerField(allow_null=True, help_text="null: the job never started")
    rank = serializers.IntegerField()
    lines = serializers.ListField(
        child=serializers.CharField(allow_blank=True), help_text="The last lines (without after)"
    )
    partial = serializers.CharField(
        allow_blank=True, help_text="An unfinished last line (also the last of lines)"
    )
    text = serializers.CharField(allow_blank=True, help_text="With after: the raw text after it")
    cursor = serializers.IntegerField(
        allow_null=True, help_text="Pass as after to read what comes next"
    )


class JobGpuSerializer(serializers.Serializer):
    rank = serializers.IntegerField()
    node = serializers.CharField()
    gpu = serializers.IntegerField()
    kind = serializers.CharField()
    util = serializers.FloatField(allow_null=True)
    mem_used = serializers.FloatField(allow_null=True)
    mem_total = serializers.FloatField(allow_null=True)
    at = serializers.DateTimeField(help_text="The node's latest heartbeat")


class GpuSeriesSerializer(serializers.Serializer):
    attempt = serializers.IntegerField()
    rank = serializers.IntegerField()
    node = serializers.CharField(allow_null=True)
    gpu = serializers.IntegerField(allow_null=True)
    t = serializers.ListField(child=serializers.IntegerField(), help_text="Epoch seconds")
    util = serializers.ListField(child=serializers.FloatField(allow_null=True), help_text="%")
    mem_used = serializers.ListField(
        child=serializers.FloatField(allow_null=True), help_text="Bytes"
    )
    mem_total = serializers.FloatField(allow_null=True, help_text="Bytes; null: no memory reading")


class GpuHistorySerializer(serializers.Serializer):
    bucket_s = serializers.IntegerField(
        allow_null=True, help_text="Seconds per point (each the mean of its readings)"
    )
    series = GpuSeriesSerializer(many=True)


class MetricNamesSerializer(serializers.Serializer):
    names = serializers.ListField(
        child=serializers.CharField(),
        help_text="Every series of the job: the steps' metrics and each scalar its script logged",
    )


class JobGpusSerializer(serializers.Serializer):
    attempt = serializers.IntegerField(allow_null=True, help_text="null: no live attempt")
    gpus = JobGpuSerializer(many=True)


extend_schema_view(
    list=extend_schema(
        parameters=[
            OpenApiParameter(
                "state",
                OpenApiTypes.STR,
                description="Only jobs in these states, comma-separated (QUEUED,RUNNING)",
            ),
            OpenApiParameter("team", OpenApiTypes.STR, description="Only this team's jobs"),
            OpenApiParameter(
                "owner",
                OpenApiTypes.STR,
                description="Only the jobs this user submitted (a username; @me: yours)",
            ),
        ]
    ),
    create=extend_schema(
        request=JobCreateSerializer,
        responses={201: JobSerializer},
        examples=[
            OpenApiExample(
                "A 2-GPU run of the reference trainer",
                request_only=True,
                value={
                    "name": "run2",
                    "team": "demo",
                    "image": "lockstep/trainer:latest",
                    "command": ["python", "-m", "trainer", "--steps", "600"],
                    "dataset": "synthetic://addition",
                    "gpus": 2,
                },
            )
        ],
        description="Submit a job; 400 with a message per field (nothing created).",
    ),
    partial_update=extend_schema(
        request=JobPatchSerializer,
        responses={200: JobSerializer},
        description="Change the priority (the team's leads and cluster admins).",
    ),
    cancel=extend_schema(request=None, responses={200: JobSerializer}),
    checkpoints=extend_schema(
        responses={200: CheckpointSerializer(many=True)},
        description="Committed checkpoints still on disk, newest step first.",
    ),
    events=extend_schema(
        parameters=[_int("since_id", "Only events after this id (poll with the last id seen)")],
        responses={200: EventSerializer(many=True)},
        description="The job's events in order, at most 1,000 per call: page with since_id.",
    ),
    metrics=extend_schema(
        parameters=[
            OpenApiParameter("name", OpenApiTypes.STR, description="Metric name (default loss)"),
            _int("since_step", "Only steps after this one"),
            _int("until_step", "Only steps up to this one"),
            _int("max_points", "Per rank; above it min/max downsampled (2-100000, default 2000)"),
            _int("rank", "Only this rank"),
            _int("attempt", "Only this attempt number"),
            _int(
                "lines",
                "A wide job's chart (1-64, not with rank): the band across every rank per step "
                "bucket (`spread`) and the lines of at most this many ranks, rank 0 and those "
                "farthest from the rest over the range's last 64 steps (`lines` says which way)",
            ),
        ],
        responses={200: MetricSeriesSerializer},
    ),
    logs=extend_schema(
        parameters=[
            _int("rank", "Rank (default 0)"),
            _int("tail", "Last lines (1-10000, default 200)"),
            _int("attempt", "Attempt number (default the latest)"),
            _int("after", "A cursor from an earlier answer: the text after it, up to 256 chunks"),
        ],
        responses={200: LogTailSerializer},
    ),
    metric_names=extend_schema(responses={200: MetricNamesSerializer}),
    gpus=extend_schema(responses={200: JobGpusSerializer}),
    gpu_history=extend_schema(
        parameters=[
            _int("points", "Per attempt and rank, at most about this many (1-5000, default 300)"),
            _int(
                "lines",
                "A wide job (1-64, not with since): the latest attempt's utilization band across "
                "ranks (`spread`: t, low, mean, high) and at most this many ranks' series",
            ),
            _int("since", "Only readings from this time on (epoch seconds)"),
        ],
        responses={200: GpuHistorySerializer},
        description="GPU readings kept from the nodes' heartbeats every LOCKSTEP_GPU_SAMPLE_S "
        "(10 s), per attempt and rank, averaged into time buckets.",
    ),
)(JobViewSet)

extend_schema_view(
    create=extend_schema(
        request=ModelVersionCreateSerializer, responses={201: ModelVersionSerializer}
    ),
)(ModelVersionViewSet)

_node_action = extend_schema(
    request=NodeReasonSerializer, responses={200: NodeSerializer}, description="Cluster admins."
)
extend_schema_view(cordon=_node_action, drain=_node_action, uncordon=_node_action)(NodeViewSet)

extend_schema_view(
    partial_update=extend_schema(
        request=TeamQuotaSerializer,
        responses={200: TeamSerializer},
        description="Change quota, borrow limit or weight (cluster admins).",
    ),
)(TeamViewSet)

_decision = extend_schema(
    request=None,
    responses={200: PreemptionSerializer, 409: CONFLICT},
    description="Cluster admins; only a proposed preemption can be decided (else 409).",
)
extend_schema_view(
    list=extend_schema(
        parameters=[
            OpenApiParameter(
                "state",
                OpenApiTypes.STR,
                description="Only requests in these states, comma-separated (proposed,executed)",
            )
        ]
    ),
    approve=_decision,
    reject=_decision,
)(PreemptionViewSet)

extend_schema_view(
    create=extend_schema(
        request=WhatIfRequestSerializer,
        responses={
            201: OpenApiResponse(WhatIfRunSerializer, description="Ran at once (done or failed)"),
            202: OpenApiResponse(WhatIfRunSerializer, description="Queued for the worker"),
        },
    ),
)(WhatIfViewSet)

extend_schema_view(
    post=extend_schema(
        request=PlanRequestSerializer,
        examples=[
            OpenApiExample(
                "A 7B model on 8 GPUs",
                request_only=True,
                value={
                    "layers": 32,
                    "hidden": 4096,
                    "heads": 32,
                    "vocab": 32000,
                    "seq": 4096,
                    "gpus": 8,
                },
            )
        ],
        responses={
            200: inline_serializer(
                "Plan",
                {
                    "model": serializers.DictField(),
                    "cluster": serializers.DictField(),
                    "assumptions": serializers.DictField(),
                    "layouts": serializers.ListField(child=serializers.DictField()),
                    "recommended": serializers.DictField(allow_null=True),
                    "reasons": serializers.ListField(child=serializers.CharField()),
                },
            )
        },
    ),
)(PlanView)

_AGENT = [{"agentToken": []}]
extend_schema_view(
    post=extend_schema(
        request=RegisterSerializer,
        responses={
            200: inline_serializer(
                "AgentRegistered",
                {
                    "node_id": serializers.IntegerField(),
                    "node_token": serializers.CharField(),
                    "heartbeat_s": serializers.FloatField(),
                },
            ),
            401: DetailSerializer,
        },
        auth=_AGENT,
        description="Agents only, with the cluster agent token: register (or re-register) a "
        "node and get its node token.",
    ),
)(AgentRegisterView)

extend_schema_view(
    post=extend_schema(
        request=HeartbeatSerializer,
        examples=[
            OpenApiExample(
                "Two ranks running, a step and a log line",
                request_only=True,
                value={
                    "boot_id": "3f1c...",
                    "telemetry": [{"index": 0, "util": 97.0, "mem_used": 70, "mem_total": 80}],
                    "attempts": [
                        {
                            "attempt_id": 17,
                            "ranks": [
                                {"rank": 0, "pid": 1234, "state": "running", "exit_code": None},
                                {"rank": 1, "pid": 1235, "state": "exited", "exit_code": -9},
                            ],
                            "records": [
                                {"rank": 0, "kind": "step", "step": 12, "loss": 2.1},
                                {"rank": 0, "kind": "end", "step": 12, "reason": "done"},
                            ],
                            "logs": [{"rank": 0, "text": "step 12 loss 2.1\n"}],
                        }
                    ],
                },
            )
        ],
        responses={
            200: inline_serializer(
                "AgentHeartbeatReply",
                {
                    "heartbeat_s": serializers.FloatField(),
                    "desired": serializers.ListField(child=serializers.DictField()),
                    "acked": serializers.ListField(child=serializers.IntegerField()),
                },
            ),
            400: OpenApiResponse(description="A malformed body: a message per field"),
            401: DetailSerializer,
            409: CONFLICT,
        },
        auth=_AGENT,
        description="Agents only, with their node token: telemetry, per-rank status, metric "
        "and log batches in; the attempts that should run on the node out "
        "(docs/agent-protocol.md).",
    ),
)(AgentHeartbeatView)


ERROR_RESPONSES = {
    "401": "No credentials, or an unknown, expired or revoked token",
    "403": "Signed in, but not allowed",
    "404": "Missing, or not yours (the same answer either way)",
    "429": "Too many requests: see the Retry-After header (seconds)",
}


def document_error_responses(result, generator, request, public):
    """Every operation can answer 401, 403 and 429 ({"detail": ...}; docs/api.md, Errors), and
    every operation on one object 404: state them in the schema so clients and the fuzzer know
    them, without repeating them on every view."""
    detail = {"application/json": {"schema": {"$ref": "#/components/schemas/Detail"}}}
    for path, operations in result.get("paths", {}).items():
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            for code, description in ERROR_RESPONSES.items():
                if code == "404" and "{" not in path:
                    continue
                responses.setdefault(code, {"description": description, "content": detail})
    return result
