"""Unmodified framework scripts as first-class jobs, live: a PyTorch Lightning DDP script and a
Hugging Face Trainer script (tests/scripts/, nothing of Lockstep in either) each run as a
2-node job on gloo with real agents, the real scheduler and the rq worker.

Each job crashes on purpose after its second save, so what is checked is the whole loop: the
scalars the framework logs to TensorBoard reach the metrics API, the resumed attempt's from
its resume point on; its own
saves are seen and listed with their format; the restart resumes from the latest one the way
the framework looks for it (`ckpt_path="last"`, `get_last_checkpoint(output_dir)`); and a save
registers as a model version whose export is a safetensors file of the model's weights."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from tests.live import Api, LiveCluster, wait_for

pytestmark = pytest.mark.e2e

SCRIPTS = Path(__file__).parent / "scripts"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
SCREENSHOTS = Path(
    os.environ.get("LOCKSTEP_PORTAL_SCREENSHOTS", Path(__file__).parent.parent / "docs/screenshots")
)
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
        live.demo = json.loads(live.manage("seed_demo", "--quota", "2").strip().splitlines()[-1])
        live.alice = Api(live.url, live.demo["alice_token"])
        live.jobs = {}
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
            "team": "demo",
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
    cluster.jobs[framework] = job
    assert done["state"] == "SUCCEEDED", (done["reason"], cluster.logs()[-3000:])
    first, second = done["attempts"][0], done["attempts"][1]
    assert first["state"] == "failed" and len(done["attempts"]) == 2, done["attempts"]
    # Resumed from the latest save before the crash, found where the framework looks.
    assert second["resumed_from_step"] == 20, second

    # Every scalar the framework logged, as series of their own.
    names = api.get(f"/api/v1/jobs/{job}/metrics/names/").json()["names"]
    assert {spec["tag"], spec["other_tag"]} <= set(names), names
    series = api.get(f"/api/v1/jobs/{job}/metrics/", params={"name": spec["tag"]}).json()
    steps = series["ranks"]["0"]["step"]
    assert min(steps) < CRASH_AT < max(steps) and max(steps) >= STEPS - 2, steps
    assert all(isinstance(v, float) for v in series["ranks"]["0"]["value"])

    # The second attempt trained on from step 20: it logs nothing before it.
    resumed = api.get(
        f"/api/v1/jobs/{job}/metrics/", params={"name": spec["tag"], "attempt": 2}
    ).json()
    assert min(resumed["ranks"]["0"]["step"]) >= 20, resumed  # from scratch: 0

    # The framework's own saves, seen with their format: 10 and 20 by the first attempt, 30
    # and 40 by the second (the one it resumed from is not counted twice; started over, it
    # would have saved 10 and 20 again). Retention keeps the last 3 once attempt 1 has ended.
    checkpoints = api.get(f"/api/v1/jobs/{job}/checkpoints/").json()
    first_id, second_id = done["attempts"][0]["id"], done["attempts"][1]["id"]
    steps = {
        n: {c["step"] for c in checkpoints if c["attempt"] == n} for n in (first_id, second_id)
    }
    # Retention runs on the queue worker, after the commits: step 10 may or may not be gone yet.
    assert steps[second_id] == {30, 40} and steps[first_id] in ({20}, {10, 20}), checkpoints
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


@pytest.mark.browser
def test_the_job_page_charts_every_scalar_the_script_logged(cluster):
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian's chromium is not installed (apt-get install chromium); .ci/run does")
    if "hf" not in cluster.jobs:  # run alone: the job the test above would have left
        cluster.jobs["hf"], _ = _run(cluster, "hf-ddp", [*FRAMEWORKS["hf"]["command"]])
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"],
        )
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.set_default_timeout(20_000)
        page.goto(cluster.url + "/login/")
        page.fill("#id_username", "alice")
        page.fill("#id_password", cluster.demo["alice_password"])
        page.click("main button[type=submit]")
        page.wait_for_url(cluster.url + "/")
        page.goto(f"{cluster.url}/jobs/{cluster.jobs['hf']}/")
        # Drawn: every chart has its data (a tag logged once, like train_runtime, has 1 point).
        page.wait_for_function(
            "() => { const c = [...document.querySelectorAll('#scalar-charts .chart')];"
            " return c.length >= 4 && c.every(e => e.data && e.data.length); }"
        )
        charts = page.evaluate(
            "() => [...document.querySelectorAll('#scalar-charts .chart')].map(e => "
            "({series: e.dataset.series, title: e.layout.title.text, points: e.data[0].x.length}))"
        )
        assert page.is_visible("#scalars-title")
        series = {c["series"]: c["points"] for c in charts}
        assert {"train/loss", "train/learning_rate", "train/grad_norm"} <= set(series), charts
        # Every point the metrics API has for the series is drawn.
        api_points = cluster.alice.get(
            f"/api/v1/jobs/{cluster.jobs['hf']}/metrics/", params={"name": "train/loss"}
        ).json()["ranks"]["0"]["step"]
        assert series["train/loss"] == len(api_points) >= 10, (charts, api_points)
        assert all(c["title"] == c["series"] for c in charts)
        page.locator("#scalars-title").scroll_into_view_if_needed()
        page.wait_for_timeout(500)
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOTS / "portal-framework-scalars.png"), full_page=True)
        browser.close()
