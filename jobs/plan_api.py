"""REST API for the memory planner (trainer.planner): POST a model and cluster shape, get every
parallel layout's per-GPU memory and traffic, which fit, and the recommended one with reasons.

Pure arithmetic: it reads and writes nothing, so any authenticated user may ask.
"""

from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from trainer import planner
from trainer.layout import timed_plan


class PlanRequestSerializer(serializers.Serializer):
    params = serializers.IntegerField(
        min_value=1,
        max_value=planner.MAX_PARAMS,
        required=False,
        allow_null=True,
        help_text="Parameters; default: derived from the shape (see docs/planner.md)",
    )
    layers = serializers.IntegerField(min_value=1, max_value=planner.MAX_LAYERS)
    hidden = serializers.IntegerField(min_value=1)
    heads = serializers.IntegerField(min_value=1)
    vocab = serializers.IntegerField(min_value=1)
    seq = serializers.IntegerField(min_value=1, help_text="Tokens per sequence")
    micro_batch = serializers.IntegerField(min_value=1, default=1)
    global_batch = serializers.IntegerField(
        min_value=1, required=False, allow_null=True, help_text="Default: micro_batch x gpus"
    )
    gpus = serializers.IntegerField(min_value=1, max_value=planner.MAX_GPUS)
    gpus_per_node = serializers.IntegerField(min_value=1, default=8)
    gpu_mem_gb = serializers.FloatField(min_value=0.001, default=80.0, help_text="GiB per GPU")
    dtype = serializers.ChoiceField(choices=list(planner.DTYPE_BYTES), default="bf16")
    optimizer = serializers.ChoiceField(choices=list(planner.OPTIMIZERS), default="adam")
    activation_checkpointing = serializers.BooleanField(default=False)
    flash_attention = serializers.BooleanField(default=True)
    tied_embeddings = serializers.BooleanField(default=False)

    def validate(self, data):
        cluster_fields = {"gpus", "gpus_per_node", "gpu_mem_gb"}
        try:
            data["model"] = planner.ModelShape(
                **{k: v for k, v in data.items() if k not in cluster_fields}
            )
            data["cluster"] = planner.ClusterShape(**{k: data[k] for k in cluster_fields})
        except planner.PlanError as e:
            raise serializers.ValidationError({e.field: [e.message]}) from None
        return data


class PlanView(APIView):
    """POST the shape; 200 with `layouts` (each: dp, tp, pp, zero, per_gpu_bytes, traffic,
    fits), `recommended` (a layout or null) and `reasons`."""

    serializer_class = PlanRequestSerializer  # for the OpenAPI schema

    def post(self, request):
        body = PlanRequestSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        try:
            result = planner.plan(body.validated_data["model"], body.validated_data["cluster"])
        except planner.PlanError as e:
            raise serializers.ValidationError({e.field: [e.message]}) from None
        return Response(timed_plan(result))
