"""A job in containers that loses a rank, hangs, or loses its agent, on a live cluster whose
agents run jobs in the trainer's image (podman): a two-node job resumes from its checkpoint in
its warm containers; a hang is detected with the ranks' stacks and flight recorders from inside
the container; an agent frozen past the heartbeat timeout removes its lost attempt's container
when it thaws (fencing), and an agent killed and started again removes its stale containers
before it registers.

Skipped only where no engine or no image exists, saying so; .ci/run installs podman and builds
the image first, so CI skips none of it."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from tests.container_runtime_helpers import (
    CONTAINER_MARKS,
    ENGINE,
    IMAGE,
    TRAIN,
    _cancel,
    _containers,
    _job,
    _saving,
    _submit,
    cluster_fixture,  # noqa: F401 (fixture)
)
from tests.live import wait_for, worker_pids

pytestmark = CONTAINER_MARKS


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/status").read_text().split("PPid:")[1].split()[0])


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()


def _uid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/status").read_text().split("Uid:")[1].split()[0])


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
