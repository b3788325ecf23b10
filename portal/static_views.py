"""plotly.js from the installed plotly package: no CDN, no copy in the repository."""

from functools import cache
from pathlib import Path

import plotly
from django.http import HttpResponse
from django.views.decorators.cache import cache_control
from django.views.decorators.http import require_GET


@cache
def _plotly_bytes() -> bytes:
    return (Path(plotly.__file__).parent / "package_data" / "plotly.min.js").read_bytes()


@require_GET
@cache_control(public=True, max_age=86400)
def plotly_js(request):
    return HttpResponse(_plotly_bytes(), content_type="application/javascript")
