"""Throttling of failed authentication, per client address.

Every failed credential (an unknown, expired or revoked API token, a wrong agent or node token,
a wrong password on the sign-in form) counts against the address it came from, in fixed
windows kept in the shared cache (Redis), so every daphne process sees the same count. Past
the limit (`LOCKSTEP_THROTTLE_AUTH_FAILURES`, "20/min" by default) that address is refused
with a 429 and Retry-After until its window ends, whatever it presents, even a valid
credential: otherwise a guesser could keep guessing and simply learn which guess worked.
Successful sign-ins never count, so people and agents that hold good credentials never meet
the limit.

The address is REMOTE_ADDR. Behind a reverse proxy every request shares the proxy's address;
set the proxy to pass the client address through (docs/production.md) before relying on this.
"""

from __future__ import annotations

import time

from django.conf import settings
from django.core.cache import cache

PERIODS = {"s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "hour": 3600, "d": 86400, "day": 86400}


def parse_rate(rate: str) -> tuple[int, int]:
    """ "20/min" -> (20, 60): how many failures, within how many seconds."""
    count, _, period = rate.partition("/")
    try:
        return int(count), PERIODS[period.strip().lower()]
    except (KeyError, ValueError):
        raise ValueError(f"bad auth-failure rate {rate!r}: expected like '20/min'") from None


def _limit() -> tuple[int, int]:
    return parse_rate(getattr(settings, "LOCKSTEP_THROTTLE_AUTH_FAILURES", "20/min"))


def client_address(request) -> str:
    return request.META.get("REMOTE_ADDR") or "unknown"


def _key(address: str, window: int) -> str:
    return f"lockstep:authfail:{address}:{window}"


def retry_after(address: str, *, now: float | None = None) -> int | None:
    """Seconds until `address` may try again, or None when it is not blocked."""
    limit, period = _limit()
    now = time.time() if now is None else now
    window = int(now // period)
    try:
        failures = cache.get(_key(address, window), 0)
    except Exception:  # a cache outage must not lock everybody out: fail open
        return None
    if failures < limit:
        return None
    return max(1, int((window + 1) * period - now + 0.999))


def record_failure(address: str, *, now: float | None = None) -> None:
    _, period = _limit()
    now = time.time() if now is None else now
    key = _key(address, int(now // period))
    try:
        cache.add(key, 0, timeout=period + 1)
        cache.incr(key)
    except Exception:
        pass
