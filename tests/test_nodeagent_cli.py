"""Node agent: its command line, `python -m nodeagent`.

What it refuses (no token, no GPUs, a token the portal rejects, a bad node env file or a token
file others can read) and how it waits for a portal it cannot reach. Its planned stop on
SIGTERM is in tests/test_nodeagent_stop.py; the shared helpers are in
tests/nodeagent_helpers.py.
"""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from tests.nodeagent_helpers import (
    agent_env,
    clean_env_fixture,  # noqa: F401 (fixture)
    portal_fixture,  # noqa: F401 (fixture)
    wait_until,
)

pytestmark = pytest.mark.timeout(60)


def test_cli_without_a_token_exits_2_with_a_clear_message(clean_env, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "nodeagent", "--gpus", "1"],
        cwd=tmp_path,
        env=agent_env(clean_env),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert "LOCKSTEP_AGENT_TOKEN" in proc.stderr


def test_cli_rejects_zero_gpus(clean_env, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "nodeagent", "--gpus", "0", "--token", "t"],
        cwd=tmp_path,
        env=agent_env(clean_env),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert "--gpus" in proc.stderr


def test_cli_agent_waits_for_an_unreachable_portal_and_says_so(clean_env, tmp_path):
    stderr_path = tmp_path / "agent.stderr"
    with open(stderr_path, "w") as stderr:
        agent = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "nodeagent",
                "--portal",
                "http://127.0.0.1:9",
                "--token",
                "t",
                "--gpus",
                "1",
                "--name",
                "node-x",
                "--gpu-kind",
                "cpu",
            ],
            cwd=tmp_path,
            env=agent_env(clean_env),
            stderr=stderr,
            stdout=subprocess.DEVNULL,
        )
    try:
        wait_until(lambda: "retrying in" in stderr_path.read_text(), what="a retry message")
        agent.send_signal(signal.SIGINT)
        assert agent.wait(timeout=20) == 0
    finally:
        if agent.poll() is None:
            agent.kill()
    assert "cannot reach http://127.0.0.1:9" in stderr_path.read_text()


def test_cli_agent_exits_1_when_the_portal_rejects_its_token(portal, clean_env, tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "nodeagent",
            "--portal",
            portal.url,
            "--token",
            "wrong",
            "--gpus",
            "1",
            "--name",
            "node-y",
            "--gpu-kind",
            "cpu",
        ],
        cwd=tmp_path,
        env=agent_env(clean_env),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 1
    assert "rejected the cluster agent token" in proc.stderr


def test_the_agent_cli_refuses_a_bad_node_env_file_with_its_line(tmp_path, clean_env):
    env_file = tmp_path / "node.env"
    env_file.write_text("MASTER_PORT=1\n")
    token = tmp_path / "token"
    token.write_text("t")
    token.chmod(0o600)
    proc = subprocess.run(
        [sys.executable, "-m", "nodeagent", "--gpus", "1", "--token-file", str(token)]
        + ["--node-env-file", str(env_file)],
        cwd=tmp_path,
        env=agent_env(clean_env),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "MASTER_PORT is set by the launch contract" in proc.stderr
    token.chmod(0o644)
    env_file.write_text("")
    proc = subprocess.run(
        [sys.executable, "-m", "nodeagent", "--gpus", "1", "--token-file", str(token)],
        cwd=tmp_path,
        env=agent_env(clean_env),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "readable by others: chmod 600" in proc.stderr


def test_a_second_agent_on_a_work_dir_in_use_exits_3_and_leaves_the_first_alone(
    clean_env, tmp_path
):
    """Two agents on one work dir share an identity: the second's start-up would remove the
    first's containers as stale and take turns with it at the node's registration (what a
    second `make up` did). The second says who holds the work dir and exits 3 before it
    touches anything; once the first is gone, however it went, an agent starts there."""
    work_dir = tmp_path / "work"

    def agent(name: str, stderr_path):
        with open(stderr_path, "w") as stderr:
            return subprocess.Popen(
                [sys.executable, "-m", "nodeagent", "--portal", "http://127.0.0.1:9"]
                + ["--token", "t", "--gpus", "1", "--gpu-kind", "cpu", "--name", name]
                + ["--work-dir", str(work_dir), "--runtime", "process"],
                cwd=tmp_path,
                env=agent_env(clean_env),
                stderr=stderr,
                stdout=subprocess.DEVNULL,
            )

    first = agent("node-x", tmp_path / "first.stderr")
    later = []
    try:
        wait_until(
            lambda: "retrying in" in (tmp_path / "first.stderr").read_text(),
            what="the first agent to start",
        )
        second = agent("node-y", tmp_path / "second.stderr")
        later.append(second)
        assert second.wait(timeout=30) == 3
        said = (tmp_path / "second.stderr").read_text()
        assert f"another agent (the agent of node-x, pid {first.pid}" in said, said
        assert str(work_dir) in said and "--work-dir" in said
        assert "agent starting" not in said  # it stopped before its start-up sweep
        assert first.poll() is None
        # SIGKILL leaves no lock behind: the kernel drops it with its holder.
        first.kill()
        first.wait(timeout=10)
        third = agent("node-x", tmp_path / "third.stderr")
        later.append(third)
        wait_until(
            lambda: "retrying in" in (tmp_path / "third.stderr").read_text(),
            what="an agent to start on the freed work dir",
        )
        third.send_signal(signal.SIGINT)
        assert third.wait(timeout=20) == 0
    finally:
        for proc in [first, *later]:
            if proc.poll() is None:
                proc.kill()
