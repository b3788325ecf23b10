"""What the container-runtime tests (tests/test_container_runtime*.py) share: the trainer's
image and the engine, a live cluster of two agents whose runtime is the container one
(nodeagent/container.py), and what a test does with it: submit a job, wait for its end or its
first checkpoint, read its logs, list its containers.

`cluster` is named for pytest with `name=` and module scope (one cluster per test file): a test
file imports `cluster_fixture` and its tests ask for `cluster` as usual. The images' tests
(tests/test_container_runtime_images.py) define their own `cluster`, whose engine may use their
private registry."""

from __future__ import annotations

import json
import subprocess

import pytest

from nodeagent.container import Engine, agent_identity
from tests.live import Api, LiveCluster, wait_for

IMAGE = "localhost/lockstep/trainer:latest"
ENGINE = Engine.detect("podman")


def _image_present(name: str) -> bool:
    return ENGINE is not None and ENGINE.image_present(name)


# Every container test file's marks: end to end, and skipped (saying why) only where this
# machine has no engine or no image; .ci/run installs podman and builds the image first.
CONTAINER_MARKS = [
    pytest.mark.e2e,
    pytest.mark.skipif(ENGINE is None, reason="no working podman on this machine"),
    pytest.mark.skipif(
        not _image_present(IMAGE), reason=f"no {IMAGE}: run `make image` (.ci/run does)"
    ),
]


TRAIN = ["python", "-m", "trainer", "--steps", "3000", "--checkpoint-every", "10"]


def live_cluster(tmp_path_factory, env: dict[str, str] | None = None):
    """Started: two agents on the container runtime, alice (team ops) and bob (team rivals)
    as API clients; stopped after, with every container its agents left removed."""
    live = LiveCluster(tmp_path_factory.mktemp("containers"), runtime="podman", env=env)
    try:
        live.start()
        live.alice = Api(live.url, live.token("alice", "--team", "ops", "--quota", "4"))
        live.bob = Api(live.url, live.token("bob", "--team", "rivals", "--quota", "4"))
        wait_for(
            lambda: (
                [n["runtime"] for n in live.alice.get("/api/v1/nodes/").json()["results"]]
                == ["container", "container"]
            ),
            90,
            "both agents to register with the container runtime",
        )
        yield live
    finally:
        live.stop()
        for name in live.agent_names:
            ENGINE.remove_all(agent_identity(live.work / "agents" / name))


@pytest.fixture(name="cluster", scope="module")
def cluster_fixture(tmp_path_factory):
    yield from live_cluster(tmp_path_factory)


def _submit(
    api: Api, team: str, command: list[str], *, gpus: int, image=IMAGE, env=None, pull=None
) -> int:
    response = api.post(
        "/api/v1/jobs/",
        {
            "name": "in-a-container",
            "team": team,
            "image": image,
            "image_pull_policy": pull or "if-not-present",
            "command": command,
            "dataset": "synthetic://addition",
            "gpus": gpus,
            "max_restarts": 2,
            "env": env or {},
        },
    )
    assert response.status_code == 201, response.text
    return response.json()["id"]


def _job(api: Api, job: int) -> dict:
    return api.get(f"/api/v1/jobs/{job}/").json()


def _containers(label: str, cluster=None) -> list[dict]:
    """Containers with the label; with `cluster`, only its agents' (job and attempt ids start
    at 1 in every test cluster, and another's containers may still be up)."""
    done = subprocess.run(
        ["podman", "ps", "--all", "--filter", f"label={label}", "--format", "json"],
        capture_output=True,
        text=True,
        check=True,
    )
    found = json.loads(done.stdout or "[]")
    if cluster is not None:
        agents = {agent_identity(cluster.work / "agents" / n) for n in cluster.agent_names}
        found = [c for c in found if c["Labels"].get("lockstep.agent") in agents]
    return found


def _logs(api: Api, job: int, ranks=(0,)) -> str:
    text = []
    for rank in ranks:
        answer = api.get(f"/api/v1/jobs/{job}/logs/", params={"rank": rank, "tail": 1000}).json()
        text += [*answer["lines"], answer["partial"]]
    return "\n".join(text)


def _finish(api: Api, job: int, cluster, timeout=240) -> dict:
    last = {}

    def ended():
        cluster.check_alive()
        detail = last["detail"] = _job(api, job)
        return detail if detail["state"] in ("SUCCEEDED", "FAILED", "CANCELLED") else None

    try:
        return wait_for(ended, timeout, f"job {job} to end")
    except AssertionError as exc:
        # Say where it stuck (queued behind what, which attempt, which ranks) and what the
        # agents saw: a timeout alone leaves nothing to go on.
        raise AssertionError(f"{exc}\nlast detail: {last.get('detail')}\n{cluster.logs()}") from exc


def _saving(api: Api, job: int, cluster, timeout: float, what: str) -> dict:
    """The job's detail once it runs and has committed a checkpoint."""

    def saved():
        cluster.check_alive()
        detail = _job(api, job)
        running = detail["state"] == "RUNNING"
        return running and api.get(f"/api/v1/jobs/{job}/checkpoints/").json() and detail

    return wait_for(saved, timeout, what)


def _cancel(api: Api, job: int) -> None:
    api.post(f"/api/v1/jobs/{job}/cancel/")
