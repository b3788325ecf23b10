"""Wake the scheduler loop now instead of at its next tick (submit, exit, node change)."""

import logging

import redis
from django.conf import settings

log = logging.getLogger(__name__)
WAKE_CHANNEL = "lockstep:scheduler:wake"
_client = None


def redis_client() -> redis.Redis:
    global _client
    if _client is None:
        _client = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=2)
    return _client


def wake_scheduler(reason: str) -> None:
    # Best effort: the loop's periodic tick still finds the work if this message is lost.
    try:
        redis_client().publish(WAKE_CHANNEL, reason)
    except redis.RedisError as exc:
        log.warning("could not wake the scheduler (%s); it will act at its next tick", exc)
