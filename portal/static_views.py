"""plotly.js from the installed plotly package: no CDN, no copy in the repository.

Browsers keep it a day (Cache-Control) and then revalidate it by ETag: a 304, not 4.8 MB again.
A first view still has to compile it (about a second on a slow 2-core host; bench/job_page.py);
nothing the server sends changes that, short of a smaller bundle."""

from functools import cache
from pathlib import Path

import plotly
from django.http import HttpResponse
from django.views.decorators.cache import cache_control
from django.views.decorators.http import etag, require_GET

_PATH = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"


@cache
def _plotly_bytes() -> bytes:
    return _PATH.read_bytes()


@cache
def _plotly_etag() -> str:
    stat = _PATH.stat()
    return f"plotly-{plotly.__version__}-{stat.st_size}-{stat.st_mtime_ns}"


@require_GET
@cache_control(public=True, max_age=86400)  # outside: a 304 carries it too
@etag(lambda request: _plotly_etag())
def plotly_js(request):
    return HttpResponse(_plotly_bytes(), content_type="application/javascript")
