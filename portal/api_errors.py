"""One error body shape for the API: `{"field": ["message", ...]}` for a 400 and
`{"detail": "..."}` for everything else, including a 404 or 500 that never reached a DRF view."""

import logging

from django.http import JsonResponse
from django.views import defaults
from rest_framework.views import exception_handler as drf_exception_handler

log = logging.getLogger("lockstep.api")

API_PREFIX = "/api/"


def exception_handler(exc, context):
    """DRF's handler, plus a JSON 500 for an unexpected error inside an API view.

    DRF returns None for exceptions it does not know, and Django then renders its HTML error
    page: a client parsing JSON would get a page it cannot read. The traceback is logged, the
    client sees no internals."""
    response = drf_exception_handler(exc, context)
    if response is not None:
        return response
    request = context.get("request")
    log.error(
        "unhandled error in %s %s",
        getattr(request, "method", "?"),
        getattr(request, "path", "?"),
        exc_info=exc,
    )
    return JsonResponse({"detail": "Internal server error."}, status=500)


def _is_api(request) -> bool:
    return request.path.startswith(API_PREFIX)


def not_found(request, exception=None):
    """JSON 404 for an unknown URL under /api/; the usual page elsewhere."""
    if _is_api(request):
        return JsonResponse({"detail": "Not found."}, status=404)
    return defaults.page_not_found(request, exception)


def server_error(request):
    """JSON 500 under /api/ (errors outside a view, e.g. in middleware); the usual page
    elsewhere."""
    if _is_api(request):
        return JsonResponse({"detail": "Internal server error."}, status=500)
    return defaults.server_error(request)
