"""Websocket pushes queued in a transaction go out on commit, and only then."""

import asyncio

import pytest
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import transaction

from jobs import notify
from jobs.notify import job_group, on_commit_send, send_to_job


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
    assert [m["n"] for m in received] == [2, 4]
    with pytest.raises(TimeoutError):
        async_to_sync(_next)(layer, channel, 0.3)


@pytest.mark.django_db(transaction=True)
def test_pushes_are_numbered_per_job_so_that_a_page_can_see_one_lost(settings, monkeypatch):
    """Each job's pushes from one process are numbered 1, 2, 3... in the order they go out,
    committed or not; a send that fails uses its number (the page sees the gap); the least
    recently pushed jobs' counts are forgotten past SEQUENCES_KEPT."""
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    monkeypatch.setattr(notify, "_sequences", type(notify._sequences)())
    monkeypatch.setattr(notify, "SEQUENCES_KEPT", 3)
    layer = get_channel_layer()
    channel = async_to_sync(layer.new_channel)()
    for job in (7, 8):
        async_to_sync(layer.group_add)(job_group(job), channel)

    send_to_job(7, {"n": 1})
    with transaction.atomic():
        on_commit_send(8, {"n": 2})
        on_commit_send(7, {"n": 3})
    real_group_send = layer.group_send

    async def failing(group, message):
        raise ConnectionError("redis went away")

    layer.group_send = failing
    send_to_job(7, {"n": 4})  # logged and lost, as any push may be
    layer.group_send = real_group_send
    send_to_job(7, {"n": 5})
    received = [async_to_sync(_next)(layer, channel)["message"] for _ in range(4)]
    assert [(m["n"], m["seq"]) for m in received] == [(1, 1), (2, 1), (3, 2), (5, 4)]
    assert {m["src"] for m in received} == {notify.SOURCE}

    for job in (9, 10):  # two more jobs: 8, the least recently pushed, is forgotten
        send_to_job(job, {"n": 0})
    assert 8 not in notify._sequences and notify._sequences[7] == 4


@pytest.mark.django_db
def test_the_configured_layer_keeps_every_push_to_a_process_watching_many_jobs():
    """The real layer (the embedded Redis here, the machine's in the PostgreSQL leg), as
    configured. Every websocket of one portal process shares one Redis queue, and at
    channels-redis's default capacity (100) a group message beyond it was dropped silently:
    a dozen job pages and a second's lag lost live points (the hollow-node load test)."""
    watchers, pushes = 8, 200

    async def scenario():
        layer = get_channel_layer()
        group = "capacity-check"
        channels = [await layer.new_channel() for _ in range(watchers)]
        for channel in channels:
            await layer.group_add(group, channel)
        try:
            # Sent before anyone reads: the process was busy for the whole burst.
            for n in range(pushes):
                await layer.group_send(group, {"type": "job.message", "n": n})
            return {
                channel: [(await _next(layer, channel))["n"] for _ in range(pushes)]
                for channel in channels
            }
        finally:
            for channel in channels:
                await layer.group_discard(group, channel)

    received = async_to_sync(scenario)()
    assert all(ns == list(range(pushes)) for ns in received.values())


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("cap", "live_ranks"), [(4, {0, 1, 2, 3}), (3, {0})])
def test_a_job_wider_than_the_live_cap_pushes_rank_0_only(setup, settings, cap, live_ranks):
    """Every point and log line is stored either way; only what goes to the watchers changes.
    A 4-rank job under a cap of 4 pushes every rank; under a cap of 3 only rank 0's points and
    lines, and a node without rank 0 pushes nothing at all."""
    from jobs.models import LogChunk, MetricPoint
    from jobs.scheduling.loop import run_pass
    from tests.heartbeats import beat, live_attempt, step_records, submit

    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    settings.LOCKSTEP = {**settings.LOCKSTEP, "LIVE_RANKS_MAX": cap}
    team, user, (a, b), _ = setup
    job = submit(team, user, gpus=4)
    run_pass()
    attempt = live_attempt(job)
    layer = get_channel_layer()
    channel = async_to_sync(layer.new_channel)()
    async_to_sync(layer.group_add)(job_group(job.id), channel)
    on = {a: {0: None, 1: None}, b: {2: None, 3: None}}
    for node, ranks in on.items():
        records = [r for rank in ranks for r in step_records(rank, (1, 2))]
        beat(node, attempt, ranks, records=records, logs={r: f"line of {r}" for r in ranks})

    pushed = []
    while True:
        try:
            pushed.append(async_to_sync(_next)(layer, channel, 0.3)["message"])
        except TimeoutError:
            break
    points = {(p["rank"], p["step"], p["name"]) for m in pushed if m["type"] == "metrics"
              for p in m["points"]}  # fmt: skip
    assert {rank for rank, _, _ in points} == live_ranks
    assert len(points) == len(live_ranks) * 2 * 4
    assert {m["rank"] for m in pushed if m["type"] == "log"} == live_ranks
    assert MetricPoint.objects.filter(attempt=attempt).count() == 4 * 2 * 4
    assert LogChunk.objects.filter(attempt=attempt).count() == 4
