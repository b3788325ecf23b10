"""Wake the scheduler loop now instead of at its next tick (submit, exit, node change)."""

import logging

import redis
from django.conf import settings

log = logging.getLogger(__name__)
WAKE_CHANNEL = "lockstep:scheduler:wake"
_client = None


def redis_client() -> redis.Redis:
    """A publisher: a short timeout so a slow Redis never holds up a request."""
    global _client
    if _client is None:
        _client = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=2)
    return _client


def subscriber():
    """The scheduler's wake subscription; reads wait as long as the tick, not a socket timeout."""
    client = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=None)
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(WAKE_CHANNEL)
    return pubsub


def wake_scheduler(reason: str) -> None:
    # Best effort: the loop's periodic tick still finds the work if this message is lost.
    try:
        redis_client().publish(WAKE_CHANNEL, reason)
    except redis.RedisError as exc:
        log.warning("could not wake the scheduler (%s); it will act at its next tick", exc)
