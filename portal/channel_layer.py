"""The channel layer: channels-redis's, with a Redis connection pool that waits when it is busy
instead of failing.

channels-redis builds each host's pool with redis-py's `ConnectionPool.from_url`, and since
redis-py 8 that pool holds at most 100 connections and raises `MaxConnectionsError` ("Too many
connections") on the 101st command in flight at once. Each websocket that opens runs a
`group_add` (and its page's first `group_send`s follow), so a daphne process that takes a
burst of a hundred sockets at once (a watchers' burst, every job page reconnecting after a
restart) failed some of them: the consumer raised, and daphne closed the socket with 1011
before its first message (the hollow-node harness's "closed before subscribing", 1-2 of 200
watchers in half of its full-size runs). A `BlockingConnectionPool` bounds the connections the
same way but makes a command wait for a free one, up to `POOL_TIMEOUT_S`.
"""

from __future__ import annotations

from channels_redis.core import RedisChannelLayer
from redis.asyncio import BlockingConnectionPool

POOL_MAX = 200  # connections per process and Redis host; Redis's own limit is 10,000 clients
POOL_TIMEOUT_S = 20.0  # a command waits this long for a connection before it fails


class BurstTolerantRedisChannelLayer(RedisChannelLayer):
    def create_pool(self, index):
        host = dict(self.hosts[index])
        if "address" not in host:  # sentinels: channels-redis's own pool
            return super().create_pool(index)
        address = host.pop("address")
        host.setdefault("max_connections", POOL_MAX)
        host.setdefault("timeout", POOL_TIMEOUT_S)
        return BlockingConnectionPool.from_url(address, **host)
