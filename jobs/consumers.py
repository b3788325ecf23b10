"""Websocket `ws/jobs/{id}/`: live metrics, state and log messages for one job.

A user who may not see the job (or a job that does not exist) gets the same answer: the
socket is accepted and closed at once with code 4404, so nothing is revealed.
"""

from channels.db import DatabaseSyncToAsync
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from jobs.notify import job_group
from teams.access import visible_jobs

NOT_FOUND = 4404

# A websocket's database reads run on a worker thread of their own, not on the daphne process's
# one thread for sync work: Django runs every sync view of the process on that thread, so under
# load an opening queued behind seconds of agent heartbeats, and daphne drops a websocket not
# accepted within 5 s (its --websocket_connect_timeout). The hollow-node harness
# (bench/hollow.py) lost all 200 of its watchers that way on a 512-node run. Each call closes
# its connection (or gives it back to the pool) when it ends. Tests that drive a consumer
# inside their own open transaction turn this off, so its reads see their rows.
ON_WORKER_THREAD = True


def beside_requests(func):
    """`func` awaitable from a websocket's code: database_sync_to_async, on a worker thread
    (not thread-sensitive) unless ON_WORKER_THREAD is off."""
    return DatabaseSyncToAsync(func, thread_sensitive=not ON_WORKER_THREAD)


class JobConsumer(AsyncJsonWebsocketConsumer):
    async def connect(self):
        self.group = None
        job_id = self.scope["url_route"]["kwargs"]["job_id"]
        user = self.scope.get("user")
        await self.accept()
        state = await beside_requests(_visible_state)(user, job_id)
        if state is None:
            await self.close(code=NOT_FOUND)
            return
        self.group = job_group(job_id)
        await self.channel_layer.group_add(self.group, self.channel_name)
        # After the group_add, always: this first message tells the client that every push
        # from now on reaches it, so what it fetches after this misses nothing (job.js waits
        # for it before its charts' first fetch; the hollow-node watchers do too).
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
