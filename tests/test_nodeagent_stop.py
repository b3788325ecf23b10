"""Node agent: stopping workers, and what is reported of a rank's end.

A kill takes the worker's children too; a stop is SIGTERM (the worker checkpoints) and SIGKILL
at its deadline; a new agent kills the workers a dead one left; a rank's exit is timed when it
died, not when the agent got round to it. The agent does the same for the portal's `stop`
action and for its own planned stop (SIGTERM to `python -m nodeagent`, telling the portal the
node is leaving). Everything here runs real processes; the shared helpers are in
tests/nodeagent_helpers.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.nodeagent_helpers import (
    CLUSTER_TOKEN,
    SLEEPER,
    WRITE_HELPER,
    agent_env,
    clean_env_fixture,  # noqa: F401 (fixture)
    launch_spec,
    one_rank,
    portal_fixture,  # noqa: F401 (fixture)
    process_alive,
    read_pids,
    run_item,
    running_agent_fixture,  # noqa: F401 (fixture)
    supervisor_factory_fixture,  # noqa: F401 (fixture)
    wait_launched,
    wait_until,
)

pytestmark = pytest.mark.timeout(60)


def test_kill_takes_down_the_worker_and_its_children(supervisor_factory):
    sup = supervisor_factory()
    attempt = sup.launch(7, launch_spec(SLEEPER, one_rank()))
    worker_pid, child_pid = read_pids(attempt.workers[0].metrics_path)
    sup.poll()
    assert sup.status(7)[0]["state"] == "running"
    assert os.getsid(worker_pid) == worker_pid
    assert os.getpgid(child_pid) == worker_pid  # the grandchild shares the worker's group

    sup.kill(7)
    assert sup.wait(7, timeout_s=10)
    assert sup.status(7)[0]["exit_code"] == -signal.SIGKILL
    wait_until(lambda: not process_alive(child_pid), what="the grandchild to die")


def test_a_rank_that_dies_while_the_agent_is_busy_keeps_its_real_exit_time(supervisor_factory):
    """The agent's loop may wait seconds on a busy portal before it reaps again; the exit time
    it reports decides which rank a failed gang blames, so it is the death's, not the reap's."""
    sup = supervisor_factory()
    attempt = sup.launch(9, launch_spec(SLEEPER, one_rank()))
    worker_pid, _ = read_pids(attempt.workers[0].metrics_path)
    sup.poll()
    killed_at = time.time()
    os.kill(worker_pid, signal.SIGKILL)  # from outside: the OOM killer, say
    time.sleep(2.0)  # the loop is blocked on a heartbeat
    sup.poll()
    (status,) = sup.status(9)
    assert status["exit_code"] == -signal.SIGKILL
    assert status["exited_at"] - killed_at < 0.5, status["exited_at"] - killed_at


TRAPS_SIGTERM = (
    WRITE_HELPER
    + """
import os, signal, sys, time
base = os.environ["LOCKSTEP_METRICS_PATH"]
def on_term(signum, frame):
    publish(base + ".checkpointed", "step 12")
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
publish(base + ".ready", "")
while True:
    time.sleep(0.02)
"""
)


IGNORES_SIGTERM = (
    WRITE_HELPER
    + """
import os, signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
publish(os.environ["LOCKSTEP_METRICS_PATH"] + ".ready", "")
while True:
    time.sleep(0.02)
"""
)


def _wait_ready(attempt) -> None:
    for worker in attempt.workers:
        ready = Path(str(worker.metrics_path) + ".ready")
        wait_until(ready.exists, what="the worker to install its SIGTERM handler")


def test_stop_lets_a_worker_checkpoint_and_exit_cleanly(supervisor_factory):
    sup = supervisor_factory()
    attempt = sup.launch(8, launch_spec(TRAPS_SIGTERM, one_rank()))
    _wait_ready(attempt)
    sup.stop(8, deadline_s=20)
    assert sup.wait(8, timeout_s=10)
    assert sup.status(8)[0]["exit_code"] == 0
    assert Path(str(attempt.workers[0].metrics_path) + ".checkpointed").read_text() == "step 12"


def test_stop_sigkills_a_worker_that_ignores_sigterm_after_the_deadline(supervisor_factory):
    sup = supervisor_factory()
    attempt = sup.launch(9, launch_spec(IGNORES_SIGTERM, one_rank()))
    _wait_ready(attempt)
    started = time.monotonic()
    sup.stop(9, deadline_s=0.5)
    sup.stop(9, deadline_s=30)  # heartbeats repeat the stop; the first deadline holds
    time.sleep(0.2)
    sup.poll()
    assert sup.status(9)[0]["state"] == "running"  # SIGTERM alone did nothing
    assert sup.wait(9, timeout_s=10)
    assert time.monotonic() - started >= 0.5
    assert sup.status(9)[0]["exit_code"] == -9


def test_a_new_supervisor_kills_workers_orphaned_by_a_dead_agent(supervisor_factory):
    first = supervisor_factory()
    attempt = first.launch(10, launch_spec(SLEEPER, one_rank()))
    worker_pid, child_pid = read_pids(attempt.workers[0].metrics_path)
    # The first agent process "dies": its workers live on in their own sessions.
    second = supervisor_factory()
    assert second.reap_orphans() == 1
    assert first.wait(10, timeout_s=10)  # reaped by the parent that is still our test process
    wait_until(lambda: not process_alive(child_pid), what="the orphan's child to die")
    assert not process_alive(worker_pid)


# -- the agent -------------------------------------------------------------------------------


def test_agent_stop_action_sends_sigterm_and_reports_a_clean_exit(portal, running_agent):
    portal.set_desired([run_item(41, launch_spec(TRAPS_SIGTERM, one_rank()))])
    _wait_ready(wait_launched(running_agent, 41))
    portal.set_desired([{"attempt_id": 41, "action": "stop", "deadline_s": 20.0}])
    done = wait_until(
        lambda: [a for a in portal.attempt_in_beats(41) if a["ranks"][0]["state"] == "exited"],
        what="a clean exit",
    )
    assert done[0]["ranks"][0]["exit_code"] == 0


# -- the agent's own planned stop (python -m nodeagent) --------------------------------------


def _cli_agent(portal, clean_env, tmp_path, name, *extra):
    stderr_path = tmp_path / "agent.stderr"
    with open(stderr_path, "w") as stderr:
        agent = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "nodeagent",
                "--portal",
                portal.url,
                "--token",
                CLUSTER_TOKEN,
                "--gpus",
                "1",
                "--name",
                name,
                "--gpu-kind",
                "cpu",
                *extra,
            ],
            cwd=tmp_path,
            env=agent_env(clean_env),
            stderr=stderr,
            stdout=subprocess.DEVNULL,
        )
    return agent, stderr_path


def test_cli_agent_on_sigterm_stops_its_workers_says_it_is_leaving_and_exits_0(
    portal, clean_env, tmp_path
):
    """A planned stop: the workers get the checkpoint-and-stop signal (SIGTERM), the portal
    hears the node is leaving and then the workers' exits, and the agent exits 0."""
    portal.set_desired([run_item(71, launch_spec(TRAPS_SIGTERM, one_rank()))])
    agent, stderr_path = _cli_agent(portal, clean_env, tmp_path, "node-cli")
    try:
        metrics = tmp_path / "var/agents/node-cli/attempt-71/rank-0.metrics.jsonl"
        wait_until(Path(str(metrics) + ".ready").exists, what="the worker's SIGTERM handler")
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=20) == 0
    finally:
        if agent.poll() is None:
            agent.kill()
    # It checkpointed (its SIGTERM handler ran) and exited 0, and the portal heard both.
    assert Path(str(metrics) + ".checkpointed").read_text() == "step 12"
    (leaving,) = portal.leaving
    assert leaving["reason"] == "SIGTERM" and leaving["boot_id"] == portal.boot_id
    assert 0 < leaving["grace_s"] <= 30
    exits = [a["ranks"][0] for a in portal.attempt_in_beats(71) if a["ranks"][0]["exit_code"] == 0]
    assert exits and exits[0]["state"] == "exited"
    log = stderr_path.read_text()
    assert "[node-cli]" in log
    assert "told the portal this node is leaving" in log
    assert "agent stopping (SIGTERM): killed 0 worker(s); exiting with 0" in log


def test_cli_agent_second_signal_kills_its_workers_at_once(portal, clean_env, tmp_path):
    portal.set_desired([run_item(72, launch_spec(IGNORES_SIGTERM, one_rank()))])
    agent, stderr_path = _cli_agent(
        portal, clean_env, tmp_path, "node-cli2", "--leave-timeout-s", "120"
    )
    try:
        metrics = tmp_path / "var/agents/node-cli2/attempt-72/rank-0.metrics.jsonl"
        wait_until(Path(str(metrics) + ".ready").exists, what="the worker's SIGTERM handler")
        agent.send_signal(signal.SIGINT)
        wait_until(lambda: portal.leaving, what="the agent to say it is leaving")
        time.sleep(0.5)
        assert agent.poll() is None  # waiting for a worker that ignores SIGTERM
        started = time.monotonic()
        agent.send_signal(signal.SIGINT)
        assert agent.wait(timeout=20) == 0
        assert time.monotonic() - started < 10
    finally:
        if agent.poll() is None:
            agent.kill()
    assert "exiting with 0" in stderr_path.read_text()
    (pids,) = [a["ranks"][0]["pid"] for a in portal.attempt_in_beats(72)][:1]
    assert not process_alive(pids)


def test_cli_agent_leave_deadline_kills_a_worker_that_ignores_the_stop(portal, clean_env, tmp_path):
    portal.set_desired([run_item(73, launch_spec(IGNORES_SIGTERM, one_rank()))])
    agent, stderr_path = _cli_agent(
        portal, clean_env, tmp_path, "node-cli3", "--leave-timeout-s", "2"
    )
    try:
        metrics = tmp_path / "var/agents/node-cli3/attempt-73/rank-0.metrics.jsonl"
        wait_until(Path(str(metrics) + ".ready").exists, what="the worker's SIGTERM handler")
        started = time.monotonic()
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=20) == 0
        assert time.monotonic() - started < 10
    finally:
        if agent.poll() is None:
            agent.kill()
    assert portal.leaving
    # The kill at the deadline is reported before the agent goes.
    killed = [a["ranks"][0] for a in portal.attempt_in_beats(73) if a["ranks"][0]["exit_code"]]
    assert killed and killed[-1]["exit_code"] == -signal.SIGKILL
    assert "exiting with 0" in stderr_path.read_text()
