"""Bearer-token authentication for the REST API (tokens are stored as SHA-256 digests)."""

from datetime import timedelta

from django.utils import timezone
from rest_framework import authentication, exceptions

from teams.models import ApiToken, token_digest
from teams.throttle import client_address, record_failure, retry_after

LAST_USED_RESOLUTION = timedelta(minutes=1)


def user_for_token(raw: str):
    """The active user behind a raw token, or None."""
    token = (
        ApiToken.objects.select_related("user")
        .filter(digest=token_digest(raw), revoked_at__isnull=True)
        .first()
    )
    if token is None or not token.user.is_active:
        return None
    now = timezone.now()
    if token.expires_at is not None and token.expires_at <= now:
        return None
    if token.last_used_at is None or now - token.last_used_at > LAST_USED_RESOLUTION:
        # At most one write a minute per token, not one per request.
        ApiToken.objects.filter(pk=token.pk).update(last_used_at=now)
    return token.user


class BearerTokenAuthentication(authentication.BaseAuthentication):
    keyword = "Bearer"

    def authenticate(self, request):
        header = authentication.get_authorization_header(request).decode(errors="replace")
        parts = header.split()
        if not parts or parts[0] != self.keyword:
            return None
        address = client_address(request)
        wait = retry_after(address)
        if wait is not None:
            raise exceptions.Throttled(wait, detail="Too many failed authentications.")
        if len(parts) != 2:
            raise exceptions.AuthenticationFailed("Authorization header must be 'Bearer <token>'.")
        if parts[1].startswith("node_"):
            # Node tokens only work on agent endpoints, which authenticate them themselves.
            raise exceptions.AuthenticationFailed("Agent tokens are not valid here.")
        user = user_for_token(parts[1])
        if user is None:
            record_failure(address)
            raise exceptions.AuthenticationFailed("Invalid, expired or revoked token.")
        return (user, None)

    def authenticate_header(self, request) -> str:
        return self.keyword
