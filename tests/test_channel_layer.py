"""The channel layer under a burst of websockets (portal/channel_layer.py), on the suite's real
Redis: a daphne process whose job pages open hundreds of sockets at once (a watchers' burst,
every page reconnecting after a restart) joins every one to its group. With redis-py 8's
default pool, the 101st command in flight at once failed with "Too many connections" and the
socket was closed (1011) before its first message: the hollow-node harness's intermittent
"closed before subscribing"."""

import asyncio

import pytest
from channels.layers import get_channel_layer
from channels_redis.core import RedisChannelLayer
from django.conf import settings

from portal.channel_layer import BurstTolerantRedisChannelLayer

SOCKETS = 300  # one daphne process's share of a reconnect storm


async def _join_and_reach_all(layer, group: str) -> int:
    channels = [await layer.new_channel() for _ in range(SOCKETS)]
    await asyncio.gather(*(layer.group_add(group, c) for c in channels))
    await layer.group_send(group, {"type": "job.message", "message": {"n": 1}})
    got = await asyncio.gather(*(layer.receive(c) for c in channels))
    await asyncio.gather(*(layer.group_discard(group, c) for c in channels))
    return sum(1 for m in got if m["message"] == {"n": 1})


def _config() -> dict:
    return settings.CHANNEL_LAYERS["default"]["CONFIG"]


def test_the_portal_uses_the_burst_tolerant_layer():
    assert settings.CHANNEL_LAYERS["default"]["BACKEND"] == (
        "portal.channel_layer.BurstTolerantRedisChannelLayer"
    )
    assert isinstance(get_channel_layer(), BurstTolerantRedisChannelLayer)


def test_a_burst_of_sockets_all_join_and_all_receive():
    layer = BurstTolerantRedisChannelLayer(**_config())
    assert asyncio.run(_join_and_reach_all(layer, "burst-tolerant")) == SOCKETS


def test_the_default_pool_fails_the_same_burst():
    """The test above can fail: channels-redis's own layer, same Redis, same burst."""
    from redis.exceptions import MaxConnectionsError

    layer = RedisChannelLayer(**_config())
    with pytest.raises(MaxConnectionsError):
        asyncio.run(_join_and_reach_all(layer, "burst-default"))
