"""Websocket authentication: a browser's session, or an API client's bearer token."""

from channels.auth import AuthMiddlewareStack
from channels.db import database_sync_to_async
from channels.middleware import BaseMiddleware

from teams.auth import user_for_token


class BearerTokenMiddleware(BaseMiddleware):
    async def __call__(self, scope, receive, send):
        headers = dict(scope.get("headers") or [])
        header = headers.get(b"authorization", b"").decode(errors="replace").split()
        if len(header) == 2 and header[0] == "Bearer":
            user = await database_sync_to_async(user_for_token)(header[1])
            if user is not None:
                scope = dict(scope, user=user)
        return await super().__call__(scope, receive, send)


def WebsocketAuthStack(inner):  # noqa: N802 (named like Channels' own stacks)
    # Session auth first; a valid bearer token then takes precedence.
    return AuthMiddlewareStack(BearerTokenMiddleware(inner))
