"""ASGI entry point: Django for HTTP (static files through WhiteNoise), Channels for websockets."""

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")

from django.core.asgi import get_asgi_application  # noqa: E402

django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402

from portal.routing import websocket_urlpatterns  # noqa: E402
from portal.ws_auth import WebsocketAuthStack  # noqa: E402


class BrowserOriginValidator:
    """Browsers always send Origin: check it against ALLOWED_HOSTS. Scripts (the CLI, tests)
    send none and authenticate with a bearer token, which a foreign page cannot forge."""

    def __init__(self, app):
        self.app = app
        self.checked = AllowedHostsOriginValidator(app)

    async def __call__(self, scope, receive, send):
        if any(name == b"origin" for name, _ in scope.get("headers", [])):
            return await self.checked(scope, receive, send)
        return await self.app(scope, receive, send)


application = ProtocolTypeRouter(
    {
        "http": django_asgi_app,
        "websocket": BrowserOriginValidator(WebsocketAuthStack(URLRouter(websocket_urlpatterns))),
    }
)
