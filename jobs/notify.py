"""Push job updates to websocket clients (after commit, through the channel layer)."""

import logging

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import transaction

log = logging.getLogger(__name__)


def job_group(job_id: int) -> str:
    return f"job-{job_id}"


def send_to_job(job_id: int, message: dict) -> None:
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        async_to_sync(layer.group_send)(
            job_group(job_id), {"type": "job.message", "message": message}
        )
    except Exception as exc:  # a dashboard push must never fail the state change behind it
        log.warning("websocket push for job %s failed: %s", job_id, exc)


def on_commit_send(job_id: int, message: dict) -> None:
    transaction.on_commit(lambda: send_to_job(job_id, message))
