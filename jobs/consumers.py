"""Websocket `ws/jobs/{id}/`: live metrics, state and log messages for one job.

A user who may not see the job (or a job that does not exist) gets the same answer: the
socket is accepted and closed at once with code 4404, so nothing is revealed.
"""

from channels.db import DatabaseSyncToAsync
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from jobs.notify import job_group
from teams.access import visible_jobs

NOT_FOUND = 4404


class JobConsumer(AsyncJsonWebsocketConsumer):
    async def connect(self):
        self.group = None
        job_id = self.scope["url_route"]["kwargs"]["job_id"]
        user = self.scope.get("user")
        await self.accept()
        # On a worker thread, not behind the process's sync requests (portal/ws_auth.py).
        state = await DatabaseSyncToAsync(_visible_state, thread_sensitive=False)(user, job_id)
        if state is None:
            await self.close(code=NOT_FOUND)
            return
        self.group = job_group(job_id)
        await self.channel_layer.group_add(self.group, self.channel_name)
        await self.send_json({"type": "state", "job": job_id, **state})

    async def disconnect(self, code):
        if self.group:
            await self.channel_layer.group_discard(self.group, self.channel_name)

    async def job_message(self, event):
        await self.send_json(event["message"])


def _visible_state(user, job_id: int):
    if user is None or not user.is_authenticated:
        return None
    return visible_jobs(user).filter(pk=job_id).values("state", "reason").first()
