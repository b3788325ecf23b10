"""A job's image, on a live cluster whose agents run jobs in containers (podman): an image the
node cannot get fails the job at once; a private one is pulled with its team's credential only,
from a registry of the test's own (tests/registry.py), and each attempt records the image it
ran; an unmodified DDP script baked into an image of its own runs as a two-node job, and the
scalars a script writes with TensorBoard inside its container reach the API.

Skipped only where no engine or no image exists, saying so; .ci/run installs podman and builds
the image first, so CI skips none of it."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.container_runtime_helpers import (
    CONTAINER_MARKS,
    IMAGE,
    TRAIN,
    _finish,
    _logs,
    _submit,
    live_cluster,
)
from tests.live import wait_for
from tests.registry import serve_local_image

pytestmark = CONTAINER_MARKS

THIRD_PARTY_IMAGE = "localhost/lockstep-test/plain-ddp:1"

# A plain torchrun-style DDP script, no Lockstep in it: baked into an image of its own.
PLAIN_DDP = textwrap.dedent(
    """
    import os, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(20):
        loss = model(torch.ones(4, 8)).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    print(f"plain-ddp rank {dist.get_rank()}/{dist.get_world_size()} uid {os.getuid()} "
          f"sum {total.item():.0f}", flush=True)
    dist.destroy_process_group()
    """
)

# A script that logs with TensorBoard's SummaryWriter at its default place (./runs/<run>/
# under its working directory, inside its container) and nothing else of Lockstep.
SUMMARY_WRITER = textwrap.dedent(
    """
    import time, torch.distributed as dist
    from torch.utils.tensorboard import SummaryWriter
    dist.init_process_group("gloo")
    writer = SummaryWriter() if dist.get_rank() == 0 else None
    for step in range(1, 21):
        if writer:
            writer.add_scalar("custom/objective", 1.0 / step, step)
            writer.flush()
        time.sleep(0.75)  # the agent looks for new files every 5 s
    dist.barrier()
    print(f"summary-writer rank {dist.get_rank()} done", flush=True)
    dist.destroy_process_group()
    """
)
SCALARS_IMAGE = "localhost/lockstep-test/summary-writer:1"


REGISTRY_USER, REGISTRY_PASSWORD = "puller", "registry-secret-9f3a"


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    """A private registry serving the trainer's image as `lab/trainer:1`, behind basic auth."""
    work = tmp_path_factory.mktemp("registry")
    served = serve_local_image(work, IMAGE, "lab/trainer", REGISTRY_USER, REGISTRY_PASSWORD)
    yield served
    served.stop()
    # Only the tag: its layers are the trainer image's.
    subprocess.run(["podman", "rmi", served.image], capture_output=True, timeout=120)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, registry):
    # The agents' engine may use the test registry over plain HTTP (and only it).
    yield from live_cluster(
        tmp_path_factory, env={"CONTAINERS_REGISTRIES_CONF": str(registry.conf)}
    )


def _build_image(context: Path, tag: str, *, timeout: float) -> None:
    """A test job's own image from `context` (its Containerfile starts FROM the trainer's)."""
    subprocess.run(
        ["podman", "build", "--quiet", "--tag", tag, str(context)],
        check=True,
        capture_output=True,
        timeout=timeout,
    )


@pytest.mark.parametrize(
    ("image", "pull", "message"),
    [
        # Not on the node: pulled in the background, from a registry that is not there.
        ("localhost/lockstep-test/no-such-image:1", "if-not-present", "cannot pull image"),
        # On the node, but the job asks for a fresh pull every start.
        (IMAGE, "always", "cannot pull image"),
        ("localhost/lockstep-test/no-such-image:1", "never", "its pull policy is never"),
    ],
)
def test_an_image_the_node_cannot_get_fails_the_job_at_once(cluster, image, pull, message):
    api = cluster.alice
    job = _submit(api, "ops", TRAIN, gpus=1, image=image, pull=pull)
    done = _finish(api, job, cluster, timeout=120)
    assert done["state"] == "FAILED"
    assert "image error" in done["reason"] and message in done["reason"], done["reason"]
    assert "not restarted" in done["reason"]
    assert done["restart_count"] == 0 and len(done["attempts"]) == 1
    kinds = [e["kind"] for e in api.get(f"/api/v1/jobs/{job}/events/").json()]
    assert ("attempt.image_pull" in kinds) == (pull != "never"), kinds


def test_a_private_image_is_pulled_with_the_teams_credential_only_and_its_id_recorded(
    cluster, registry
):
    api = cluster.alice
    quick = ["python", "-m", "trainer", "--steps", "20", "--checkpoint-every", "10"]
    # Without the team's credential the registry refuses: the job fails at once, no restart.
    refused = _submit(api, "ops", quick, gpus=1, image=registry.image, pull="always")
    done = _finish(api, refused, cluster, timeout=180)
    assert done["state"] == "FAILED" and "cannot pull image" in done["reason"], done["reason"]
    assert done["restart_count"] == 0
    assert any(status == 401 for _, _, status in registry.requests)
    assert not any(
        path.endswith("/manifests/1") and code == 200 for _, path, code in registry.requests
    )

    # An admin sets the team's credential (the console's and the API's action).
    cluster.manage(
        "shell",
        "-c",
        "from teams.actions import do_set_registry_credential; "
        "from teams.models import Team; "
        f"do_set_registry_credential(Team.objects.get(name='ops'), registry={registry.host!r}, "
        f"username={REGISTRY_USER!r}, secret={REGISTRY_PASSWORD!r}, actor=None)",
    )
    pulled = _submit(api, "ops", quick, gpus=1, image=registry.image, pull="always")
    done = _finish(api, pulled, cluster, timeout=300)
    assert done["state"] == "SUCCEEDED", done["reason"]
    manifest = json.loads(registry._blob(registry.manifest_digest).read_text())
    (attempt,) = done["attempts"]
    assert attempt["image_digest"] == manifest["config"]["digest"]  # the image it ran
    assert attempt["pull_s"] is not None and attempt["pull_s"] >= 0
    assert ("GET", "/v2/lab/trainer/manifests/1", 200) in registry.requests
    # A pull that ends between two heartbeats has no "pulling" event; its time is in the
    # image's.
    events = api.get(f"/api/v1/jobs/{pulled}/events/").json()
    image = next(e for e in events if e["kind"] == "attempt.image")
    assert image["data"] == {"digest": attempt["image_digest"], "pull_s": attempt["pull_s"]}
    # The credential was the pull's only: its auth file is gone, nothing the job wrote or
    # logged holds it, and the API never shows it.
    for name in cluster.agent_names:
        auth_dir = cluster.work / "agents" / name / "registry-auth"
        assert not auth_dir.exists() or not list(auth_dir.iterdir())
    assert REGISTRY_PASSWORD not in _logs(api, pulled)
    assert REGISTRY_PASSWORD not in json.dumps(done)


def test_an_unmodified_plain_ddp_script_baked_into_an_image_runs_as_a_two_node_job(
    cluster, tmp_path
):
    context = tmp_path / "image"
    context.mkdir()
    (context / "train.py").write_text(PLAIN_DDP)
    (context / "Containerfile").write_text(f"FROM {IMAGE}\nCOPY train.py /app/train.py\n")
    _build_image(context, THIRD_PARTY_IMAGE, timeout=300)
    try:
        job = _submit(
            cluster.alice, "ops", ["python", "/app/train.py"], gpus=4, image=THIRD_PARTY_IMAGE
        )
        done = _finish(cluster.alice, job, cluster, timeout=240)
        assert done["state"] == "SUCCEEDED", (done, cluster.logs())
        # Every rank exited on its own. A rank forked from the warm container once froze
        # after its last line, one run in three (the zygote freed the script's DDP model
        # with the GIL held: tests/test_zygote.py), and the hang-at-exit rule ended the
        # attempt 60 s later; succeeded, but not by the script's own exit.
        assert done["attempts"][0]["ended"]["reason"] == "all ranks exited 0", done
        assert sorted(done["attempts"][0]["nodes"]) == ["e2e-a", "e2e-b"]
        logs = _logs(cluster.alice, job, ranks=range(4))
        assert logs.count("plain-ddp rank") == 4 and "/4 uid 2" in logs and "sum 6" in logs
    finally:
        subprocess.run(["podman", "rmi", "--force", THIRD_PARTY_IMAGE], capture_output=True)


def test_scalars_a_script_writes_with_tensorboard_inside_its_container_reach_the_api(
    cluster, tmp_path
):
    """issue 19, item 5 in a container: the agent finds the event file through the rank's
    working directory (/proc/<pid>/cwd reaches into the container) and reads it with
    TensorBoard's reader. TensorBoard is installed in the job's own image (from the host's
    wheels: nothing is downloaded), not in the trainer's."""
    context = tmp_path / "image"
    (context / "wheels").mkdir(parents=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(context / "wheels"),
         f"tensorboard=={importlib.metadata.version('tensorboard')}"],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (context / "train.py").write_text(SUMMARY_WRITER)
    (context / "Containerfile").write_text(
        f"FROM {IMAGE}\n"
        "RUN --mount=type=bind,source=wheels,target=/tmp/wheels /opt/venv/bin/pip install "
        "--no-index --find-links /tmp/wheels --no-cache-dir tensorboard\n"
        "COPY train.py /app/train.py\n"
    )
    _build_image(context, SCALARS_IMAGE, timeout=600)
    try:
        job = _submit(cluster.alice, "ops", ["python", "/app/train.py"], gpus=2,
                      image=SCALARS_IMAGE)  # fmt: skip
        done = _finish(cluster.alice, job, cluster, timeout=240)
        assert done["state"] == "SUCCEEDED", (done, cluster.logs())
        assert "summary-writer rank 1 done" in _logs(cluster.alice, job, ranks=(1,))

        def all_points():
            series = cluster.alice.get(
                f"/api/v1/jobs/{job}/metrics/", params={"name": "custom/objective"}
            ).json()["ranks"]
            rank0 = series.get("0") or {"step": []}
            return len(rank0["step"]) == 20 and rank0

        rank0 = wait_for(all_points, 60, "the script's 20 scalars on the metrics API")
        assert rank0["step"] == list(range(1, 21))
        assert rank0["value"] == pytest.approx([1.0 / s for s in range(1, 21)], rel=1e-6)
        names = cluster.alice.get(f"/api/v1/jobs/{job}/metrics/names/").json()["names"]
        assert "custom/objective" in names
    finally:
        subprocess.run(["podman", "rmi", "--force", SCALARS_IMAGE], capture_output=True)
