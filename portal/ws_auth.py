"""Websocket authentication: a browser's session, or an API client's bearer token. Every
database read here runs beside the process's sync requests, not behind them
(jobs/consumers.py `beside_requests` says why).
"""

from channels.auth import AuthMiddleware, get_user
from channels.middleware import BaseMiddleware
from channels.sessions import CookieMiddleware, SessionMiddleware

from jobs.consumers import beside_requests
from teams.auth import user_for_token
from teams.throttle import record_failure, retry_after


class SessionAuthMiddleware(AuthMiddleware):
    """Channels' session authentication, its user read beside the requests."""

    async def resolve_scope(self, scope):
        scope["user"]._wrapped = await beside_requests(get_user.func)(scope)


class BearerTokenMiddleware(BaseMiddleware):
    async def __call__(self, scope, receive, send):
        headers = dict(scope.get("headers") or [])
        header = headers.get(b"authorization", b"").decode(errors="replace").split()
        if len(header) == 2 and header[0] == "Bearer":
            address = (scope.get("client") or ["unknown"])[0]
            # A blocked address, or a bad token, connects as nobody (the consumer refuses it).
            if await beside_requests(retry_after)(address) is None:
                user = await beside_requests(user_for_token)(header[1])
                if user is not None:
                    scope = dict(scope, user=user)
                else:
                    await beside_requests(record_failure)(address)
        return await super().__call__(scope, receive, send)


def WebsocketAuthStack(inner):  # noqa: N802 (named like Channels' own stacks)
    # Session auth first; a valid bearer token then takes precedence.
    return CookieMiddleware(SessionMiddleware(SessionAuthMiddleware(BearerTokenMiddleware(inner))))
