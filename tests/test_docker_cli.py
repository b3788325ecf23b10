"""The container runtime through Docker's CLI (nodeagent/container.py, `Engine("docker")`).

No Docker daemon runs on these machines, but the Docker CLI does, and podman serves Docker's
API (`podman system service`): the agent's docker commands go through the real `docker` binary
and its real API over a unix socket, to an engine that runs real containers. What differs
between the two CLIs (ps's label template, rm's flags, the pull's credential, image labels,
attach) is exercised here; the engine underneath is podman's, so Docker's own daemon
behaviour (its runc and cgroup set-up, `--gpus`) is not.

Skipped only where the docker CLI, podman or the trainer's image is missing, saying so;
.ci/run provides all three."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from nodeagent.container import Engine, agent_identity
from nodeagent.supervisor import WorkerSupervisor
from tests.registry import serve_local_image
from tests.test_warm_container import _finish, _gang, _launch, _names, _port, _records, _running

IMAGE = "localhost/lockstep/trainer:latest"
PODMAN = Engine.detect("podman")
DOCKER_CLI = shutil.which("docker")
USER, PASSWORD = "ci-bot", "docker-cli-secret"

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(DOCKER_CLI is None, reason="no docker CLI on this machine"),
    pytest.mark.skipif(PODMAN is None, reason="no working podman to serve Docker's API"),
    pytest.mark.skipif(
        PODMAN is None or not PODMAN.image_present(IMAGE),
        reason=f"no {IMAGE}: run `make image` (.ci/run does)",
    ),
]


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    work = tmp_path_factory.mktemp("docker-registry")
    served = serve_local_image(work, IMAGE, "lab/docker-trainer", USER, PASSWORD)
    yield served
    served.stop()
    subprocess.run(["podman", "rmi", served.image], capture_output=True, timeout=120)


@pytest.fixture(scope="module")
def docker(tmp_path_factory, registry):
    """Engine("docker") talking to podman's Docker API on a socket of the test's own."""
    socket_path = tmp_path_factory.mktemp("docker-api") / "docker.sock"
    service = subprocess.Popen(
        ["podman", "system", "service", "--time=0", f"unix://{socket_path}"],
        env={**os.environ, "CONTAINERS_REGISTRIES_CONF": str(registry.conf)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    before = os.environ.get("DOCKER_HOST")
    os.environ["DOCKER_HOST"] = f"unix://{socket_path}"
    try:
        engine = Engine("docker", DOCKER_CLI)
        deadline = time.monotonic() + 30
        while not engine.works():
            assert service.poll() is None, "podman system service exited"
            assert time.monotonic() < deadline, "Docker's API did not answer on the socket"
            time.sleep(0.2)
        assert Engine.detect("docker") == engine  # the CLI with a daemon (API) behind it
        yield engine
    finally:
        if before is None:
            os.environ.pop("DOCKER_HOST", None)
        else:
            os.environ["DOCKER_HOST"] = before
        service.terminate()
        service.wait(timeout=30)


def test_a_two_node_job_runs_restarts_warm_and_is_fenced_through_dockers_cli(docker, tmp_path):
    agents = [
        WorkerSupervisor(tmp_path / f"d{i}", engine=docker, node=f"dk{i}", warm_start=True)
        for i in (0, 1)
    ]
    try:
        ckpt = tmp_path / "ckpt" / "job-1"
        first = _gang(agents, 1, ckpt / "attempt-1", steps=3)
        _finish(agents, first)
        assert all(a.image_digest == docker.image_digest(IMAGE) for a in first)
        names = _names(agents)
        assert len(names) == 2 and all(_running(n) for n in names)
        resume = str(ckpt / "attempt-1" / "step-000003")
        second = _gang(agents, 2, ckpt / "attempt-2", steps=5, resume=resume)
        _finish(agents, second)
        assert _names(agents) == names  # the restart was forked in the same containers
        assert all(_records(w)[0]["resumed_from_step"] == 3 for a in second for w in a.workers)
        # What fencing reads: the containers of this agent, by their attempt label.
        found = docker.containers(agent_identity(agents[0].work_dir))
        assert [f["attempt"] for f in found] == ["1"]
        # An agent that starts on the same work dir removes them before anything else
        # (docker's `rm --force`: it has no podman's --time).
        again = WorkerSupervisor(agents[0].work_dir, engine=docker, node="dk0")
        assert again.remove_stale_containers() == 1
        assert not docker.containers(agent_identity(agents[0].work_dir))
    finally:
        for agent in agents:
            agent.kill_all()
            agent.close()
    assert not any(_running(n) for n in names)


def test_a_private_image_is_pulled_through_dockers_cli_with_the_credential_only(
    docker, registry, tmp_path
):
    agent = WorkerSupervisor(tmp_path / "pull", engine=docker, node="dkpull", gpu_kind="cpu")
    single = {"world_size": 2, "group_world_size": 1, "job_gpus": 2, "image": registry.image}

    def attempt(attempt_id: int, auth: dict | None):
        launch = {
            **_launch(tmp_path / "ck" / f"attempt-{attempt_id}", 1, 2, 0, _port()),
            **single,
            "image_pull_policy": "always",
            **({"registry_auth": auth} if auth else {}),
        }
        return agent.launch(attempt_id, launch)

    try:
        refused = attempt(1, None)
        assert agent.wait(1, 120)
        assert refused.error and "cannot pull image" in refused.error["message"]
        assert {w.exit_code for w in refused.workers} == {125}

        pulled = attempt(2, {"registry": registry.host, "username": USER, "password": PASSWORD})
        assert agent.wait(2, 300)
        assert [w.exit_code for w in pulled.workers] == [0, 0], pulled.error
        manifest = json.loads(registry._blob(registry.manifest_digest).read_text())
        assert pulled.image_digest == manifest["config"]["digest"]
        assert ("GET", f"/v2/{registry.repository}/manifests/1", 200) in registry.requests
        # The credential lived in the pull's own directory, gone with the pull.
        auth_dir = Path(tmp_path / "pull" / "registry-auth")
        assert not auth_dir.exists() or not list(auth_dir.iterdir())
    finally:
        agent.kill_all()
        agent.close()
