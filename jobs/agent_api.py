"""Agent endpoints: register, heartbeat and leaving. Only agent tokens work here, and user
tokens do not: the cluster agent token registers a node, the node token it gets back is bound
to that node and valid on the heartbeat and leaving endpoints only."""

import hmac
import time

from django.utils import timezone
from drf_spectacular.utils import extend_schema, extend_schema_field
from rest_framework import serializers, status
from rest_framework.exceptions import Throttled
from rest_framework.permissions import AllowAny
from rest_framework.response import Response
from rest_framework.views import APIView

from jobs import actions
from jobs.actions.ingest import STEP_METRICS
from jobs.conf import lockstep_setting
from jobs.models import Node
from teams.models import token_digest
from teams.throttle import client_address, record_failure, retry_after


def _bearer(request) -> str:
    header = request.META.get("HTTP_AUTHORIZATION", "")
    parts = header.split()
    return parts[1] if len(parts) == 2 and parts[0] == "Bearer" else ""


class RegisterSerializer(serializers.Serializer):
    name = serializers.RegexField(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
    gpus = serializers.IntegerField(min_value=1, max_value=64)
    gpu_kind = serializers.ChoiceField(choices=["cpu", "cuda"], default="cpu")
    hostname = serializers.CharField(max_length=255, required=False, allow_blank=True, default="")
    address = serializers.CharField(max_length=255)
    rack = serializers.CharField(max_length=64, required=False, default="default")
    boot_id = serializers.CharField(max_length=64, required=False, allow_blank=True, default="")
    killed_orphans = serializers.IntegerField(min_value=0, required=False, default=0)
    runtime = serializers.ChoiceField(choices=["container", "process"], default="process")
    engine = serializers.ChoiceField(
        choices=["", "podman", "docker"], required=False, allow_blank=True, default=""
    )


MAX_RANK = 100_000
INT32 = 2**31 - 1


@extend_schema_field({"type": "array", "items": {"type": "object"}})
class ObjectListField(serializers.Field):
    """A list of JSON objects, checked for shape only: a heartbeat may carry thousands of metric
    records, which do_heartbeat checks one by one as it ingests them."""

    def to_internal_value(self, data):
        if not isinstance(data, list) or not all(isinstance(item, dict) for item in data):
            raise serializers.ValidationError("Expected a list of objects.")
        return data

    def to_representation(self, value):
        return value


@extend_schema_field({"type": "string"})
class LogTextField(serializers.Field):
    """Any string, NUL characters included (CharField refuses them): a worker's output is
    whatever it printed, and refusing it would fail every heartbeat that re-sends it."""

    def to_internal_value(self, data):
        if not isinstance(data, str):
            raise serializers.ValidationError("Expected a string.")
        return data

    def to_representation(self, value):
        return value


class RankReportSerializer(serializers.Serializer):
    rank = serializers.IntegerField(min_value=0, max_value=MAX_RANK)
    pid = serializers.IntegerField(required=False, allow_null=True, min_value=0, max_value=INT32)
    state = serializers.CharField(max_length=16)
    exit_code = serializers.IntegerField(
        required=False, allow_null=True, min_value=-INT32, max_value=INT32
    )
    exited_at = serializers.FloatField(required=False, allow_null=True)
    # CPU seconds the live rank's session used so far (jobs/actions/activity.py).
    cpu_s = serializers.FloatField(required=False, allow_null=True, min_value=0)
    # Its stack read from outside differed from the previous reading (nodeagent/stack_sampler.py).
    stack_changed = serializers.BooleanField(required=False, default=False)


class LogReportSerializer(serializers.Serializer):
    rank = serializers.IntegerField(min_value=0, max_value=MAX_RANK)
    text = LogTextField()


METRIC_RECORD = {
    "type": "object",
    "description": (
        "A line of the rank's LOCKSTEP_METRICS_PATH file, a TensorBoard scalar (`scalar`: "
        "name, step, value) or a framework's save the agent saw (`checkpoint` with a format); "
        "bad ones are skipped"
    ),
    "properties": {
        "kind": {
            "type": "string",
            "enum": ["step", "checkpoint", "scalar", "start", "end", "layout"],
        },
        "name": {"type": "string"},
        "value": {"type": ["number", "null"]},
        "format": {"type": "string", "enum": ["dcp", "lightning", "hf", "torch"]},
        "rank": {"type": "integer", "minimum": 0},
        "step": {"type": "integer", "minimum": 0},
        "time": {"type": "number"},
        **{name: {"type": "number"} for name in STEP_METRICS},
        "path": {"type": "string"},
        "bytes": {"type": "integer", "minimum": 0},
        "save_s": {"type": "number"},
        "reason": {"type": "string"},
        "layout": {
            "type": "object",
            "description": "`layout`: the trainer's layout and the planner's prediction",
        },
        "measured_bytes": {
            "type": "object",
            "description": "`layout`: weights, grads, optimizer (and cuda_peak_allocated) "
            "this rank held after its first step",
        },
    },
    "required": ["kind"],
}


@extend_schema_field({"type": "array", "items": METRIC_RECORD})
class RecordListField(ObjectListField):
    pass


class AttemptErrorSerializer(serializers.Serializer):
    """Why the attempt could not start on the node at all: a missing or refused image (`image`:
    the job fails), or the node's quick health check failed (`health`: the job is requeued)."""

    kind = serializers.ChoiceField(choices=["image", "health"])
    message = serializers.CharField(max_length=2000)


class ImageReportSerializer(serializers.Serializer):
    digest = serializers.CharField(max_length=128)
    pull_s = serializers.FloatField(min_value=0, max_value=86_400)


class PullReportSerializer(serializers.Serializer):
    """An image pull under way on the node, before the attempt's container can start."""

    image = serializers.CharField(max_length=255)
    elapsed_s = serializers.FloatField(min_value=0, max_value=86_400)
    detail = serializers.CharField(max_length=500, allow_blank=True, required=False, default="")


class AttemptReportSerializer(serializers.Serializer):
    attempt_id = serializers.IntegerField()
    pull = PullReportSerializer(required=False)
    error = AttemptErrorSerializer(required=False)
    image = ImageReportSerializer(required=False)
    ranks = RankReportSerializer(many=True, required=False, default=list)
    records = RecordListField(required=False, default=list)
    logs = LogReportSerializer(many=True, required=False, default=list)
    dumped = serializers.BooleanField(required=False, default=False)


def _has_nul(value) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_nul(v) for v in value)
    return False


class HealthCheckSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=200)
    ok = serializers.BooleanField()
    detail = serializers.CharField(max_length=2000, allow_blank=True)


class HealthReportSerializer(serializers.Serializer):
    """The node's latest health check (nodeagent/health_check.py), sent until acknowledged."""

    kind = serializers.ChoiceField(choices=["quick", "full"])
    ok = serializers.BooleanField()
    at = serializers.FloatField(required=False)
    checks = HealthCheckSerializer(many=True, max_length=64)
    reason = serializers.CharField(max_length=4000, allow_blank=True, required=False, default="")
    compute_ms = serializers.FloatField(min_value=0, required=False)
    device = serializers.CharField(max_length=200, required=False, allow_blank=True)


class HeartbeatSerializer(serializers.Serializer):
    """The heartbeat body (docs/agent-protocol.md). Its structure is checked here, so that a
    malformed one is a 400 that names the field, not an error half-way through applying it."""

    boot_id = serializers.CharField(max_length=64, allow_blank=True, required=False, default="")
    telemetry = ObjectListField(required=False, default=list)
    attempts = AttemptReportSerializer(many=True, required=False, default=list)
    health = HealthReportSerializer(required=False)

    def validate_telemetry(self, value):
        # Shown on pages and stored as JSON; PostgreSQL's jsonb cannot hold a NUL character.
        if any(_has_nul(reading) for reading in value):
            raise serializers.ValidationError("Telemetry must not contain NUL characters.")
        return value


class LeavingSerializer(serializers.Serializer):
    """An agent stopping on purpose (docs/agent-protocol.md, Leaving)."""

    boot_id = serializers.CharField(max_length=64, allow_blank=True, required=False, default="")
    reason = serializers.CharField(max_length=200, required=False, default="agent stopping")
    grace_s = serializers.FloatField(min_value=0, max_value=86400, required=False, default=None)


class AgentRegisterView(APIView):
    authentication_classes: list = []
    permission_classes = [AllowAny]

    def post(self, request):
        address = client_address(request)
        if (wait := retry_after(address)) is not None:
            raise Throttled(wait, detail="Too many failed authentications.")
        expected = lockstep_setting("AGENT_TOKEN")
        if not expected or not hmac.compare_digest(_bearer(request), expected):
            record_failure(address)
            return Response({"detail": "Invalid agent token."}, status=status.HTTP_401_UNAUTHORIZED)
        serializer = RegisterSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        if serializer.validated_data["runtime"] == "process" and not lockstep_setting(
            "ALLOW_PROCESS_NODES"
        ):
            # Refused before anything is written: the node never takes a job.
            return Response(
                {
                    "runtime": [
                        "This cluster refuses nodes that run jobs as plain processes (not "
                        "isolated): start the agent where podman or Docker works, with "
                        "--runtime podman (docs/runtime.md)."
                    ]
                },
                status=status.HTTP_400_BAD_REQUEST,
            )
        node, raw = actions.do_register_node(now=timezone.now(), **serializer.validated_data)
        return Response(
            {"node_id": node.id, "node_token": raw, "heartbeat_s": lockstep_setting("HEARTBEAT_S")}
        )


def _node_of(request) -> Node | Response:
    """The node whose token the request bears, or the 401 to answer."""
    address = client_address(request)
    if (wait := retry_after(address)) is not None:
        raise Throttled(wait, detail="Too many failed authentications.")
    raw = _bearer(request)
    node = Node.objects.filter(token_digest=token_digest(raw)).first() if raw else None
    if node is None:
        record_failure(address)
        return Response(
            {"detail": "Unknown node token; register again."},
            status=status.HTTP_401_UNAUTHORIZED,
        )
    return node


class AgentHeartbeatView(APIView):
    authentication_classes: list = []
    permission_classes = [AllowAny]

    def post(self, request):
        node = _node_of(request)
        if isinstance(node, Response):
            return node
        started = time.perf_counter()
        body = HeartbeatSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        if body.validated_data["boot_id"] != node.boot_id:
            return Response({"detail": "stale boot"}, status=status.HTTP_409_CONFLICT)
        response = Response(actions.do_heartbeat(node, body.validated_data, now=timezone.now()))
        # The time the portal itself spent (W3C Server-Timing), so a load test can tell it
        # from the time a request waited for the process's thread or the client's own delays.
        response["Server-Timing"] = f"app;dur={(time.perf_counter() - started) * 1000:.1f}"
        return response


class AgentLeavingView(APIView):
    """The agent is stopping on purpose (SIGTERM, SIGINT): a planned restart, not a failure
    (actions.do_node_leaving)."""

    authentication_classes: list = []
    permission_classes = [AllowAny]

    serializer_class = LeavingSerializer  # for the schema (drf-spectacular)

    @extend_schema(request=LeavingSerializer)
    def post(self, request):
        node = _node_of(request)
        if isinstance(node, Response):
            return node
        body = LeavingSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        if body.validated_data["boot_id"] != node.boot_id:
            return Response({"detail": "stale boot"}, status=status.HTTP_409_CONFLICT)
        stopping = actions.do_node_leaving(
            node,
            reason=body.validated_data["reason"],
            grace_s=body.validated_data["grace_s"],
            now=timezone.now(),
        )
        return Response({"stopping": stopping})
