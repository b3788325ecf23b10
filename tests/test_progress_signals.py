"""A script that reports no steps is judged by what the platform sees on its own (its ranks'
output, CPU use and stack changes, jobs/actions/activity.py), live: real agents, real
processes, the real scheduler loop, with the start-up timeout cut to 8 s so that every job here
outlives it.

A busy but silent script, a chatty but idle one and a quiet one whose stack moves all run to
the end; a script that neither prints nor computes nor moves is declared hung and its stacks
asked for."""

from __future__ import annotations

import pytest

from tests.live import Api, LiveCluster, wait_for

pytestmark = pytest.mark.e2e

TIMEOUT_S = 8


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    live = LiveCluster(
        tmp_path_factory.mktemp("signals"),
        agents=1,
        gpus_per_agent=2,
        env={
            "LOCKSTEP_STARTUP_PROGRESS_TIMEOUT_S": str(TIMEOUT_S),
            "LOCKSTEP_AGENT_STACK_SAMPLE_S": "2",
        },
    )
    try:
        live.start()
        live.alice = Api(live.url, live.token("alice", "--team", "plain", "--quota", "2"))
        wait_for(lambda: live.alice.get("/api/v1/nodes/").json()["results"], 60, "the agent")
        yield live
    finally:
        live.stop()


def _run(cluster, name: str, script: str) -> dict:
    api = cluster.alice
    response = api.post(
        "/api/v1/jobs/",
        {
            "name": name,
            "team": "plain",
            "image": "lockstep/trainer:latest",
            "command": ["python", "-c", script],
            "gpus": 1,
            "max_restarts": 0,
        },
    )
    assert response.status_code == 201, response.text
    job = response.json()["id"]

    def ended():
        cluster.check_alive()
        detail = api.get(f"/api/v1/jobs/{job}/").json()
        return detail if detail["state"] in ("SUCCEEDED", "FAILED", "CANCELLED") else None

    return wait_for(ended, 120, f"job {name} to end")


def test_a_busy_silent_script_runs_past_the_timeout_to_the_end(cluster):
    busy = f"import time\nt = time.time()\nwhile time.time() - t < 3 * {TIMEOUT_S}: pass\n"
    done = _run(cluster, "busy-silent", busy)
    assert done["state"] == "SUCCEEDED", done["reason"]
    assert len(done["attempts"]) == 1


def test_a_chatty_idle_script_runs_past_the_timeout_to_the_end(cluster):
    chatty = (
        f"import time\nfor i in range(3 * {TIMEOUT_S} // 2):\n    print('waiting', i, flush=True)\n"
        "    time.sleep(2)\n"
    )
    done = _run(cluster, "chatty-idle", chatty)
    assert done["state"] == "SUCCEEDED", done["reason"]
    assert len(done["attempts"]) == 1


def test_a_quiet_script_that_moves_runs_past_the_timeout_to_the_end(cluster):
    """No output, no steps, next to no CPU: it waits on I/O in one function, then in another.
    The agent reads its stack from outside every 2 s here (30 s by default), sees it move, and
    the portal counts that as activity."""
    quiet = (
        "import time\n"
        "def read_shard(i):\n    time.sleep(1.5)\n"
        "def wait_for_service(i):\n    time.sleep(1.5)\n"
        f"for i in range({TIMEOUT_S}):\n    read_shard(i)\n    wait_for_service(i)\n"
    )
    done = _run(cluster, "quiet-moving", quiet)
    assert done["state"] == "SUCCEEDED", done["reason"]
    assert len(done["attempts"]) == 1


def test_a_script_that_neither_prints_nor_computes_is_hung(cluster):
    done = _run(cluster, "silent-idle", "import time\ntime.sleep(600)\n")
    assert done["state"] == "FAILED"
    reason = done["attempts"][0]["ended"]["reason"]
    assert "no first step, output or CPU use" in reason, reason
    events = cluster.alice.get(f"/api/v1/jobs/{done['id']}/events/").json()
    assert any(e["kind"] == "attempt.hang_detected" for e in events)
    # Its stacks, read from outside (the script has no SIGUSR1 handler to dump its own).
    failed = next(e for e in events if e["kind"] == "attempt.failed")
    stack = failed["data"]["stacks"]["0"]
    assert "read from outside (py-spy dump)" in stack and "<module>" in stack, stack
