"""Push job updates to websocket clients (after commit, through the channel layer).

Messages queued during a transaction go out together on commit, in one trip into the event
loop: a scheduler pass that starts hundreds of gangs must not pay a channel-layer round trip
(and an event loop) per job.
"""

import logging
import threading

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import transaction

log = logging.getLogger(__name__)
_pending = threading.local()


def job_group(job_id: int) -> str:
    return f"job-{job_id}"


async def _send_all(messages: list[tuple[int, dict]]) -> None:
    layer = get_channel_layer()
    if layer is None:
        return
    for job_id, message in messages:
        await layer.group_send(job_group(job_id), {"type": "job.message", "message": message})


def send_to_job(job_id: int, message: dict) -> None:
    _send([(job_id, message)])


def _send(messages: list[tuple[int, dict]]) -> None:
    try:
        async_to_sync(_send_all)(messages)
    except Exception as exc:  # a dashboard push must never fail the state change behind it
        log.warning("websocket push of %d message(s) failed: %s", len(messages), exc)


def _flush() -> None:
    messages, _pending.messages = getattr(_pending, "messages", []), []
    if messages:
        _send(messages)


def on_commit_send(job_id: int, message: dict) -> None:
    connection = transaction.get_connection()
    if not connection.in_atomic_block:
        send_to_job(job_id, message)
        return
    queue = getattr(_pending, "messages", None)
    if queue is None or not any(func is _flush for _, func, _ in connection.run_on_commit):
        # No flush pending in this transaction: none was, or a rollback discarded it, and with
        # it the messages queued since (they describe changes that never happened). Keeping
        # those and registering no new flush had silenced every later push of this thread.
        # Not covered: a savepoint rolled back after the flush was registered outside it (a
        # gang of a batch that lost its race) still has its messages sent; the next push of
        # that job's state corrects it.
        _pending.messages = queue = []
        transaction.on_commit(_flush)
    queue.append((job_id, message))
