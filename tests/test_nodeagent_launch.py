"""Node agent: launching an attempt's workers, and the launch contract they get.

Each rank's environment (torchrun's variables, Lockstep's, the node's env file), its own
session, its command run as given and never through a shell, and launches that cannot start.
The supervisor runs real processes here; the shared helpers are in tests/nodeagent_helpers.py.
"""

from __future__ import annotations

import sys
import time

import pytest

from nodeagent.contract import read_node_env
from nodeagent.supervisor import WorkerSupervisor
from nodeagent.tail import MetricsTail
from tests.nodeagent_helpers import (
    SLEEPER,
    clean_env_fixture,  # noqa: F401 (fixture)
    launch_spec,
    one_rank,
    supervisor_factory_fixture,  # noqa: F401 (fixture)
)

pytestmark = pytest.mark.timeout(60)


ENV_DUMPER = """
import json, os, sys
record = {"kind": "env", "env": dict(os.environ), "pid": os.getpid(), "sid": os.getsid(0),
          "executable": sys.executable}
with open(os.environ["LOCKSTEP_METRICS_PATH"], "a") as f:
    f.write(json.dumps(record) + "\\n")
print("hello from rank", os.environ["RANK"], flush=True)
print("and from stderr", file=sys.stderr)
"""


@pytest.mark.parametrize("gpu_kind", ["cpu", "cuda"])
def test_workers_get_the_launch_contract_in_their_own_sessions(supervisor_factory, gpu_kind):
    sup = supervisor_factory(gpu_kind)
    ranks = [
        {"rank": 2, "local_rank": 0, "gpu_index": 0},
        {"rank": 3, "local_rank": 1, "gpu_index": 1},
    ]
    spec = launch_spec(ENV_DUMPER, ranks, env={"USER_VAR": "x", "RANK": "99"})
    attempt = sup.launch(17, spec)
    assert sup.wait(17, timeout_s=20)
    assert [(r["rank"], r["state"], r["exit_code"]) for r in sup.status(17)] == [
        (2, "exited", 0),
        (3, "exited", 0),
    ]

    attempt_dir = sup.work_dir / "attempt-17"
    for worker, entry in zip(attempt.workers, ranks, strict=True):
        assert worker.metrics_path == attempt_dir / f"rank-{entry['rank']}.metrics.jsonl"
        records, _ = MetricsTail(worker.metrics_path, worker.rank).read()
        assert len(records) == 1
        record = records[0]
        assert record["rank"] == entry["rank"]  # added by the tail: the script wrote none
        assert record["sid"] == record["pid"] == worker.pid  # a session of its own
        assert record["executable"] == sys.executable  # "python" means the agent's python
        env = record["env"]
        expected = {
            "RANK": str(entry["rank"]),
            "LOCAL_RANK": str(entry["local_rank"]),
            "WORLD_SIZE": "4",
            "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "1",
            "GROUP_WORLD_SIZE": "2",
            "ROLE_RANK": str(entry["rank"]),
            "ROLE_WORLD_SIZE": "4",
            "ROLE_NAME": "default",
            "MASTER_ADDR": "10.0.0.7",
            "MASTER_PORT": "29517",
            "TORCHELASTIC_RUN_ID": "job5-attempt2",
            "TORCHELASTIC_RESTART_COUNT": "1",
            "TORCHELASTIC_MAX_RESTARTS": "3",
            "OMP_NUM_THREADS": "1",
            "LOCKSTEP_JOB_ID": "5",
            "LOCKSTEP_ATTEMPT": "2",
            "LOCKSTEP_ATTEMPT_ID": "17",
            "LOCKSTEP_CHECKPOINT_DIR": "/abs/ckpt/job-5",
            "LOCKSTEP_RESUME_FROM": "/abs/ckpt/job-5/step-000050",
            "LOCKSTEP_DATASET": "synthetic://addition",
            "LOCKSTEP_METRICS_PATH": str(worker.metrics_path),
            "LOCKSTEP_DEVICE": gpu_kind,
            "USER_VAR": "x",
            "NCCL_SOCKET_IFNAME": "lo",
        }
        assert {k: env.get(k) for k in expected} == expected
        # The flight recorder (NCCL's and gloo's), its dump and the pipe that asks for one in
        # the attempt's directory.
        assert env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"
        assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(attempt_dir / "nccl-trace-rank-")
        assert env["TORCH_NCCL_DEBUG_INFO_PIPE_FILE"] == str(attempt_dir / "nccl-trace-rank-")
        if gpu_kind == "cuda":
            assert env["CUDA_VISIBLE_DEVICES"] == str(entry["gpu_index"])
            # The NCCL watchdog, which dumps the recorder on a collective timeout.
            assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
        else:
            assert "CUDA_VISIBLE_DEVICES" not in env
            assert "TORCH_NCCL_DUMP_ON_TIMEOUT" not in env
        log = worker.log_path.read_text()
        assert worker.log_path == attempt_dir / f"rank-{entry['rank']}.log"
        assert f"hello from rank {entry['rank']}" in log
        assert "and from stderr" in log


def test_single_rank_keeps_the_users_thread_count(supervisor_factory):
    sup = supervisor_factory()
    attempt = sup.launch(1, launch_spec(ENV_DUMPER, one_rank(), local_world_size=1))
    assert sup.wait(1, timeout_s=20)
    records, _ = MetricsTail(attempt.workers[0].metrics_path, 0).read()
    assert "OMP_NUM_THREADS" not in records[0]["env"]


ARGV_DUMPER = """
import json, os, sys
with open(os.environ["LOCKSTEP_METRICS_PATH"], "a") as f:
    f.write(json.dumps({"kind": "argv", "argv": sys.argv[1:]}) + "\\n")
"""


def test_a_command_reaches_the_program_as_given_never_through_a_shell(supervisor_factory, tmp_path):
    canary = tmp_path / "canary"
    hostile = ["$(touch " + str(canary) + ")", "; touch " + str(canary), "|", "*", "$HOME", "'\""]
    sup = supervisor_factory()
    spec = launch_spec("", one_rank(), command=["python", "-c", ARGV_DUMPER, *hostile])
    attempt = sup.launch(6, spec)
    assert sup.wait(6, timeout_s=20)
    records, _ = MetricsTail(attempt.workers[0].metrics_path, 0).read()
    assert records[0]["argv"] == hostile
    assert not canary.exists()


def test_a_command_that_cannot_start_is_reported_as_exited_127(supervisor_factory):
    sup = supervisor_factory()
    spec = launch_spec("", one_rank(), command=["/nonexistent/lockstep-trainer", "--x"])
    attempt = sup.launch(3, spec)
    sup.poll()
    (status,) = sup.status(3)
    assert abs(status.pop("exited_at") - time.time()) < 30
    assert status == {"rank": 0, "pid": None, "state": "exited", "exit_code": 127}
    assert "cannot start" in attempt.workers[0].log_path.read_text()


def test_a_malformed_launch_starts_nothing(supervisor_factory):
    sup = supervisor_factory()
    spec = launch_spec(SLEEPER, [{"rank": 0, "local_rank": 0}, {"local_rank": 1}])
    with pytest.raises(KeyError):
        sup.launch(4, spec)
    assert sup.attempt_ids() == []


def test_a_nodes_env_file_reaches_every_rank_over_the_jobs_env(tmp_path, clean_env):
    env_file = tmp_path / "node.env"
    env_file.write_text(
        "# this node's fabric\nNCCL_SOCKET_IFNAME=ib0\n\nNCCL_IB_HCA=mlx5_0,mlx5_1\nEMPTY=\n"
    )
    node_env = read_node_env(env_file)
    assert node_env == {"NCCL_SOCKET_IFNAME": "ib0", "NCCL_IB_HCA": "mlx5_0,mlx5_1", "EMPTY": ""}
    sup = WorkerSupervisor(tmp_path / "work", gpu_kind="cpu", base_env=clean_env, node_env=node_env)
    ranks = [{"rank": 0, "local_rank": 0, "gpu_index": 0}]
    attempt = sup.launch(3, launch_spec(ENV_DUMPER, ranks, env={"NCCL_IB_HCA": "mine"}))
    assert sup.wait(3, timeout_s=20)
    (record,) = MetricsTail(attempt.workers[0].metrics_path, 0).read()[0]
    assert record["env"]["NCCL_SOCKET_IFNAME"] == "ib0"
    assert record["env"]["NCCL_IB_HCA"] == "mlx5_0,mlx5_1"  # the node's fact wins
    for bad, message in (
        ("just words", "not NAME=value"),
        ("RANK=3", "set by the launch contract"),
        ("LOCKSTEP_AGENT_TOKEN=x", "set by the launch contract"),
    ):
        env_file.write_text(f"OK=1\n{bad}\n")
        with pytest.raises(ValueError, match=f"node.env:2: .*{message}"):
            read_node_env(env_file)
