"""Throttling of failed authentication, per client address.

Every failed credential (an unknown, expired or revoked API token, a wrong agent or node token,
a wrong password on the sign-in form) counts against the address it came from, in windows
kept in the shared cache (Redis), so every daphne process sees the same count. Past the limit
(`LOCKSTEP_THROTTLE_AUTH_FAILURES`, "20/min" by default) that address is refused with a 429
and Retry-After, whatever it presents, even a valid credential: otherwise a guesser could
keep guessing and simply learn which guess worked.

The count is a sliding window made of ten buckets per period: a failure counts while its
bucket overlaps the last period, so for between one period and 1.1 periods. A plain fixed
window forgets every failure at its edge, so a guesser who times the edge gets twice the
limit, and a burst that happens to straddle it is not counted at all.
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


BUCKETS = 10  # per period; a failure outlives the period by at most one bucket


def _key(address: str, bucket: int, width: float) -> str:
    return f"lockstep:authfail:{address}:{width:g}:{bucket}"


def _in_view(address: str, now: float, period: int) -> list[tuple[int, int]]:
    """(bucket, failures) of every bucket that overlaps the last period, oldest first."""
    width = period / BUCKETS
    newest = int(now // width)
    buckets = range(newest - BUCKETS, newest + 1)
    got = cache.get_many([_key(address, b, width) for b in buckets])
    return [(b, got.get(_key(address, b, width), 0)) for b in buckets]


def retry_after(address: str, *, now: float | None = None) -> int | None:
    """Seconds until `address` may try again, or None when it is not blocked."""
    limit, period = _limit()
    now = time.time() if now is None else now
    try:
        buckets = _in_view(address, now, period)
    except Exception:  # a cache outage must not lock everybody out: fail open
        return None
    total = sum(failures for _, failures in buckets)
    if total < limit:
        return None
    # Buckets leave the view oldest first, a bucket at its end plus one period.
    width = period / BUCKETS
    for bucket, failures in buckets:
        total -= failures
        if total < limit:
            return max(1, int((bucket + 1) * width + period - now + 0.999))
    raise AssertionError("unreachable: the total drops to 0 < limit")


def record_failure(address: str, *, now: float | None = None) -> None:
    _, period = _limit()
    now = time.time() if now is None else now
    width = period / BUCKETS
    key = _key(address, int(now // width), width)
    try:
        cache.add(key, 0, timeout=int(period + 2 * width) + 1)
        cache.incr(key)
    except Exception:
        pass
