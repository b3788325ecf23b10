"""End to end, with real processes and sockets (tests/e2e_helpers.py): a 4-GPU job submitted
over REST trains across both agents; a worker is SIGKILLed; the job restarts from its checkpoint
and succeeds; its checkpoint becomes a model version. Websocket clients see its metrics live, and
another team's user sees nothing. A user's own DDP script with the helpers does the same.
Failures and recoveries of the platform itself: tests/test_e2e_faults.py."""

import json
import os
import signal
import time
from pathlib import Path

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from tests.e2e_helpers import e2e_cluster, submit_job
from tests.live import Api, submit_training, wait_for, worker_pids

pytestmark = pytest.mark.e2e


TRAIN = [
    "python",
    "-m",
    "trainer",
    "--steps",
    "240",
    "--checkpoint-every",
    "20",
    "--log-every",
    "20",
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from e2e_cluster(tmp_path_factory)


@pytest.fixture(scope="module")
def job(cluster):
    job_id = submit_training(cluster.alice, "e2e-addition", "e2e", TRAIN)

    def training():
        cluster.check_alive()
        detail = cluster.alice.get(f"/api/v1/jobs/{job_id}/").json()
        return detail["state"] == "RUNNING" and detail["attempts"][0]["last_step"] > 0

    wait_for(training, 180, "the job to run and make its first steps")
    return job_id


def _ws(cluster, job_id, api: Api):
    url = cluster.url.replace("http", "ws") + f"/ws/jobs/{job_id}/"
    return connect(
        url,
        additional_headers={"Authorization": api.session.headers["Authorization"]},
        open_timeout=10,
    )


def test_gang_spans_both_agents_with_the_launch_contract(cluster, job):
    detail = cluster.alice.get(f"/api/v1/jobs/{job}/").json()
    (attempt,) = detail["attempts"]
    assert sorted(attempt["nodes"]) == ["e2e-a", "e2e-b"]
    assert attempt["resumed_from_step"] == 0
    assert sorted(a["rank"] for a in detail["allocation"]) == [0, 1, 2, 3]
    pids = wait_for(
        lambda: len(worker_pids(attempt["id"])) == 4 and worker_pids(attempt["id"]),
        30,
        "four worker processes",
    )
    for rank, pid in pids.items():
        env = dict(
            item.split("=", 1)
            for item in Path(f"/proc/{pid}/environ").read_text().split("\0")
            if "=" in item
        )
        assert env["WORLD_SIZE"] == "4" and env["RANK"] == str(rank)
        assert env["LOCAL_WORLD_SIZE"] == "2" and env["LOCAL_RANK"] == str(rank % 2)
        assert env["GROUP_RANK"] == str(rank // 2)
        assert env["LOCKSTEP_JOB_ID"] == str(job) and env["LOCKSTEP_ATTEMPT"] == "1"
        assert env["TORCHELASTIC_RUN_ID"] == f"job{job}-attempt1"
        assert env["LOCKSTEP_CHECKPOINT_DIR"].endswith(f"job-{job}/attempt-1")
        assert os.getsid(pid) == pid, "each worker runs in its own session"
        assert env["LOCKSTEP_LAYOUT"] == "auto"  # the job's layout setting (the default)


def test_the_reference_trainer_runs_the_planners_layout_and_reports_it(cluster, job):
    """Layout auto, live: every rank reports the layout it runs (the planner's choice for 4
    ranks on two 2-GPU nodes), the prediction and what it holds; the attempt carries them."""

    def reported():
        layout = cluster.alice.get(f"/api/v1/jobs/{job}/").json()["attempts"][0]["layout"]
        return layout if layout.get("ranks") == 4 and layout.get("chosen") else None

    layout = wait_for(reported, 60, "the four ranks' layout records")
    chosen = layout["chosen"]
    assert chosen["how"] == "auto"
    assert chosen["pp"] * chosen["dp"] * chosen["tp"] == 4
    assert chosen["predicted_time"]["total_s"] > 0
    assert layout["measured_max"]["weights"] > 0
    events = cluster.alice.get(f"/api/v1/jobs/{job}/events/").json()
    assert any(e["kind"] == "attempt.layout" and "layout (auto)" in e["message"] for e in events)


def test_websocket_client_receives_metrics_while_the_job_trains(cluster, job):
    with _ws(cluster, job, cluster.alice) as ws:
        first = json.loads(ws.recv(timeout=10))
        assert first["type"] == "state" and first["job"] == job
        # Generous: on a loaded 2-core CI machine four trainers take a while to import torch.
        deadline = time.monotonic() + 90
        metrics = []

        def rank0_steps():
            return [p["step"] for m in metrics for p in m["points"] if p["rank"] == 0]

        # Each agent's heartbeat is a message of its own, and a slow host can put a single
        # step of rank 0 in the first few: read until rank 0 has moved on by a step.
        while time.monotonic() < deadline and len(set(rank0_steps())) < 2:
            message = json.loads(ws.recv(timeout=max(deadline - time.monotonic(), 0.1)))
            if message["type"] == "metrics":
                metrics.append(message)
    names = {p["name"] for m in metrics for p in m["points"]}
    assert {"loss", "tokens_per_s", "step_time_s"} <= names
    steps = rank0_steps()
    assert steps and steps == sorted(steps) and steps[-1] > steps[0], steps


def test_another_teams_user_gets_404_for_the_job_its_metrics_and_its_websocket(cluster, job):
    for path in (f"/api/v1/jobs/{job}/", f"/api/v1/jobs/{job}/metrics/?name=loss"):
        assert cluster.mallory.get(path).status_code == 404
    for api, job_id in ((cluster.mallory, job), (cluster.alice, 10**9)):
        with _ws(cluster, job_id, api) as ws, pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=10)
        assert closed.value.rcvd.code == 4404


def test_sigkilled_worker_restarts_from_checkpoint_succeeds_and_registers(cluster, job):
    api = cluster.alice
    checkpoint = wait_for(
        lambda: api.get(f"/api/v1/jobs/{job}/checkpoints/").json(), 120, "a committed checkpoint"
    )[0]
    assert checkpoint["step"] > 0
    attempt_id = api.get(f"/api/v1/jobs/{job}/").json()["attempts"][0]["id"]
    victim = worker_pids(attempt_id)[3]
    os.kill(victim, signal.SIGKILL)

    def restarted():
        cluster.check_alive()
        attempts = api.get(f"/api/v1/jobs/{job}/").json()["attempts"]
        return len(attempts) == 2 and attempts[1]["state"] == "running" and attempts

    attempts = wait_for(restarted, 120, "the second attempt to run")
    assert attempts[0]["state"] == "failed"
    assert "rank 3" in attempts[0]["ended"]["reason"]
    assert "signal 9" in attempts[0]["ended"]["reason"]
    resumed = attempts[1]["resumed_from_step"]
    assert resumed >= checkpoint["step"] > 0

    def finished():
        cluster.check_alive()
        state = api.get(f"/api/v1/jobs/{job}/").json()["state"]
        assert state not in ("FAILED", "CANCELLED"), cluster.logs()
        return state == "SUCCEEDED"

    wait_for(finished, 300, "the job to succeed")
    final = api.get(f"/api/v1/jobs/{job}/").json()["attempts"]
    history = "; ".join(f"#{a['number']} {a['state']}: {a['ended']}" for a in final)
    assert len(final) == 2, f"one restart, not more: {history}\n{cluster.logs()}"
    second = api.get(
        f"/api/v1/jobs/{job}/metrics/?name=loss&rank=0&attempt=2&max_points=100000"
    ).json()
    steps = second["ranks"]["0"]["step"]
    assert steps[0] == resumed + 1, "steps continue from the checkpoint, not from 0"
    assert steps[-1] == 240 and steps == sorted(set(steps))
    kinds = [e["kind"] for e in api.get(f"/api/v1/jobs/{job}/events/").json()]
    for kind in (
        "job.submitted",
        "attempt.started",
        "attempt.running",
        "rank.exited",
        "attempt.failed",
        "job.restarting",
        "job.requeued",
        "checkpoint.committed",
        "attempt.succeeded",
        "job.succeeded",
    ):
        assert kind in kinds, kind

    latest = api.get(f"/api/v1/jobs/{job}/").json()["latest_checkpoint"]
    assert latest["step"] == 240
    response = api.post(
        "/api/v1/models/", {"name": "adder", "checkpoint": latest["id"], "notes": "e2e"}
    )
    assert response.status_code == 201, response.text
    version = response.json()
    assert (version["version"], version["step"], version["lineage"]["job"]) == (1, 240, job)
    assert (
        cluster.mallory.post(
            "/api/v1/models/", {"name": "stolen", "checkpoint": latest["id"]}
        ).status_code
        == 400
    )
    exported = wait_for(
        lambda: (
            (v := api.get(f"/api/v1/models/{version['id']}/").json())["export_state"] != "pending"
            and v
        ),
        120,
        "the export",
    )
    assert exported["export_state"] == "ready", exported
    import torch

    state = torch.load(exported["export_path"], weights_only=False)
    keys = list(_keys(state))
    assert any("weight" in key for key in keys), keys[:20]


def _keys(tree, prefix=""):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _keys(value, f"{prefix}{key}.")
    else:
        yield prefix


def test_a_torchrun_style_script_joins_metrics_checkpoints_and_resume_with_the_helpers(cluster):
    """trainer/examples/ddp_script.py, a plain DDP script plus trainer.report / should_stop /
    checkpoint / resume_from: its loss reaches the portal, its saves are registered, and
    after a worker is SIGKILLed the next attempt resumes from the latest one."""
    api = cluster.alice
    job_id = submit_job(
        api,
        "user-script",
        [
            "python",
            "-m",
            "trainer.examples.ddp_script",
            "--steps",
            "300",
            "--step-sleep",
            "0.05",
            "--checkpoint-every",
            "20",
        ],
        gpus=2,
    )
    checkpoint = wait_for(
        lambda: cluster.check_alive() or api.get(f"/api/v1/jobs/{job_id}/checkpoints/").json(),
        240,
        "the script's first committed checkpoint",
    )[0]
    assert checkpoint["step"] > 0 and checkpoint["step"] % 20 == 0
    attempt_id = api.get(f"/api/v1/jobs/{job_id}/").json()["attempts"][0]["id"]
    os.kill(worker_pids(attempt_id)[1], signal.SIGKILL)

    def finished():
        cluster.check_alive()
        state = api.get(f"/api/v1/jobs/{job_id}/").json()["state"]
        if state in ("FAILED", "CANCELLED"):
            lines = api.get(f"/api/v1/jobs/{job_id}/logs/", params={"attempt": 2}).json()
            raise AssertionError("\n".join(lines["lines"][-40:]) + "\n" + cluster.logs())
        return state == "SUCCEEDED"

    wait_for(finished, 300, "the script's job to succeed")
    attempts = api.get(f"/api/v1/jobs/{job_id}/").json()["attempts"]
    assert [a["state"] for a in attempts] == ["failed", "succeeded"], attempts
    assert attempts[1]["total_steps"] == 300  # trainer.set_total_steps: the run's length
    resumed = attempts[1]["resumed_from_step"]
    assert resumed >= checkpoint["step"]
    loss = api.get(
        f"/api/v1/jobs/{job_id}/metrics/?name=loss&rank=0&attempt=2&max_points=100000"
    ).json()["ranks"]["0"]
    assert loss["step"][0] == resumed + 1 and loss["step"][-1] == 300
    assert all(value is not None and value >= 0 for value in loss["value"])
