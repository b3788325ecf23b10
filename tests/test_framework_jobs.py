"""Unmodified framework scripts as first-class jobs, live: a PyTorch Lightning DDP script and a
Hugging Face Trainer script (tests/scripts/, nothing of Lockstep in either) each run as a
2-node job on gloo with real agents, the real scheduler and the rq worker.

Each job crashes on purpose after its second save, so what is checked is the whole loop: the
scalars the framework logs to TensorBoard reach the metrics API from both attempts; its own
saves are seen and listed with their format; the restart resumes from the latest one the way
the framework looks for it (`ckpt_path="last"`, `get_last_checkpoint(output_dir)`); and a save
registers as a model version whose export is a safetensors file of the model's weights."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.live import Api, LiveCluster, wait_for

pytestmark = pytest.mark.e2e

SCRIPTS = Path(__file__).parent / "scripts"
STEPS, EVERY, CRASH_AT = 40, 10, 25

FRAMEWORKS = {
    "lightning": {
        "command": [
            sys.executable,
            str(SCRIPTS / "lightning_ddp.py"),
            "--root",
            "$(LOCKSTEP_CHECKPOINT_DIR)",
            "--num-nodes",
            "2",
        ],
        "tag": "train_loss",
        "other_tag": "weight_norm",
    },
    "hf": {
        "command": [
            sys.executable,
            str(SCRIPTS / "hf_trainer.py"),
            "--output_dir",
            "$(LOCKSTEP_CHECKPOINT_DIR)",
        ],
        "tag": "train/loss",
        "other_tag": "train/learning_rate",
    },
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    live = LiveCluster(tmp_path_factory.mktemp("frameworks"), agents=2, gpus_per_agent=1)
    try:
        live.start()
        live.alice = Api(live.url, live.token("alice", "--team", "labs", "--quota", "2"))
        wait_for(lambda: len(live.alice.get("/api/v1/nodes/").json()["results"]) == 2, 60, "agents")
        yield live
    finally:
        live.stop()


def _run(cluster, name: str, command: list[str]) -> tuple[int, dict]:
    api = cluster.alice
    response = api.post(
        "/api/v1/jobs/",
        {
            "name": name,
            "team": "labs",
            "image": "lockstep/trainer:latest",
            "command": command,
            "gpus": 2,
            "max_restarts": 2,
        },
    )
    assert response.status_code == 201, response.text
    job = response.json()["id"]

    def ended():
        cluster.check_alive()
        detail = api.get(f"/api/v1/jobs/{job}/").json()
        return detail if detail["state"] in ("SUCCEEDED", "FAILED", "CANCELLED") else None

    return job, wait_for(ended, 240, f"job {name} to end")


@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
def test_an_unmodified_framework_script_is_a_first_class_job(cluster, framework):
    spec = FRAMEWORKS[framework]
    command = [
        *spec["command"],
        *("--steps", str(STEPS), "--every", str(EVERY), "--crash-at", str(CRASH_AT)),
    ]
    api = cluster.alice
    job, done = _run(cluster, f"{framework}-ddp", command)
    assert done["state"] == "SUCCEEDED", (done["reason"], cluster.logs()[-3000:])
    first, second = done["attempts"][0], done["attempts"][1]
    assert first["state"] == "failed" and len(done["attempts"]) == 2, done["attempts"]
    # Resumed from the latest save before the crash, found where the framework looks.
    assert second["resumed_from_step"] == 20, second

    # Every scalar the framework logged, as series of their own, from both attempts.
    names = api.get(f"/api/v1/jobs/{job}/metrics/names/").json()["names"]
    assert {spec["tag"], spec["other_tag"]} <= set(names), names
    series = api.get(f"/api/v1/jobs/{job}/metrics/", params={"name": spec["tag"]}).json()
    steps = series["ranks"]["0"]["step"]
    assert min(steps) < CRASH_AT < max(steps) and max(steps) >= STEPS - 2, steps
    assert all(isinstance(v, float) for v in series["ranks"]["0"]["value"])

    # The framework's own saves, seen with their format: 10 and 20 by the first attempt, 30
    # and 40 by the second (the one it resumed from is not counted twice).
    checkpoints = api.get(f"/api/v1/jobs/{job}/checkpoints/").json()
    assert sorted(c["step"] for c in checkpoints) == [10, 20, 30, 40], checkpoints
    assert {c["format"] for c in checkpoints} == {framework}

    latest = max(checkpoints, key=lambda c: c["step"])
    response = api.post("/api/v1/models/", {"name": f"{framework}-reg", "checkpoint": latest["id"]})
    assert response.status_code == 201, response.text
    version = response.json()
    exported = wait_for(
        lambda: (
            (v := api.get(f"/api/v1/models/{version['id']}/").json())["export_state"] != "pending"
            and v
        ),
        120,
        "the export",
    )
    assert exported["export_state"] == "ready", exported
    assert exported["export_path"].endswith("model.safetensors")
    from safetensors.torch import load_file

    weights = load_file(exported["export_path"])
    assert set(weights) == {"net.weight", "net.bias"}, sorted(weights)
    assert tuple(weights["net.weight"].shape) == (1, 8)
