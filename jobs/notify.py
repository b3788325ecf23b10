"""Push job updates to websocket clients (after commit, through the channel layer).

Messages queued during a transaction go out together on commit, in one trip into the event
loop: a scheduler pass that starts hundreds of gangs must not pay a channel-layer round trip
(and an event loop) per job.

Every message carries `src` (this process) and `seq` (its number among this process's pushes
to that job, from 1). The channel layer may drop a message (a watcher's queue full while its
portal process stalls), and a page cannot see a hole in a series on its own: one that finds a
number skipped fetches again what it shows (portal/static/portal/job.js).
"""

import logging
import threading
import uuid
from collections import OrderedDict

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import transaction

log = logging.getLogger(__name__)
_pending = threading.local()

SOURCE = uuid.uuid4().hex[:12]
# Per job, the last `seq` this process sent; the least recently pushed jobs are forgotten past
# this many (a page that then sees the count start again at 1 takes it as a new start).
SEQUENCES_KEPT = 10_000
_sequences: OrderedDict[int, int] = OrderedDict()
# One push at a time per process, so that a job's numbers go out in order.
_send_lock = threading.Lock()


def job_group(job_id: int) -> str:
    return f"job-{job_id}"


async def _send_all(messages: list[tuple[int, dict]]) -> None:
    layer = get_channel_layer()
    if layer is None:
        return
    for job_id, message in messages:
        seq = _sequences.pop(job_id, 0) + 1
        _sequences[job_id] = seq
        if len(_sequences) > SEQUENCES_KEPT:
            _sequences.popitem(last=False)
        # Numbered before the send: a send that fails leaves its number unused, which the
        # page sees as the gap it is.
        sequenced = {**message, "src": SOURCE, "seq": seq}
        await layer.group_send(job_group(job_id), {"type": "job.message", "message": sequenced})


def send_to_job(job_id: int, message: dict) -> None:
    _send([(job_id, message)])


def _send(messages: list[tuple[int, dict]]) -> None:
    try:
        with _send_lock:
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
