"""The project's cache backend: Django's Redis cache with one connection pool per process.

Django keeps a cache object per async context (`django.core.cache.caches` is context-local),
so under ASGI every request builds a new `RedisCache`, and with it a new client and a new
connection pool: each request that touched the cache (the auth-failure throttle on every agent
heartbeat, DRF's rate limits) opened a fresh TCP connection to Redis and ran its handshake. The
hollow-node harness (bench/hollow.py, issue 20) measured that at a tenth of a heartbeat's time
in the portal. Here the client, which holds the pools, is shared by every cache object of one
process built from the same settings; redis-py's pool is thread-safe, and connections go back
to it after each command.
"""

from __future__ import annotations

import threading

from django.core.cache.backends.redis import RedisCache

_clients: dict[tuple, object] = {}
_lock = threading.Lock()


class PooledRedisCache(RedisCache):
    @property
    def _cache(self):
        key = (tuple(self._servers), repr(sorted(self._options.items())))
        client = _clients.get(key)
        if client is None:
            with _lock:
                client = _clients.get(key)
                if client is None:
                    client = _clients[key] = self._class(self._servers, **self._options)
        return client
