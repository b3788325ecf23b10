"""The project's cache (portal/cache.py) keeps its Redis connections per process. Django
builds a cache object per async context, so under ASGI each request used to open a new
connection to Redis: the hollow-node harness found it in every agent heartbeat (the
auth-failure throttle reads the cache)."""

import asyncio
import contextvars

from asgiref.sync import sync_to_async
from django.core.cache import caches

REQUESTS = 20


def test_requests_in_separate_contexts_share_the_process_connections():
    def request(i: int):
        cache = caches["default"]  # what a view or the throttle gets in its request
        cache.set(f"lockstep:test:cache:{i}", i, 30)
        assert cache.get(f"lockstep:test:cache:{i}") == i
        return cache

    async def one_request(i: int):
        return await sync_to_async(request)(i)

    # Each in a blank context, as each ASGI request starts (not one copied from this test's,
    # where an earlier test may have left a cache object to inherit).
    objects = [contextvars.Context().run(asyncio.run, one_request(i)) for i in range(REQUESTS)]
    # Django did make a cache object per context (what the pool has to survive) ...
    assert len({id(o) for o in objects}) == REQUESTS
    # ... and they share one client, whose pool keeps a connection or two (other tests of
    # this process may have used it at once) for all of them, not one per request as
    # Django's own backend opened.
    clients = {id(o._cache) for o in objects}
    assert len(clients) == 1, f"{len(clients)} Redis clients for {REQUESTS} requests"
    pool = objects[0]._cache._get_connection_pool(write=True)
    opened = len(pool._available_connections) + len(pool._in_use_connections)
    assert 1 <= opened <= 4, f"{opened} Redis connections for {REQUESTS} requests"
