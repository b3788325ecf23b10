"""The role matrix of the job websocket (ws/jobs/{id}/, not an operation of the OpenAPI
schema, so not a row of tests/test_role_matrix.py): alpha's admin, lead and member get the
job's state and what is pushed to its group; every other role is closed with 4404, exactly
as for a job that does not exist. The world and the roles are tests/role_matrix_world.py's.
"""

from __future__ import annotations

import json

import pytest
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from channels.testing import WebsocketCommunicator

from jobs.notify import job_group
from tests.role_matrix_world import (
    GHOST_ID,
    ROLES,
    shared_world_fixture,  # noqa: F401 (fixture)
    world_fixture,  # noqa: F401 (fixture)
)

WS_ALLOWED = {"admin", "lead", "member"}


async def _ws_session(token: str | None, job_id: int) -> dict:
    """Connect to ws/jobs/{job_id}/, read what comes, and push a message to the job's group:
    {"accepted", "first", "pushed", "close"}."""
    from portal.asgi import application

    headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
    communicator = WebsocketCommunicator(application, f"/ws/jobs/{job_id}/", headers=headers)
    accepted, _ = await communicator.connect(timeout=5)
    seen = {"accepted": accepted, "first": None, "pushed": None, "close": None}
    if accepted:
        message = await communicator.receive_output(timeout=5)
        if message["type"] == "websocket.close":
            seen["close"] = message.get("code")
        else:
            seen["first"] = json.loads(message["text"])
            await get_channel_layer().group_send(
                job_group(job_id),
                {"type": "job.message", "message": {"type": "log", "line": "pushed"}},
            )
            seen["pushed"] = await communicator.receive_json_from(timeout=5)
    await communicator.disconnect()
    return seen


@pytest.fixture
def ws_env(settings, monkeypatch):
    # Group names are job ids: a Redis layer shared with other test runs could cross them.
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    # The consumer's database calls run on this thread, inside the test's transaction; Channels
    # closes "old" connections around each, which would close the test's own.
    import channels.db

    monkeypatch.setattr(channels.db, "close_old_connections", lambda: None)
    # ... and they must run on this thread, where the test's rows are (a worker thread's own
    # connection would not see them): production runs them on a worker thread.
    import jobs.consumers

    monkeypatch.setattr(jobs.consumers, "ON_WORKER_THREAD", False)


@pytest.mark.django_db
@pytest.mark.parametrize("role", ROLES)
def test_job_stream(role, world, ws_env):
    token = world.tokens.get(role)
    world.job.refresh_from_db()
    seen = async_to_sync(_ws_session)(token, world.job.id)
    if role in WS_ALLOWED:
        assert seen["first"] == {
            "type": "state",
            "job": world.job.id,
            "state": world.job.state,
            "reason": world.job.reason,
        }, seen
        assert seen["pushed"] == {"type": "log", "line": "pushed"}
        return
    assert seen["first"] is None and seen["pushed"] is None, seen
    assert seen["close"] == 4404, seen
    # The same answer as for a job that does not exist.
    assert async_to_sync(_ws_session)(token, GHOST_ID) == seen
