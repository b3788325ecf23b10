"""Websocket authentication: a browser's session, or an API client's bearer token."""

from channels.auth import AuthMiddlewareStack
from channels.db import database_sync_to_async
from channels.middleware import BaseMiddleware

from teams.auth import user_for_token
from teams.throttle import record_failure, retry_after


class BearerTokenMiddleware(BaseMiddleware):
    async def __call__(self, scope, receive, send):
        headers = dict(scope.get("headers") or [])
        header = headers.get(b"authorization", b"").decode(errors="replace").split()
        if len(header) == 2 and header[0] == "Bearer":
            address = (scope.get("client") or ["unknown"])[0]
            # A blocked address, or a bad token, connects as nobody (the consumer refuses it).
            if await database_sync_to_async(retry_after)(address) is None:
                user = await database_sync_to_async(user_for_token)(header[1])
                if user is not None:
                    scope = dict(scope, user=user)
                else:
                    await database_sync_to_async(record_failure)(address)
        return await super().__call__(scope, receive, send)


def WebsocketAuthStack(inner):  # noqa: N802 (named like Channels' own stacks)
    # Session auth first; a valid bearer token then takes precedence.
    return AuthMiddlewareStack(BearerTokenMiddleware(inner))
