"""Jobs in their own images, with a real engine (podman): what a job's container is given
(`run_argv`: the team's uid, no capabilities, the host network, exactly its GPUs, its own
checkpoints read-write and its data read-only), what a rival team's job in one cannot reach
(the isolation probe, on a live cluster of two agents whose runtime is the container one), which
engine an agent picks, and `lockstep up` running its demo in containers. The image is the
trainer's that `make image` builds (trainer/image/). No fakes: the containers, the rendezvous
over the host network, the checkpoints on disk and the isolation probes are real.

Beside this file: tests/test_container_runtime_images.py (pulls, a private registry, a job's
own image) and tests/test_container_runtime_recovery.py (a lost rank, a hang, a frozen or a
killed agent); what they share is in tests/container_runtime_helpers.py.

Skipped only where no engine or no image exists, saying so; .ci/run installs podman and builds
the image first, so CI skips none of it."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import textwrap
from pathlib import Path

import pytest

from nodeagent.container import LABEL, agent_identity, run_argv, team_uid
from tests.container_runtime_helpers import (
    CONTAINER_MARKS,
    ENGINE,
    IMAGE,
    TRAIN,
    _cancel,
    _containers,
    _finish,
    _job,
    _logs,
    _saving,
    _submit,
    cluster_fixture,  # noqa: F401 (fixture)
)
from tests.live import free_port, wait_for, worker_pids

pytestmark = CONTAINER_MARKS

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


def _team_id(cluster, name: str) -> int:
    out = cluster.manage(
        "shell", "-c", f"from teams.models import Team; print(Team.objects.get(name='{name}').id)"
    )
    return int(out.strip().splitlines()[-1])


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


@contextlib.contextmanager
def _exited_container(agent: str, name: str):
    """An exited container of `agent` (no --rm, so it stays listed until someone removes it),
    as an attempt's can be for a moment; gone afterwards whatever the test did."""
    labels = ["--label", f"lockstep.agent={agent}", "--label", f"{LABEL}=1"]
    done = ENGINE._run(["run", "--name", name, *labels, IMAGE, "true"])
    assert done.returncode == 0, done.stderr
    try:
        assert [c["name"] for c in ENGINE.containers(agent)] == [name]
        yield
    finally:
        ENGINE.remove(name)


def test_an_agent_that_closes_leaves_none_of_its_containers_listed(tmp_path):
    """A container whose process has ended is removed by the engine (`--rm`) only after it
    ends, asynchronously: an agent that exited at once left it listed, and `make up`'s stop
    was not "nothing left behind" under load. Closing the supervisor removes what is listed."""
    from nodeagent.supervisor import WorkerSupervisor

    work = tmp_path / "closing"
    sup = WorkerSupervisor(work, engine=ENGINE, node="closing")
    agent = agent_identity(work)
    with _exited_container(agent, f"lockstep-closing-{agent}"):
        sup.close()
        assert ENGINE.containers(agent) == []


def test_make_ups_stop_removes_the_containers_an_agent_killed_in_its_stop_left(tmp_path):
    """An agent that overran its stop's grace is killed before it removes its containers; the
    stop then removes whatever this run's agents left listed."""
    from portal.up import _remove_agent_containers

    work = tmp_path / "var" / "agents" / "local-a"
    work.mkdir(parents=True)
    agent = agent_identity(work)
    with _exited_container(agent, f"lockstep-left-{agent}"):
        assert _remove_agent_containers(tmp_path / "var", ["local-a", "local-b"]) == 1
        assert ENGINE.containers(agent) == []
        assert _remove_agent_containers(tmp_path / "var", ["local-a"]) == 0
