"""Agent endpoints: register and heartbeat. Only agent tokens work here, and user tokens
do not: the cluster agent token registers a node, the node token it gets back is bound to that
node and valid on the heartbeat endpoint only."""

import hmac

from django.utils import timezone
from rest_framework import serializers, status
from rest_framework.permissions import AllowAny
from rest_framework.response import Response
from rest_framework.views import APIView

from jobs import actions
from jobs.conf import lockstep_setting
from jobs.models import Node
from teams.models import token_digest


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


class AgentRegisterView(APIView):
    authentication_classes: list = []
    permission_classes = [AllowAny]

    def post(self, request):
        expected = lockstep_setting("AGENT_TOKEN")
        if not expected or not hmac.compare_digest(_bearer(request), expected):
            return Response({"detail": "Invalid agent token."}, status=status.HTTP_401_UNAUTHORIZED)
        serializer = RegisterSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        node, raw = actions.do_register_node(now=timezone.now(), **serializer.validated_data)
        return Response(
            {"node_id": node.id, "node_token": raw, "heartbeat_s": lockstep_setting("HEARTBEAT_S")}
        )


class AgentHeartbeatView(APIView):
    authentication_classes: list = []
    permission_classes = [AllowAny]

    def post(self, request):
        raw = _bearer(request)
        node = Node.objects.filter(token_digest=token_digest(raw)).first() if raw else None
        if node is None:
            return Response(
                {"detail": "Unknown node token; register again."},
                status=status.HTTP_401_UNAUTHORIZED,
            )
        body = request.data if isinstance(request.data, dict) else {}
        if body.get("boot_id", "") != node.boot_id:
            return Response({"detail": "stale boot"}, status=status.HTTP_409_CONFLICT)
        if not isinstance(body.get("attempts", []), list):
            return Response({"attempts": ["must be a list"]}, status=status.HTTP_400_BAD_REQUEST)
        return Response(actions.do_heartbeat(node, body, now=timezone.now()))
