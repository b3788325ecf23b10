"""REST API for a person's own API tokens: list, create (the secret is in the response once,
never again), revoke. Everyone manages only their own tokens; somebody else's token id answers
404 exactly like an id that does not exist. Cluster admins revoke other people's tokens in the
Django admin."""

from datetime import timedelta

from django.utils import timezone
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.response import Response

from teams.actions import do_issue_token, do_revoke_token
from teams.models import ApiToken

MAX_EXPIRY_DAYS = 366


class ApiTokenSerializer(serializers.ModelSerializer):
    state = serializers.SerializerMethodField()

    class Meta:
        model = ApiToken
        fields = ["id", "name", "prefix", "created_at", "expires_at", "last_used_at",
                  "revoked_at", "state"]  # fmt: skip
        read_only_fields = fields

    def get_state(self, token) -> str:
        return token_state(token, timezone.now())


def token_state(token: ApiToken, now) -> str:
    if token.revoked_at is not None:
        return "revoked"
    if token.expires_at is not None and token.expires_at <= now:
        return "expired"
    return "active"


def token_name_error(user, value: str) -> str | None:
    """Why `value` cannot name a new token of `user` (the API and the portal page share it)."""
    value = value.strip()
    if not value:
        return "Give the token a name."
    if any(ord(ch) < 32 for ch in value):
        return "The name must not contain control characters."
    if ApiToken.objects.filter(user=user, name=value, revoked_at__isnull=True).exists():
        return "You already have an active token with this name."
    return None


class TokenCreateSerializer(serializers.Serializer):
    name = serializers.CharField(
        max_length=100, help_text="What the token is for, e.g. 'sweep pipeline'."
    )
    expires_in_days = serializers.IntegerField(
        min_value=1,
        max_value=MAX_EXPIRY_DAYS,
        required=False,
        allow_null=True,
        default=90,
        help_text=f"Days until it stops working (1-{MAX_EXPIRY_DAYS}); null for no expiry.",
    )

    def validate_name(self, value: str) -> str:
        error = token_name_error(self.context["request"].user, value)
        if error:
            raise serializers.ValidationError(error)
        return value.strip()


class CreatedTokenSerializer(ApiTokenSerializer):
    token = serializers.CharField(help_text="The secret. Shown in this response only.")

    class Meta(ApiTokenSerializer.Meta):
        fields = [*ApiTokenSerializer.Meta.fields, "token"]
        read_only_fields = fields


class TokenViewSet(
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    viewsets.GenericViewSet,
):
    serializer_class = ApiTokenSerializer

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):  # schema generation: no user
            return ApiToken.objects.none()
        return ApiToken.objects.filter(user=self.request.user).order_by("-created_at", "-id")

    @extend_schema(request=TokenCreateSerializer, responses={201: CreatedTokenSerializer})
    def create(self, request):
        form = TokenCreateSerializer(data=request.data, context={"request": request})
        form.is_valid(raise_exception=True)
        days = form.validated_data["expires_in_days"]
        expires_at = timezone.now() + timedelta(days=days) if days else None
        token, raw = do_issue_token(
            request.user, name=form.validated_data["name"], expires_at=expires_at
        )
        token.token = raw
        return Response(CreatedTokenSerializer(token).data, status=status.HTTP_201_CREATED)

    @extend_schema(responses={204: None})
    def destroy(self, request, pk=None):
        """Revoke the token: it stops working at once. Revoking it again changes nothing."""
        token = self.get_object()
        do_revoke_token(token, actor=request.user, now=timezone.now())
        return Response(status=status.HTTP_204_NO_CONTENT)
