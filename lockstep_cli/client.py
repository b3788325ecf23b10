"""The REST client of the `lockstep` command: where the portal URL and token come from (flags,
environment, config file), one authenticated session, and each HTTP answer as an exit code."""

from __future__ import annotations

import os
import sys
import tomllib
from pathlib import Path

EXIT_OK = 0
EXIT_FAILED = 1  # the job failed or was cancelled, or what was asked for does not exist
EXIT_USAGE = 2  # bad arguments or a bad spec: the server's field errors are printed
EXIT_AUTH = 3  # no token, a wrong, expired or revoked token, or not allowed
EXIT_UNREACHABLE = 4  # no answer from the portal (refused, timed out, not a Lockstep portal)
EXIT_SERVER = 5  # the portal answered 5xx, or throttled the request (429)

END_STATES = ("SUCCEEDED", "FAILED", "CANCELLED")


def outcome(job: dict) -> int:
    """The exit code a job's end gives a command that waited for it."""
    return EXIT_FAILED if job["state"] in ("FAILED", "CANCELLED") else EXIT_OK


DEFAULT_URL = "http://127.0.0.1:8000"


class CliError(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


# --- where the portal and the token come from ----------------------------------------------


def config_path() -> Path:
    explicit = os.environ.get("LOCKSTEP_CONFIG")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(base) / "lockstep" / "config.toml"


def load_config() -> dict:
    """The config file's `url` and `token`; {} when there is none (an explicit LOCKSTEP_CONFIG
    that does not exist is an error: the user meant a file)."""
    path = config_path()
    if not path.exists():
        if os.environ.get("LOCKSTEP_CONFIG"):
            raise CliError(EXIT_USAGE, f"LOCKSTEP_CONFIG={path}: no such file")
        return {}
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise CliError(EXIT_USAGE, f"{path}: {exc}") from exc
    unknown = sorted(set(data) - {"url", "token"})
    if unknown:
        raise CliError(EXIT_USAGE, f"{path}: unknown key(s) {', '.join(unknown)} (url, token)")
    if "token" in data and path.stat().st_mode & 0o077:
        print(
            f"lockstep: warning: {path} holds a token and others may read it (chmod 600 it)",
            file=sys.stderr,
        )
    return data


def resolve(args) -> tuple[str, str | None]:
    """(url, token): each from the command line, else the environment, else the config file;
    the URL falls back to a local portal."""
    config = None

    def from_config(key: str):
        nonlocal config
        if config is None:
            config = load_config()
        return config.get(key)

    url = (
        getattr(args, "url", None)
        or os.environ.get("LOCKSTEP_URL")
        or os.environ.get("LOCKSTEP_PORTAL")  # the older name, still read
        or from_config("url")
        or DEFAULT_URL
    )
    token = getattr(args, "token", None) or os.environ.get("LOCKSTEP_TOKEN") or from_config("token")
    return url.rstrip("/"), token


# --- the HTTP session ----------------------------------------------------------------------------


def _field_errors(body) -> str:
    if not isinstance(body, dict):
        return f"  {body}"
    lines = []
    for field, messages in body.items():
        if isinstance(messages, dict):  # nested, e.g. env entries
            messages = [f"{k}: {v}" for k, v in messages.items()]
        elif not isinstance(messages, list):
            messages = [messages]
        for message in messages:
            lines.append(f"  {field}: {message}")
    return "\n".join(lines)


class Portal:
    def __init__(self, url: str, token: str | None, *, timeout: float = 30.0):
        import requests

        if not token:
            raise CliError(
                EXIT_AUTH,
                'no API token: pass --token, set LOCKSTEP_TOKEN, or put token = "lst_..." in '
                f"{config_path()} (create one on the portal's Tokens page)",
            )
        self.url = url
        self.timeout = timeout
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"Bearer {token}"
        self.session.headers["Accept"] = "application/json"

    def call(self, method: str, path: str, **kwargs):
        import requests

        try:
            response = self.session.request(method, self.url + path, timeout=self.timeout, **kwargs)
        except requests.Timeout as exc:
            raise CliError(
                EXIT_UNREACHABLE, f"the portal at {self.url} did not answer in {self.timeout:g} s"
            ) from exc
        except requests.RequestException as exc:
            raise CliError(EXIT_UNREACHABLE, f"cannot reach the portal at {self.url}") from exc
        try:
            body = response.json()
        except ValueError:
            body = None
        code = response.status_code
        if code == 204:  # done, nothing to say (a revoke)
            return {}
        if code < 400:
            if body is None:
                raise CliError(EXIT_UNREACHABLE, f"{self.url} is not a Lockstep portal")
            return body
        detail = body.get("detail") if isinstance(body, dict) else None
        if code == 400:
            raise CliError(EXIT_USAGE, "the portal refused the request:\n" + _field_errors(body))
        if code == 401:
            raise CliError(EXIT_AUTH, f"authentication failed: {detail or 'bad token'}")
        if code == 403:
            raise CliError(EXIT_AUTH, f"not allowed: {detail or 'forbidden'}")
        if code == 404:
            raise CliError(EXIT_FAILED, "not found (or not yours)")
        if code == 429:
            wait = response.headers.get("Retry-After")
            raise CliError(
                EXIT_SERVER, f"throttled by the portal{f'; retry in {wait} s' if wait else ''}"
            )
        if body is None and code >= 500:
            raise CliError(EXIT_SERVER, f"the portal at {self.url} failed ({code})")
        raise CliError(EXIT_SERVER, f"the portal answered {code}: {detail or body}")


def portal_for(args) -> Portal:
    """The portal a command's --url/--token (or the environment, or the config file) name."""
    return Portal(*resolve(args))
