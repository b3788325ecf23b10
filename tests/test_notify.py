"""Websocket pushes queued in a transaction go out on commit, and only then."""

import asyncio

import pytest
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import transaction

from jobs.notify import job_group, on_commit_send


async def _next(layer, channel, timeout: float = 2.0):
    return await asyncio.wait_for(layer.receive(channel), timeout)


@pytest.mark.django_db(transaction=True)
def test_a_rolled_back_push_is_dropped_and_later_pushes_still_go_out(settings):
    """A rollback discards the transaction's flush hook. The messages it had queued must go
    with it, and the thread's next transaction must flush its own: the queue used to keep the
    stale messages and register no new hook, so no push from that thread went out again (a
    scheduler pass or heartbeat that lost a deadlock silenced its process's pushes)."""
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    layer = get_channel_layer()
    channel = async_to_sync(layer.new_channel)()
    async_to_sync(layer.group_add)(job_group(7), channel)

    with transaction.atomic():
        with pytest.raises(RuntimeError), transaction.atomic():  # a savepoint rolled back
            on_commit_send(7, {"n": 1})
            raise RuntimeError("one gang lost its race")
        on_commit_send(7, {"n": 2})
    with pytest.raises(RuntimeError), transaction.atomic():
        on_commit_send(7, {"n": 3})
        raise RuntimeError("the state change failed")
    with transaction.atomic():
        on_commit_send(7, {"n": 4})

    received = [async_to_sync(_next)(layer, channel)["message"] for _ in range(2)]
    assert received == [{"n": 2}, {"n": 4}]
    with pytest.raises(TimeoutError):
        async_to_sync(_next)(layer, channel, 0.3)
