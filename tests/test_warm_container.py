"""Warm containers (nodeagent/warm_container.py) with the real engine: a job's container on a
node outlives its attempt, and the next attempt of the same job there is forked inside it.

Two WorkerSupervisors play the agents of a 2-node job (as bench/warm_start.py does): real
podman containers of the trainer's image, real torch ranks rendezvousing over TCP with gloo.
Skipped only where no engine or no image exists, saying so (.ci/run provides both)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from nodeagent.container import Engine
from nodeagent.supervisor import WorkerSupervisor

IMAGE = "localhost/lockstep/trainer:latest"
ENGINE = Engine.detect("podman")

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(ENGINE is None, reason="no working podman on this machine"),
    pytest.mark.skipif(
        ENGINE is None or not ENGINE.image_present(IMAGE),
        reason=f"no {IMAGE}: run `make image` (.ci/run does)",
    ),
]

TRAIN = ["python", "-m", "trainer", "--log-every", "1", "--checkpoint-every", "0"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(
    ckpt: Path, job: int, steps: int, node: int, port: int, gpus=(0, 1), resume: str = ""
) -> dict:
    return {
        "job_id": job,
        "team_id": 1,
        "image": IMAGE,
        "attempt": 1,
        "command": [*TRAIN, "--steps", str(steps)],
        "env": {},
        "world_size": 4,
        "job_gpus": 4,
        "local_world_size": 2,
        "group_rank": node,
        "group_world_size": 2,
        "master_addr": "127.0.0.1",
        "master_port": port,
        "run_id": f"warm-{job}",
        "restart_count": 0,
        "max_restarts": 3,
        "checkpoint_dir": str(ckpt),
        "resume_from": resume,
        "dataset": "synthetic://addition",
        "ranks": [
            {"rank": node * 2 + i, "local_rank": i, "gpu_index": gpu} for i, gpu in enumerate(gpus)
        ],
    }


def _gang(agents, attempt_id: int, ckpt: Path, job: int = 1, steps: int = 4, **kwargs):
    port = _port()
    return [
        agent.launch(attempt_id, _launch(ckpt, job, steps, node, port, **kwargs))
        for node, agent in enumerate(agents)
    ]


def _finish(agents, attempts) -> list[int]:
    for agent, attempt in zip(agents, attempts, strict=True):
        assert agent.wait(attempt.attempt_id, 240), f"attempt {attempt.attempt_id} did not end"
    codes = [w.exit_code for a in attempts for w in a.workers]
    if codes != [0] * len(codes):
        logs = {w.rank: w.log_path.read_text()[-800:] for a in attempts for w in a.workers}
        raise AssertionError(f"exit codes {codes}: {logs}")
    return codes


def _names(agents) -> set[str]:
    return {w.container.name for agent in agents for w in agent._warm.warm}


def _gone_within(seconds: float, *names: str) -> None:
    """The containers are removed within `seconds`: their removal runs off the agent's loop
    (nodeagent/engine_calls.py), so it is done once that call returns, not at the poll."""
    deadline = time.monotonic() + seconds
    while any(_running(n) for n in names) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(_running(n) for n in names), names


def _running(name: str) -> bool:
    done = subprocess.run(
        ["podman", "ps", "--filter", f"name=^{name}$", "--format", "{{.Names}}"],
        capture_output=True,
        text=True,
        check=False,
    )
    return name in done.stdout.split()


@pytest.fixture
def agents(tmp_path):
    made = [
        WorkerSupervisor(
            tmp_path / f"agent{i}", engine=ENGINE, node=f"warm{i}", warm_start=True, gpu_kind="cpu"
        )
        for i in (0, 1)
    ]
    yield made
    for agent in made:
        agent.kill_all()
        agent.close()


def _records(worker) -> list[dict]:
    text = worker.metrics_path.read_text() if worker.metrics_path.exists() else ""
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_a_restart_on_the_same_node_is_forked_in_the_jobs_warm_container(agents, tmp_path):
    ckpt = tmp_path / "ckpt" / "job-1"
    _finish(agents, first := _gang(agents, 1, ckpt / "attempt-1", steps=3))
    names = _names(agents)
    assert len(names) == 2 and all(_running(n) for n in names)  # still up, idle
    serve_dirs = {a.dir.parent for a in first}
    state = [json.loads((d / "warm.json").read_text()) for d in serve_dirs]
    assert {s["state"] for s in state} == {"idle"} and all(s["forking"] for s in state)
    assert all("trainer.train" in s["preloaded"] for s in state)  # the image's label

    resume = str(ckpt / "attempt-1" / "step-000003")
    second = _gang(agents, 2, ckpt / "attempt-2", steps=6, resume=resume)
    _finish(agents, second)
    assert _names(agents) == names  # no new container: the same two served the restart
    for worker in (w for a in second for w in a.workers):
        records = _records(worker)
        start = next(r for r in records if r["kind"] == "start")
        assert start["resumed_from_step"] == 3, start
        assert [r["step"] for r in records if r["kind"] == "step"][-1] == 6


def test_a_stop_reaches_the_forked_ranks_and_one_before_they_start_ends_them_unstarted(
    agents, tmp_path
):
    ckpt = tmp_path / "ckpt" / "job-1"
    _finish(agents, _gang(agents, 1, ckpt / "attempt-1", steps=2))
    # A long attempt, stopped once it trains: SIGTERM is a checkpoint-first stop.
    long = _gang(agents, 2, ckpt / "attempt-2", steps=100_000)
    deadline = time.monotonic() + 120
    while not all(any(r["kind"] == "step" for r in _records(w)) for a in long for w in a.workers):
        assert time.monotonic() < deadline, "the forked ranks never stepped"
        for agent in agents:
            agent.poll()
        time.sleep(0.2)
    # The launcher inside reads each rank's CPU use for the heartbeat (a progress signal).
    for agent, attempt in zip(agents, long, strict=True):
        deadline = time.monotonic() + 10
        while not all((r.get("cpu_s") or 0) > 0.5 for r in agent.status(attempt.attempt_id)):
            assert time.monotonic() < deadline, agent.status(attempt.attempt_id)
            time.sleep(0.2)
    # Stacks read from outside the container (py-spy on the ranks' host pids), beside the
    # trainer's own faulthandler dump.
    agent, attempt = agents[0], long[0]
    agent.dump_stacks(attempt.attempt_id)
    deadline = time.monotonic() + 20
    while not agent.dump_settled(attempt.attempt_id):
        assert time.monotonic() < deadline, "py-spy did not finish"
        time.sleep(0.2)
    for worker in attempt.workers:
        log = worker.log_path.read_text()
        assert f"stacks of rank {worker.rank}, read from outside (py-spy dump)" in log
        assert "trainer/train.py" in log.split("read from outside")[1], log[-1500:]
    for agent, attempt in zip(agents, long, strict=True):
        agent.stop(attempt.attempt_id, deadline_s=60)
    for agent, attempt in zip(agents, long, strict=True):
        assert agent.wait(attempt.attempt_id, 90)
    assert not any(a.killed for a in long)  # they stopped on their own, before the deadline
    assert sorted(p.name for p in (ckpt / "attempt-2").iterdir() if p.name.startswith("step-"))
    # A stop sent before the server took the attempt up: its ranks never start. (Another
    # job, so a new container whose server is still importing when the stop arrives; an idle
    # server takes a request up within 50 ms, and the stop would race the start.)
    early = _gang(agents, 3, tmp_path / "ckpt" / "job-2" / "attempt-3", job=2, steps=100_000)
    for agent, attempt in zip(agents, early, strict=True):
        agent.stop(attempt.attempt_id, deadline_s=60)
    for agent, attempt in zip(agents, early, strict=True):
        assert agent.wait(attempt.attempt_id, 30)
    assert {w.exit_code for a in early for w in a.workers} == {-signal.SIGTERM}
    assert not any(_records(w) for a in early for w in a.workers)


def test_a_killed_attempt_dies_inside_and_its_container_serves_the_restart(agents, tmp_path):
    """Fencing (a rank failed elsewhere in the gang) kills the attempt's ranks, not the
    container: the restart on this node is still warm."""
    ckpt = tmp_path / "ckpt" / "job-1"
    running = _gang(agents, 1, ckpt / "attempt-1", steps=100_000)
    names = _names(agents)
    deadline = time.monotonic() + 120
    while not all(_records(w) for a in running for w in a.workers):
        assert time.monotonic() < deadline, "the ranks never started"
        time.sleep(0.2)
    for agent, attempt in zip(agents, running, strict=True):
        agent.kill(attempt.attempt_id)
        assert agent.wait(attempt.attempt_id, 10)
    assert [w.exit_code for w in running[0].workers] == [-signal.SIGKILL] * 2
    # The other node's ranks may have died of their peers' deaths first (gloo: exit 1).
    assert {w.exit_code for w in running[1].workers} <= {-signal.SIGKILL, 1}
    assert all(_running(n) for n in names)
    _finish(agents, _gang(agents, 2, ckpt / "attempt-2", steps=2))
    assert _names(agents) == names


def test_other_gpus_another_job_or_idleness_retire_a_warm_container(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCKSTEP_WARM_CONTAINER_IDLE_S", "3")
    agent = WorkerSupervisor(tmp_path / "solo", engine=ENGINE, node="solo", warm_start=True)
    try:
        single = {"world_size": 2, "group_world_size": 1, "job_gpus": 2}

        def run(attempt_id: int, job: int, gpus) -> str:
            launch = {**_launch(tmp_path / f"ck{job}" / f"attempt-{attempt_id}", job, 2, 0,
                                _port(), gpus=gpus), **single}  # fmt: skip
            attempt = agent.launch(attempt_id, launch)
            _finish([agent], [attempt])
            return attempt.container.name

        first = run(1, 1, (0, 1))
        assert run(2, 1, (0, 1)) == first  # same job, same GPUs: reused
        moved = run(3, 1, (2, 3))  # same job on other GPUs: a container of its own
        assert moved != first and _running(first) and _running(moved)
        other = run(4, 2, (1, 2))  # another job on GPUs of both: both retired
        assert _running(other)
        _gone_within(60, first, moved)  # removed off the agent's loop (engine_calls.py)
        time.sleep(3.5)
        agent.poll()  # idle past LOCKSTEP_WARM_CONTAINER_IDLE_S
        assert not agent._warm.warm
        # The idle container's removal runs off the agent's loop (nodeagent/engine_calls.py):
        # gone once it returns, not at the poll that started it (a loaded CI saw it running).
        _gone_within(60, other)
    finally:
        agent.kill_all()
        agent.close()


def test_the_agents_stop_removes_its_warm_containers(agents, tmp_path):
    _finish(agents, _gang(agents, 1, tmp_path / "ckpt" / "job-1" / "attempt-1", steps=2))
    names = _names(agents)
    assert len(names) == 2 and all(_running(n) for n in names)
    for agent in agents:
        agent.close()
    assert not any(_running(n) for n in names)
