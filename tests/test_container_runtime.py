"""Jobs in their own images, with a real engine (podman): a live cluster of two agents whose
runtime is the container one (nodeagent/container.py), and the trainer's image that `make
image` builds (trainer/image/). No fakes: the containers, the rendezvous over the host network,
the checkpoints on disk and the isolation probes are real.

Skipped only where no engine or no image exists, saying so; .ci/run installs podman and builds
the image first, so CI skips none of it."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from nodeagent.container import Engine, agent_identity, run_argv, team_uid
from tests.live import Api, LiveCluster, free_port, wait_for, worker_pids
from tests.registry import serve_local_image

IMAGE = "localhost/lockstep/trainer:latest"
THIRD_PARTY_IMAGE = "localhost/lockstep-test/plain-ddp:1"
ENGINE = Engine.detect("podman")


def _image_present(name: str) -> bool:
    return ENGINE is not None and ENGINE.image_present(name)


pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(ENGINE is None, reason="no working podman on this machine"),
    pytest.mark.skipif(
        not _image_present(IMAGE), reason=f"no {IMAGE}: run `make image` (.ci/run does)"
    ),
]

TRAIN = ["python", "-m", "trainer", "--steps", "3000", "--checkpoint-every", "10"]

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

# Run inside a team's container: everything a rival job would try, each outcome recorded.
PROBE = textwrap.dedent(
    """
    import json, os, signal
    out = {"uid": os.getuid()}
    def attempt(name, fn):
        try:
            out[name] = "allowed: " + repr(fn())[:80]
        except Exception as exc:
            out[name] = "refused: " + type(exc).__name__
    attempt("other_team_checkpoints", lambda: os.listdir(os.environ["OTHER_CKPT"]))
    attempt("agent_token_file", lambda: open(os.environ["TOKEN_FILE"]).read())
    attempt("signal_other_job", lambda: os.kill(int(os.environ["OTHER_PID"]), signal.SIGTERM))
    attempt("signal_agent", lambda: os.kill(int(os.environ["AGENT_PID"]), signal.SIGTERM))
    seen = []
    # Every other process it can see (its own environment holds TOKEN: the test passed it).
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():
            continue
        try:
            seen.append(open(f"/proc/{pid}/cmdline", "rb").read())
            seen.append(open(f"/proc/{pid}/environ", "rb").read())
        except OSError:
            pass
    out["token_visible"] = any(os.environ["TOKEN"].encode() in blob for blob in seen)
    out["token_in_env"] = sum(os.environ["TOKEN"] in v for v in os.environ.values()) > 1
    out["processes_seen"] = len(seen) // 2
    print("PROBE " + json.dumps(out), flush=True)
    """
)


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
    live = LiveCluster(
        tmp_path_factory.mktemp("containers"),
        runtime="podman",
        env={"CONTAINERS_REGISTRIES_CONF": str(registry.conf)},
    )
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
            agent = agent_identity(live.work / "agents" / name)
            for found in ENGINE.containers(agent):
                ENGINE.remove(found["name"])


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


def _build_image(context: Path, tag: str, *, timeout: float) -> None:
    """A test job's own image from `context` (its Containerfile starts FROM the trainer's)."""
    subprocess.run(
        ["podman", "build", "--quiet", "--tag", tag, str(context)],
        check=True,
        capture_output=True,
        timeout=timeout,
    )


def _cancel(api: Api, job: int) -> None:
    api.post(f"/api/v1/jobs/{job}/cancel/")


def test_run_argv_gives_the_container_what_training_needs_and_nothing_more(tmp_path):
    launch = {
        "job_id": 9,
        "team_id": 4,
        "image": IMAGE,
        "checkpoint_dir": str(tmp_path / "ckpt" / "job-9" / "attempt-2"),
        "resume_from": str(tmp_path / "ckpt" / "job-9" / "attempt-1" / "step-000010"),
        "dataset": f"file://{tmp_path}",
        "mounts": [str(tmp_path / "team-data"), str(tmp_path / "not-on-this-node")],
    }
    (tmp_path / "team-data").mkdir()
    argv = run_argv(
        ENGINE,
        node="n1",
        agent="0123456789",
        attempt_id=77,
        launch=launch,
        attempt_dir=tmp_path / "attempt-77",
        spec_path=tmp_path / "attempt-77" / "launch.json",
        gpu_indices=[3, 5],
        gpu_kind="cuda",
        infiniband=True,
    )
    pairs = list(zip(argv, argv[1:], strict=False))
    # InfiniBand: the verbs devices and the one capability RDMA needs back.
    assert ("--device", "/dev/infiniband") in pairs and ("--cap-add", "IPC_LOCK") in pairs
    assert ("--network", "host") in pairs and ("--ipc", "host") in pairs and "--init" in argv
    assert ("--user", f"{team_uid(4)}:{team_uid(4)}") in pairs and team_uid(4) != 0
    assert ("--cap-drop", "all") in pairs
    assert ("--label", "lockstep.attempt=77") in pairs and ("--label", "lockstep.job=9") in pairs
    # Whose it is: another cluster's agent on this machine with a node of the same name (a
    # `make up` beside the suite) has another identity, and never removes this container.
    assert ("--label", "lockstep.agent=0123456789") in pairs
    assert ("--name", "lockstep-n1-0123456789-a77") in pairs
    # Exactly the allocated GPUs, by their CDI names.
    gpus = [b for a, b in pairs if a == "--device" and b.startswith("nvidia.com/")]
    assert gpus == ["nvidia.com/gpu=3", "nvidia.com/gpu=5"]
    volumes = [b for a, b in pairs if a == "--volume"]
    job_dir = tmp_path / "ckpt" / "job-9"
    assert f"{job_dir}:{job_dir}:rw" in volumes  # the job's own saves, earlier attempts included
    assert f"{tmp_path}:{tmp_path}:ro" in volumes  # the dataset, read-only at the same path
    team_data = tmp_path / "team-data"
    assert f"{team_data}:{team_data}:ro" in volumes  # the team's shared storage, read-only
    assert not any("not-on-this-node" in v for v in volumes)  # only what the node has
    assert not any(v.startswith(f"{tmp_path / 'ckpt'}:") for v in volumes)  # not the root
    assert {a for a, _ in pairs if a.startswith("--ulimit")} == {"--ulimit"}
    limits = {b.split("=")[0] for a, b in pairs if a == "--ulimit"}
    assert limits == {"nofile", "memlock", "nproc"}
    assert argv[-4:] == [IMAGE, "python3", "/opt/lockstep-agent/launch.py", str(argv[-1])]


def test_a_two_node_job_trains_in_its_image_loses_a_rank_and_resumes(cluster):
    api = cluster.alice
    job = _submit(api, "ops", TRAIN, gpus=4)
    try:
        running = _saving(
            api,
            job,
            cluster,
            240,
            "the job to train in containers on both nodes and commit a checkpoint",
        )
        (first,) = running["attempts"]
        assert sorted(first["nodes"]) == ["e2e-a", "e2e-b"]
        containers = _containers(f"lockstep.job={job}", cluster)
        assert len(containers) == 2 and {c["Labels"]["lockstep.node"] for c in containers} == {
            "e2e-a",
            "e2e-b",
        }
        # The ranks run as the team's uid, in the container's own PID namespace.
        pids = worker_pids(first["id"])
        assert len(pids) == 4
        uids = {_uid(pid) for pid in pids.values()}
        assert len(uids) == 1 and uids.pop() >= 200_000

        os.kill(pids[3], signal.SIGKILL)  # a rank dies inside its container
        resumed = wait_for(
            lambda: (
                cluster.check_alive()
                or (
                    len((d := _job(api, job))["attempts"]) == 2
                    and d["attempts"][1]["state"] == "running"
                    and d
                )
            ),
            240,
            "the job to restart from its checkpoint",
        )
        second = resumed["attempts"][1]
        assert resumed["restart_count"] == 1
        assert (second.get("resumed_from_step") or 0) > 0, second
        assert "rank 3" in resumed["attempts"][0]["ended"]["reason"], resumed["attempts"][0]
        # The image each attempt ran, by content: the tag may move, the record does not.
        digest = ENGINE.image_digest(IMAGE)
        assert digest.startswith("sha256:") and len(digest) == 71
        assert [a["image_digest"] for a in resumed["attempts"]] == [digest, digest]
        # The restart ran in the job's warm containers, the same two: the ranks were forked
        # by the server inside each, which has torch imported (nodeagent/warm_container.py).
        names = {c["Names"][0] for c in containers}
        assert {c["Names"][0] for c in _containers(f"lockstep.job={job}", cluster)} == names
        pids = worker_pids(second["id"])
        assert len(pids) == 4
        parents = {_ppid(pid) for pid in pids.values()}  # one server per node
        assert len(parents) == 2 and all("launch.py --serve" in _cmdline(p) for p in parents)
        # What /proc shows of a forked rank is the rank, not the server it was forked from.
        assert all("-m trainer" in _cmdline(pid) for pid in pids.values())
    finally:
        _cancel(api, job)


def test_a_hang_inside_a_container_is_detected_with_its_stacks_and_resumes(cluster):
    """The stack-dump signal goes to the container, whose init forwards it to the launcher,
    which forwards it to each rank: the stacks arrive as they do from plain processes, and so
    do the flight recorders."""
    api = cluster.alice
    command = [*TRAIN[:3], "--steps", "60", "--checkpoint-every", "10"]
    job = _submit(api, "ops", [*command, "--fault-stall-at-step", "25"], gpus=4)
    try:
        attempts = wait_for(
            lambda: cluster.check_alive() or (len(a := _job(api, job)["attempts"]) == 2 and a),
            180,
            "the hang to be detected and the job restarted",
        )
        first = attempts[0]
        assert first["state"] == "failed" and "hung: no progress for" in first["ended"]["reason"]
        assert attempts[1]["resumed_from_step"] == 20
        events = api.get(f"/api/v1/jobs/{job}/events/").json()
        failed = next(e for e in events if e["kind"] == "attempt.failed")
        assert "in fault" in failed["data"]["stacks"]["0"], failed["data"]["stacks"].keys()
        # The flight recorders too: each rank's pipe, made inside the container in the mounted
        # attempt directory, answered the agent outside it; rank 0 is the one behind.
        assert set(failed["data"]["flight_recorder"]) == {"0", "1", "2", "3"}, failed["data"]
        assert failed["data"]["odd_rank"] == 0, failed["message"]
        assert "never entered collective #" in failed["message"], failed["message"]
    finally:
        _cancel(api, job)


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


def test_a_rival_teams_job_cannot_reach_checkpoints_the_token_or_other_processes(cluster):
    victim = _submit(cluster.bob, "rivals", TRAIN, gpus=1)
    try:
        running = _saving(
            cluster.bob, victim, cluster, 180, "team rivals' job to save a checkpoint"
        )
        victim_ckpt = Path(cluster.env["LOCKSTEP_CHECKPOINT_ROOT"]) / f"job-{victim}"
        assert any(victim_ckpt.iterdir())
        (victim_pid,) = worker_pids(running["attempts"][0]["id"]).values()
        agent_pid = cluster.procs["agent-e2e-a"].pid
        probe = _submit(
            cluster.alice,
            "ops",
            ["python", "-c", PROBE],
            gpus=1,
            env={
                "OTHER_CKPT": str(victim_ckpt),
                "TOKEN_FILE": str(cluster.agent_token_file),
                "TOKEN": cluster.agent_token,
                "OTHER_PID": str(victim_pid),
                "AGENT_PID": str(agent_pid),
            },
        )
        done = _finish(cluster.alice, probe, cluster)
        line = next((x for x in _logs(cluster.alice, probe).splitlines() if "PROBE " in x), None)
        assert line is not None, (done, _logs(cluster.alice, probe))
        seen = json.loads(line.split("PROBE ", 1)[1])
        assert seen["uid"] == team_uid(_team_id(cluster, "ops")) != 0
        tries = ("other_team_checkpoints", "agent_token_file", "signal_other_job", "signal_agent")
        for what in tries:
            assert seen[what].startswith("refused"), (what, seen)
        assert seen["token_visible"] is False and seen["token_in_env"] is False
        assert seen["processes_seen"] <= 2  # its init and the launcher: no one else's
        assert _job(cluster.bob, victim)["state"] == "RUNNING"  # untouched
    finally:
        _cancel(cluster.bob, victim)


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/status").read_text().split("PPid:")[1].split()[0])


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()


def _uid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/status").read_text().split("Uid:")[1].split()[0])


def _team_id(cluster, name: str) -> int:
    out = cluster.manage(
        "shell", "-c", f"from teams.models import Team; print(Team.objects.get(name='{name}').id)"
    )
    return int(out.strip().splitlines()[-1])


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


def test_a_frozen_agent_declared_lost_removes_its_container_when_it_thaws(cluster):
    """An agent frozen past the heartbeat timeout (6 s here): its node is down, the attempt
    lost, the job restarted on the other node from its checkpoint. Thawed, the agent hears
    the attempt is no longer desired and removes its container before it could train beside
    the attempt that replaced it."""
    api = cluster.alice
    job = _submit(api, "ops", TRAIN, gpus=2)
    frozen = None
    try:
        running = _saving(api, job, cluster, 180, "a 2-GPU job on one node with a checkpoint")
        (node,) = running["attempts"][0]["nodes"]
        first = running["attempts"][0]["id"]
        frozen = cluster.procs[f"agent-{node}"]
        os.kill(frozen.pid, signal.SIGSTOP)
        resumed = wait_for(
            lambda: (
                len((d := _job(api, job))["attempts"]) == 2
                and d["attempts"][1]["state"] == "running"
                and d
            ),
            120,
            "the job to restart on the other node",
        )
        assert resumed["attempts"][0]["state"] == "lost"
        assert resumed["attempts"][1]["nodes"] != [node]
        assert (resumed["attempts"][1]["resumed_from_step"] or 0) > 0
        # Still frozen: its container trains on (a zombie), which is what fencing is for.
        assert [c["State"] for c in _containers(f"lockstep.attempt={first}", cluster)] == [
            "running"
        ]
        os.kill(frozen.pid, signal.SIGCONT)
        frozen = None
        wait_for(
            lambda: not _containers(f"lockstep.attempt={first}", cluster),
            60,
            "the thawed agent to remove the lost attempt's container",
        )
        assert not worker_pids(first)
        assert _job(api, job)["state"] == "RUNNING"
    finally:
        if frozen is not None:
            os.kill(frozen.pid, signal.SIGCONT)
        _cancel(api, job)


def test_an_agent_that_comes_back_removes_its_stale_containers_first(cluster):
    """Last: it kills and restarts an agent. SIGKILL leaves the agent's container running (its
    engine client is in a session of its own); the agent started again removes it before it
    registers, and the portal, which had given the GPUs away, gets them back clean."""
    api = cluster.alice
    job = _submit(api, "ops", TRAIN, gpus=2)
    try:
        running = wait_for(
            lambda: cluster.check_alive() or ((d := _job(api, job))["state"] == "RUNNING" and d),
            180,
            "a 2-GPU job on one node",
        )
        (node,) = running["attempts"][0]["nodes"]
        attempt_id = running["attempts"][0]["id"]
        agent = cluster.procs.pop(f"agent-{node}")
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait(timeout=10)
        time.sleep(1)
        assert [c["State"] for c in _containers(f"lockstep.attempt={attempt_id}", cluster)] == [
            "running"
        ]
        cluster.start_agent(node)
        wait_for(
            lambda: not _containers(f"lockstep.attempt={attempt_id}", cluster),
            60,
            "the restarted agent to remove its stale container",
        )
        log_path = cluster.work / f"agent-{node}.log"

        def registered_after_the_removal():
            log = log_path.read_text()
            removed_at = log.find("removed stale container")
            return removed_at >= 0 and log.find("registered with", removed_at) > removed_at

        # Before anything else: the removal, then the registration.
        wait_for(registered_after_the_removal, 60, "the restarted agent to register")
        assert not worker_pids(attempt_id)
    finally:
        _cancel(api, job)


def test_no_engine_means_no_container_runtime_and_the_agent_says_so(tmp_path):
    from nodeagent.agent import AgentFatal, pick_engine

    assert pick_engine("process") is None
    env_path = os.environ["PATH"]
    try:
        os.environ["PATH"] = str(tmp_path)  # no podman, no docker
        assert shutil.which("podman") is None
        assert pick_engine("auto") is None
        with pytest.raises(AgentFatal, match="no working container engine"):
            pick_engine("podman")
    finally:
        os.environ["PATH"] = env_path


def test_make_up_runs_the_demo_in_its_image_and_its_stop_leaves_no_container(tmp_path):
    """`lockstep up` where podman and the trainer's image are (as `make up` leaves them): the
    banner says the jobs are isolated, the demo job trains in one container per agent, and
    one Ctrl-C leaves neither a process nor a container behind."""
    from tests.test_up import Up, _demo_job, _nodes, _stop

    # The suite's agents run plain processes by default (tests/conftest.py); up decides here.
    up = Up(tmp_path / "var", free_port(), env={"LOCKSTEP_AGENT_RUNTIME": ""})
    agents = [agent_identity(tmp_path / "var" / "agents" / n) for n in ("local-a", "local-b")]
    try:
        api = up.wait_up()
        assert "jobs run in their own images (podman containers, isolated)" in up.output
        assert {n["runtime"] for n in _nodes(up, api).values()} == {"container"}
        wait_for(lambda: _demo_job(up, api)["state"] == "RUNNING", 120, "the demo job to run")
        running = [c for agent in agents for c in _containers(f"lockstep.agent={agent}")]
        assert len(running) == 2 and {c["State"] for c in running} == {"running"}
        _stop(up)
        assert not [c for agent in agents for c in _containers(f"lockstep.agent={agent}")]
    finally:
        if up.proc.poll() is None:
            os.killpg(up.proc.pid, signal.SIGKILL)
        for agent in agents:
            for found in ENGINE.containers(agent):
                ENGINE.remove(found["name"])
