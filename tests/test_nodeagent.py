"""Node agent: worker supervision, file tails and the agent's side of the portal protocol.

Everything here runs real processes. The agent tests talk HTTP to `PortalPeer`, a small server
that plays the portal's side of docs/agent-protocol.md, the way a network peer would.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from nodeagent.agent import Agent
from nodeagent.contract import read_node_env
from nodeagent.supervisor import WorkerSupervisor
from nodeagent.tail import LogTail, MetricsTail

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parent.parent
CLUSTER_TOKEN = "cluster-secret"


# -- helpers ---------------------------------------------------------------------------------


def launch_spec(script: str, ranks: list[dict[str, int]], **overrides: Any) -> dict[str, Any]:
    """A launch dict as the portal sends it, running `python -c script` on each rank."""
    spec = {
        "job_id": 5,
        "attempt": 2,
        "command": ["python", "-c", textwrap.dedent(script)],
        "env": {"USER_VAR": "x"},
        "world_size": 4,
        "local_world_size": len(ranks),
        "group_rank": 1,
        "group_world_size": 2,
        "master_addr": "10.0.0.7",
        "master_port": 29517,
        "run_id": "job5-attempt2",
        "restart_count": 1,
        "max_restarts": 3,
        "checkpoint_dir": "/abs/ckpt/job-5",
        "resume_from": "/abs/ckpt/job-5/step-000050",
        "dataset": "synthetic://addition",
        "ranks": ranks,
    }
    spec.update(overrides)
    return spec


def one_rank() -> list[dict[str, int]]:
    return [{"rank": 0, "local_rank": 0, "gpu_index": 0}]


def wait_until(condition: Callable[[], Any], timeout_s: float = 15.0, what: str = "") -> Any:
    give_up = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > give_up:
            raise AssertionError(f"timed out waiting for {what or condition}")
        time.sleep(0.02)


def process_alive(pid: int) -> bool:
    """True unless the process is gone or a zombie (a reparented zombie may wait long for a
    container's init to reap it, but it runs nothing and holds no GPU)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"


# Writes a file atomically so a test never reads it half-written.
WRITE_HELPER = """
import os
def publish(path, text):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
"""

SLEEPER = (
    WRITE_HELPER
    + """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
publish(os.environ["LOCKSTEP_METRICS_PATH"] + ".pids", f"{os.getpid()} {child.pid}")
time.sleep(120)
"""
)


def read_pids(metrics_path: Path) -> tuple[int, int]:
    pids = Path(str(metrics_path) + ".pids")
    wait_until(pids.exists, what="the worker to publish its pids")
    worker, child = pids.read_text().split()
    return int(worker), int(child)


@pytest.fixture
def clean_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS")
        and not k.startswith(("LOCKSTEP_", "TORCHELASTIC_"))
    }
    env["NCCL_SOCKET_IFNAME"] = "lo"
    return env


@pytest.fixture
def supervisor_factory(tmp_path: Path, clean_env: dict[str, str]):
    made: list[WorkerSupervisor] = []

    def make(gpu_kind: str = "cpu") -> WorkerSupervisor:
        sup = WorkerSupervisor(tmp_path / "work", gpu_kind=gpu_kind, base_env=clean_env)
        made.append(sup)
        return sup

    yield make
    for sup in made:  # never leave sleepers behind, even when a test fails
        sup.kill_all()


# -- supervisor ------------------------------------------------------------------------------

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


def test_kill_takes_down_the_worker_and_its_children(supervisor_factory):
    sup = supervisor_factory()
    attempt = sup.launch(7, launch_spec(SLEEPER, one_rank()))
    worker_pid, child_pid = read_pids(attempt.workers[0].metrics_path)
    sup.poll()
    assert sup.status(7)[0]["state"] == "running"
    assert os.getsid(worker_pid) == worker_pid
    assert os.getpgid(child_pid) == worker_pid  # the grandchild shares the worker's group

    sup.kill(7)
    assert sup.wait(7, timeout_s=10)
    assert sup.status(7)[0]["exit_code"] == -signal.SIGKILL
    wait_until(lambda: not process_alive(child_pid), what="the grandchild to die")


def test_a_rank_that_dies_while_the_agent_is_busy_keeps_its_real_exit_time(supervisor_factory):
    """The agent's loop may wait seconds on a busy portal before it reaps again; the exit time
    it reports decides which rank a failed gang blames, so it is the death's, not the reap's."""
    sup = supervisor_factory()
    attempt = sup.launch(9, launch_spec(SLEEPER, one_rank()))
    worker_pid, _ = read_pids(attempt.workers[0].metrics_path)
    sup.poll()
    killed_at = time.time()
    os.kill(worker_pid, signal.SIGKILL)  # from outside: the OOM killer, say
    time.sleep(2.0)  # the loop is blocked on a heartbeat
    sup.poll()
    (status,) = sup.status(9)
    assert status["exit_code"] == -signal.SIGKILL
    assert status["exited_at"] - killed_at < 0.5, status["exited_at"] - killed_at


BUSY_CHILD_AND_SLEEPER = """
import os, subprocess, sys, time
if os.environ["RANK"] == "0":
    # The work happens in a child (a data loader, say): still this rank's CPU use.
    burn = "import time\\nt = time.time()\\nwhile time.time() - t < 60: pass"
    subprocess.run([sys.executable, "-c", burn])
else:
    time.sleep(60)
"""


def test_the_status_carries_each_ranks_cpu_use_children_included(supervisor_factory):
    sup = supervisor_factory()
    ranks = [{"rank": r, "local_rank": r, "gpu_index": r} for r in (0, 1)]
    sup.launch(8, launch_spec(BUSY_CHILD_AND_SLEEPER, ranks))

    def cpu() -> dict[int, float]:
        sup.poll()
        return {r["rank"]: r.get("cpu_s") for r in sup.status(8)}

    wait_until(lambda: (cpu()[0] or 0) >= 1.5, timeout_s=30, what="rank 0's child to burn CPU")
    used = cpu()
    assert used[1] is not None and used[1] < 0.5, used  # sleeping: next to nothing
    sup.kill(8)
    assert sup.wait(8, timeout_s=10)
    assert all("cpu_s" not in r for r in sup.status(8))  # only live ranks carry it


CATCHES_USR1 = (
    WRITE_HELPER
    + """
import os, signal, time
signal.signal(signal.SIGUSR1, lambda *_: print("stacks of rank", os.environ["RANK"], flush=True))
publish(os.environ["LOCKSTEP_METRICS_PATH"] + ".pids", f"{os.getpid()} 0")
time.sleep(120)
"""
)


def test_a_stack_dump_goes_only_to_ranks_that_catch_it(supervisor_factory):
    """A plain script has no SIGUSR1 handler: asking it for stacks would kill it (the default
    action), and its end would read as a signal rather than the hang it is."""
    sup = supervisor_factory()
    plain = sup.launch(11, launch_spec(SLEEPER, one_rank()))
    dumps = sup.launch(12, launch_spec(CATCHES_USR1, one_rank()))
    read_pids(plain.workers[0].metrics_path)
    read_pids(dumps.workers[0].metrics_path)
    sup.dump_stacks(11)
    sup.dump_stacks(12)
    wait_until(
        lambda: "stacks of rank 0" in dumps.workers[0].log_path.read_text(),
        what="the catching rank to dump",
    )
    time.sleep(0.5)
    sup.poll()
    assert [w.alive for w in (*plain.workers, *dumps.workers)] == [True, True]
    # Both are read from outside by py-spy too (nodeagent/stacks.py), the plain one included.
    wait_until(lambda: sup.dump_settled(11) and sup.dump_settled(12), what="py-spy")
    plain_log = plain.workers[0].log_path.read_text()
    assert "lockstep agent: stacks of rank 0, read from outside (py-spy dump)" in plain_log
    assert "MainThread" in plain_log and "<module>" in plain_log, plain_log[-2000:]


TRAPS_SIGTERM = (
    WRITE_HELPER
    + """
import os, signal, sys, time
base = os.environ["LOCKSTEP_METRICS_PATH"]
def on_term(signum, frame):
    publish(base + ".checkpointed", "step 12")
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
publish(base + ".ready", "")
while True:
    time.sleep(0.02)
"""
)

IGNORES_SIGTERM = (
    WRITE_HELPER
    + """
import os, signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
publish(os.environ["LOCKSTEP_METRICS_PATH"] + ".ready", "")
while True:
    time.sleep(0.02)
"""
)


def _wait_ready(attempt) -> None:
    for worker in attempt.workers:
        ready = Path(str(worker.metrics_path) + ".ready")
        wait_until(ready.exists, what="the worker to install its SIGTERM handler")


def test_stop_lets_a_worker_checkpoint_and_exit_cleanly(supervisor_factory):
    sup = supervisor_factory()
    attempt = sup.launch(8, launch_spec(TRAPS_SIGTERM, one_rank()))
    _wait_ready(attempt)
    sup.stop(8, deadline_s=20)
    assert sup.wait(8, timeout_s=10)
    assert sup.status(8)[0]["exit_code"] == 0
    assert Path(str(attempt.workers[0].metrics_path) + ".checkpointed").read_text() == "step 12"


def test_stop_sigkills_a_worker_that_ignores_sigterm_after_the_deadline(supervisor_factory):
    sup = supervisor_factory()
    attempt = sup.launch(9, launch_spec(IGNORES_SIGTERM, one_rank()))
    _wait_ready(attempt)
    started = time.monotonic()
    sup.stop(9, deadline_s=0.5)
    sup.stop(9, deadline_s=30)  # heartbeats repeat the stop; the first deadline holds
    time.sleep(0.2)
    sup.poll()
    assert sup.status(9)[0]["state"] == "running"  # SIGTERM alone did nothing
    assert sup.wait(9, timeout_s=10)
    assert time.monotonic() - started >= 0.5
    assert sup.status(9)[0]["exit_code"] == -9


def test_a_new_supervisor_kills_workers_orphaned_by_a_dead_agent(supervisor_factory):
    first = supervisor_factory()
    attempt = first.launch(10, launch_spec(SLEEPER, one_rank()))
    worker_pid, child_pid = read_pids(attempt.workers[0].metrics_path)
    # The first agent process "dies": its workers live on in their own sessions.
    second = supervisor_factory()
    assert second.reap_orphans() == 1
    assert first.wait(10, timeout_s=10)  # reaped by the parent that is still our test process
    wait_until(lambda: not process_alive(child_pid), what="the orphan's child to die")
    assert not process_alive(worker_pid)


# -- tails -----------------------------------------------------------------------------------


def test_metrics_tail_holds_a_partial_line_and_resends_until_acked(tmp_path):
    path = tmp_path / "rank-1.metrics.jsonl"
    tail = MetricsTail(path, rank=1)
    assert tail.read() == ([], 0)  # no file yet
    with open(path, "ab") as f:
        f.write(b'{"kind": "step", "step": 1, "loss": 2.5}\n{"kind": "st')
    records, end = tail.read()
    assert records == [{"kind": "step", "step": 1, "loss": 2.5, "rank": 1}]
    assert not tail.at_eof  # the half-written line is still owed
    # The heartbeat carrying it failed: no ack, so the same record comes again, plus the rest.
    with open(path, "ab") as f:
        f.write(b'ep", "step": 2, "rank": 0}\n')
    records, end = tail.read()
    assert [r["step"] for r in records] == [1, 2]
    assert records[1]["rank"] == 0  # a rank the trainer wrote is kept
    tail.ack(end)
    assert tail.read() == ([], end)
    assert tail.at_eof


def test_metrics_tail_skips_bad_lines_and_a_torn_last_line_once_the_writer_exited(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_bytes(b'not json\n[1, 2]\n{"step": 3}\n{"step": 4, "lo')
    tail = MetricsTail(path, rank=0)
    records, end = tail.read()
    assert records == [{"step": 3, "rank": 0}]
    tail.ack(end)
    records, end = tail.read(final=True)
    assert records == [] and tail.at_eof
    tail.ack(end)
    assert end == path.stat().st_size


def test_metrics_tail_turns_nan_and_infinities_into_null(tmp_path):
    """Python's json.dumps writes NaN and Infinity unless told not to, so a script that logs a
    diverged loss does. The heartbeat body must stay JSON the portal accepts."""
    import requests

    path = tmp_path / "m.jsonl"
    path.write_text(
        '{"step": 1, "loss": NaN, "tokens_per_s": Infinity, "step_time_s": -Infinity}\n'
        '{"step": 2, "loss": 1e999, "grad": [NaN, 2.5], "compute_s": 0.25}\n'
    )
    records, _ = MetricsTail(path, rank=0).read()
    assert records == [
        {"step": 1, "loss": None, "tokens_per_s": None, "step_time_s": None, "rank": 0},
        {"step": 2, "loss": None, "grad": [None, 2.5], "compute_s": 0.25, "rank": 0},
    ]
    body = requests.Request("POST", "http://portal", json={"records": records}).prepare().body
    assert json.loads(body)["records"] == records


def test_log_tail_ships_at_most_64k_per_read_and_resends_until_acked(tmp_path):
    path = tmp_path / "rank-0.log"
    path.write_bytes(b"a" * 100_000)
    tail = LogTail(path, rank=0)
    text, end = tail.read()
    assert len(text) == 64 * 1024 and end == 64 * 1024 and not tail.at_eof
    assert tail.read() == (text, end)  # not acked: the same chunk again
    tail.ack(end)
    text, end = tail.read()
    assert len(text) == 100_000 - 64 * 1024 and tail.at_eof


def test_log_tail_does_not_split_a_utf8_character(tmp_path):
    path = tmp_path / "rank-0.log"
    snowman = "☃".encode()
    path.write_bytes(b"loss " + snowman[:2])
    tail = LogTail(path, rank=0)
    text, end = tail.read()
    assert text == "loss " and end == 5
    tail.ack(end)
    with open(path, "ab") as f:
        f.write(snowman[2:] + b"\xff\n")
    text, end = tail.read()
    assert text == "☃\ufffd\n"  # invalid bytes are replaced, not fatal


# -- the agent against a portal peer ---------------------------------------------------------


class PortalPeer:
    """The portal's side of the agent protocol, enough to drive one agent.

    Tests set `desired`; the peer records every registration and heartbeat body it receives.
    """

    def __init__(self, heartbeat_s: float = 0.1) -> None:
        self.lock = threading.Lock()
        self.heartbeat_s = heartbeat_s
        self.desired: list[dict[str, Any]] = []
        self.registrations: list[dict[str, Any]] = []
        self.accepted: list[dict[str, Any]] = []  # heartbeat bodies answered with 200
        self.refused: list[dict[str, Any]] = []  # heartbeat bodies answered with an error
        # The real portal's checks on the body (jobs.agent_api): what the agent sends must pass.
        self.invalid: list[dict[str, Any]] = []
        self.node_token: str | None = None
        self.boot_id: str | None = None
        self.leaving: list[dict[str, Any]] = []  # bodies of "this node is leaving" calls
        self.fail_first_beat_with_records = False
        peer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                length = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(length) or b"{}")
                token = self.headers.get("Authorization", "").removeprefix("Bearer ")
                status, reply = peer.handle(self.path, token, body)
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def handle(self, path: str, token: str, body: dict[str, Any]) -> tuple[int, Any]:
        with self.lock:
            if path == "/api/v1/agent/register/":
                if token != CLUSTER_TOKEN:
                    return 401, {"detail": "bad token"}
                self.registrations.append(body)
                self.node_token = f"node-token-{len(self.registrations)}"
                self.boot_id = body["boot_id"]
                return 200, {
                    "node_id": 3,
                    "node_token": self.node_token,
                    "heartbeat_s": self.heartbeat_s,
                }
            if path == "/api/v1/agent/leaving/":
                if token != self.node_token:
                    return 401, {"detail": "unknown node token"}
                from jobs.agent_api import LeavingSerializer

                checked = LeavingSerializer(data=body)
                if not checked.is_valid():
                    self.invalid.append(checked.errors)
                    return 400, checked.errors
                self.leaving.append(body)
                return 200, {"stopping": []}
            if path == "/api/v1/agent/heartbeat/":
                if token != self.node_token:
                    return 401, {"detail": "unknown node token"}
                if body["boot_id"] != self.boot_id:
                    return 409, {"detail": "stale boot"}
                from jobs.agent_api import HeartbeatSerializer

                checked = HeartbeatSerializer(data=body)
                if not checked.is_valid():
                    self.invalid.append(checked.errors)
                    return 400, checked.errors
                has_records = any(a["records"] for a in body["attempts"])
                if self.fail_first_beat_with_records and has_records:
                    self.fail_first_beat_with_records = False
                    self.refused.append(body)
                    return 503, {"detail": "database is locked"}
                self.accepted.append(body)
                return 200, {
                    "heartbeat_s": self.heartbeat_s,
                    "desired": json.loads(json.dumps(self.desired)),
                }
            return 404, {"detail": "not found"}

    def set_desired(self, desired: list[dict[str, Any]]) -> None:
        with self.lock:
            self.desired = desired

    def beats_since(self, index: int) -> list[dict[str, Any]]:
        with self.lock:
            return self.accepted[index:]

    def attempt_in_beats(self, attempt_id: int, since: int = 0) -> list[dict[str, Any]]:
        return [
            a
            for beat in self.beats_since(since)
            for a in beat["attempts"]
            if a["attempt_id"] == attempt_id
        ]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def portal():
    peer = PortalPeer()
    yield peer
    peer.close()


@pytest.fixture
def running_agent(portal, tmp_path, clean_env, monkeypatch):
    for key in list(os.environ):
        if key not in clean_env:
            monkeypatch.delenv(key)
    agent = Agent(
        portal.url,
        CLUSTER_TOKEN,
        2,
        name="node-t",
        rack="r1",
        address="127.0.0.1",
        work_dir=tmp_path / "agent",
        gpu_kind="cpu",
    )
    result: dict[str, int] = {}
    thread = threading.Thread(target=lambda: result.update(rc=agent.run()), daemon=True)
    thread.start()
    yield agent
    agent.request_stop()
    thread.join(timeout=20)
    assert not thread.is_alive()
    assert result["rc"] == 0
    for attempt_id in agent.supervisor.attempt_ids():  # run() left no live worker behind
        assert agent.supervisor.wait(attempt_id, timeout_s=5)
        assert all(r["exit_code"] is not None for r in agent.supervisor.status(attempt_id))


def wait_launched(agent: Agent, attempt_id: int):
    """The attempt once every worker is spawned. The agent's thread lists an attempt in its
    supervisor before it spawns the workers, so `attempt_id in supervisor` is too early."""

    def launched():
        attempt = agent.supervisor.get(attempt_id)
        full = attempt is not None and len(attempt.workers) == len(attempt.launch["ranks"])
        return attempt if full else None

    return wait_until(launched, what=f"attempt {attempt_id} launched")


def run_item(attempt_id: int, spec: dict[str, Any]) -> dict[str, Any]:
    return {"attempt_id": attempt_id, "action": "run", "launch": spec}


STEPPER = """
import json, os, time
rank = int(os.environ["RANK"])
with open(os.environ["LOCKSTEP_METRICS_PATH"], "a") as f:
    f.write(json.dumps({"rank": rank, "kind": "step", "step": 1, "loss": 2.0 + rank,
                        "tokens_per_s": 900.0, "step_time_s": 0.05, "time": time.time()}))
    f.write("\\n")
print(f"rank {rank} done", flush=True)
"""


def test_agent_runs_reports_and_forgets_an_attempt(portal, running_agent):
    wait_until(lambda: portal.accepted, what="a first heartbeat")
    assert portal.registrations[0] == {
        "name": "node-t",
        "gpus": 2,
        "gpu_kind": "cpu",
        "hostname": os.uname().nodename,
        "address": "127.0.0.1",
        "rack": "r1",
        "boot_id": running_agent.boot_id,
        "killed_orphans": 0,
        "runtime": "process",  # the Agent's default: plain processes
        "engine": "",
    }
    first = portal.accepted[0]
    assert [t["index"] for t in first["telemetry"]] == [0, 1]
    assert all(t["kind"] == "cpu" for t in first["telemetry"])

    portal.fail_first_beat_with_records = True  # the records must survive a failed heartbeat
    ranks = [
        {"rank": 0, "local_rank": 0, "gpu_index": 0},
        {"rank": 1, "local_rank": 1, "gpu_index": 1},
    ]
    portal.set_desired(
        [run_item(21, launch_spec(STEPPER, ranks, world_size=2, group_rank=0, group_world_size=1))]
    )

    def exited_beat():
        reports = portal.attempt_in_beats(21)
        done = [a for a in reports if all(r["state"] == "exited" for r in a["ranks"])]
        return done[-1] if done else None

    exited = wait_until(exited_beat, what="both ranks reported exited")
    assert [(r["rank"], r["exit_code"]) for r in exited["ranks"]] == [(0, 0), (1, 0)]
    assert all(isinstance(r["pid"], int) for r in exited["ranks"])
    assert portal.refused, "the peer should have refused one heartbeat carrying records"

    reports = portal.attempt_in_beats(21)
    steps = sorted((r["rank"], r["loss"]) for a in reports for r in a["records"])
    assert steps == [(0, 2.0), (1, 3.0)]  # each record exactly once, despite the refusal
    logs = {}
    for a in reports:
        for chunk in a["logs"]:
            logs[chunk["rank"]] = logs.get(chunk["rank"], "") + chunk["text"]
    assert logs == {0: "rank 0 done\n", 1: "rank 1 done\n"}

    # Still listed as `run`: the agent keeps reporting the exit and does not relaunch.
    mark = len(portal.beats_since(0))
    wait_until(lambda: len(portal.attempt_in_beats(21, since=mark)) >= 3, what="more reports")
    assert all(
        r["state"] == "exited" for a in portal.attempt_in_beats(21, since=mark) for r in a["ranks"]
    )

    portal.set_desired([])
    wait_until(lambda: 21 not in running_agent.supervisor, what="the attempt to be forgotten")
    mark = len(portal.beats_since(0))
    wait_until(lambda: len(portal.beats_since(mark)) >= 2, what="later heartbeats")
    assert portal.attempt_in_beats(21, since=mark + 1) == []
    assert portal.invalid == []  # every heartbeat had the shape the portal checks


DIVERGED = """
import json, os, time
rank = int(os.environ["RANK"])
with open(os.environ["LOCKSTEP_METRICS_PATH"], "a") as f:
    for step, loss in ((1, 2.0), (2, float("nan")), (3, float("inf"))):
        f.write(json.dumps({"kind": "step", "step": step, "loss": loss, "time": time.time()}))
        f.write("\\n")
"""


def test_agent_keeps_heartbeating_when_a_script_writes_nan(portal, running_agent):
    wait_until(lambda: portal.accepted, what="a first heartbeat")
    ranks = [{"rank": 0, "local_rank": 0, "gpu_index": 0}]
    portal.set_desired(
        [run_item(31, launch_spec(DIVERGED, ranks, world_size=1, group_rank=0, group_world_size=1))]
    )

    def exited_beat():
        reports = portal.attempt_in_beats(31)
        return [a for a in reports if all(r["state"] == "exited" for r in a["ranks"])]

    wait_until(exited_beat, what="the rank's exit reported")
    losses = sorted(
        (r["step"], r["loss"]) for a in portal.attempt_in_beats(31) for r in a["records"]
    )
    assert losses == [(1, 2.0), (2, None), (3, None)]
    assert portal.invalid == []


def test_agent_fences_an_attempt_dropped_from_desired(portal, running_agent):
    portal.set_desired([run_item(31, launch_spec(SLEEPER, one_rank()))])
    wait_until(
        lambda: any(
            r["state"] == "running" for a in portal.attempt_in_beats(31) for r in a["ranks"]
        ),
        what="the sleeper reported running",
    )
    metrics_path = running_agent.supervisor.get(31).workers[0].metrics_path
    worker_pid, child_pid = read_pids(metrics_path)

    portal.set_desired([])  # e.g. the node was declared lost and the job placed elsewhere
    fenced = wait_until(
        lambda: [a for a in portal.attempt_in_beats(31) if a["ranks"][0]["state"] == "exited"],
        what="the fenced attempt reported exited",
    )
    assert fenced[0]["ranks"][0]["exit_code"] == -9
    assert not process_alive(worker_pid)
    wait_until(lambda: not process_alive(child_pid), what="the sleeper's child to die")
    wait_until(lambda: 31 not in running_agent.supervisor, what="the attempt to be forgotten")


def test_agent_stop_action_sends_sigterm_and_reports_a_clean_exit(portal, running_agent):
    portal.set_desired([run_item(41, launch_spec(TRAPS_SIGTERM, one_rank()))])
    _wait_ready(wait_launched(running_agent, 41))
    portal.set_desired([{"attempt_id": 41, "action": "stop", "deadline_s": 20.0}])
    done = wait_until(
        lambda: [a for a in portal.attempt_in_beats(41) if a["ranks"][0]["state"] == "exited"],
        what="a clean exit",
    )
    assert done[0]["ranks"][0]["exit_code"] == 0


DUMPS_STACKS = (
    WRITE_HELPER
    + """
import faulthandler, os, signal, subprocess, sys, time
faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
# A helper without a handler: SIGUSR1's default action would kill it.
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
def hang_here():
    while True:
        time.sleep(0.05)
publish(os.environ["LOCKSTEP_METRICS_PATH"] + ".pids", f"{os.getpid()} {child.pid}")
hang_here()
"""
)


def test_agent_dump_action_gets_stacks_into_the_logs_then_fencing_kills(portal, running_agent):
    portal.set_desired([run_item(45, launch_spec(DUMPS_STACKS, one_rank()))])
    worker = wait_launched(running_agent, 45).workers[0]
    worker_pid, child_pid = read_pids(worker.metrics_path)

    mark = len(portal.beats_since(0))
    asked = time.monotonic()
    portal.set_desired([{"attempt_id": 45, "action": "dump"}])
    dumped = wait_until(
        lambda: [a for a in portal.attempt_in_beats(45, since=mark) if a.get("dumped")],
        what="a report with dumped: true",
    )
    assert time.monotonic() - asked >= 1.0  # the dump had a second to reach the log
    assert dumped[0]["dumped"] is True
    assert dumped[0]["ranks"][0]["state"] == "running"
    # Everything shipped up to and including that beat holds the dump.
    reports = portal.attempt_in_beats(45)
    upto = reports[: reports.index(dumped[0]) + 1]
    shipped = "".join(chunk["text"] for a in upto for chunk in a["logs"])
    assert "(most recent call first)" in shipped and "in hang_here" in shipped
    assert "(most recent call first)" in worker.log_path.read_text()

    # `dump` is repeated by every heartbeat; the signal is sent once and nothing is fenced.
    later = len(portal.beats_since(0))
    wait_until(lambda: len(portal.attempt_in_beats(45, since=later)) >= 3, what="more beats")
    assert all(a.get("dumped") for a in portal.attempt_in_beats(45, since=later))
    assert all(a["ranks"][0]["state"] == "running" for a in portal.attempt_in_beats(45))
    assert worker.log_path.read_text().count("(most recent call first)") == 1
    assert process_alive(worker_pid)
    assert process_alive(child_pid)  # the signal went to the worker, not its process group

    portal.set_desired([])  # the portal has its stacks: drop the attempt, the agent fences
    fenced = wait_until(
        lambda: [a for a in portal.attempt_in_beats(45) if a["ranks"][0]["state"] == "exited"],
        what="the fenced attempt reported exited",
    )
    assert fenced[0]["ranks"][0]["exit_code"] == -signal.SIGKILL
    wait_until(lambda: not process_alive(child_pid), what="the worker's child to die")


def test_agent_reregisters_on_401_and_keeps_its_workers(portal, running_agent):
    portal.set_desired([run_item(51, launch_spec(SLEEPER, one_rank()))])
    worker_pid, _ = read_pids(wait_launched(running_agent, 51).workers[0].metrics_path)
    with portal.lock:
        portal.node_token = "rotated"
    wait_until(lambda: len(portal.registrations) == 2, what="a re-registration")
    mark = len(portal.beats_since(0))
    wait_until(lambda: portal.attempt_in_beats(51, since=mark), what="heartbeats resuming")
    assert process_alive(worker_pid)


def test_agent_kills_everything_on_stale_boot_and_reregisters(portal, running_agent):
    portal.set_desired([run_item(61, launch_spec(SLEEPER, one_rank()))])
    worker_pid, child_pid = read_pids(wait_launched(running_agent, 61).workers[0].metrics_path)
    with portal.lock:
        portal.boot_id = "another-agent-process"
    wait_until(lambda: len(portal.registrations) == 2, what="a re-registration")
    killed = wait_until(
        lambda: [a for a in portal.attempt_in_beats(61) if a["ranks"][0]["state"] == "exited"],
        what="the killed worker reported",
    )
    assert killed[0]["ranks"][0]["exit_code"] == -9
    assert not process_alive(worker_pid)
    wait_until(lambda: not process_alive(child_pid), what="the worker's child to die")
    assert running_agent.supervisor.get(61).workers[0].popen.pid == worker_pid  # no relaunch


# -- the command line ------------------------------------------------------------------------


def _agent_env(clean_env: dict[str, str]) -> dict[str, str]:
    env = dict(clean_env)
    env["PYTHONPATH"] = str(REPO)
    env.pop("LOCKSTEP_AGENT_TOKEN", None)
    env.pop("LOCKSTEP_PORTAL", None)
    # These workers are `python -c` scripts of the suite's interpreter: plain processes.
    env["LOCKSTEP_AGENT_RUNTIME"] = "process"
    return env


def test_cli_without_a_token_exits_2_with_a_clear_message(clean_env, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "nodeagent", "--gpus", "1"],
        cwd=tmp_path,
        env=_agent_env(clean_env),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert "LOCKSTEP_AGENT_TOKEN" in proc.stderr


def test_cli_rejects_zero_gpus(clean_env, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "nodeagent", "--gpus", "0", "--token", "t"],
        cwd=tmp_path,
        env=_agent_env(clean_env),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert "--gpus" in proc.stderr


def _cli_agent(portal, clean_env, tmp_path, name, *extra):
    stderr_path = tmp_path / "agent.stderr"
    with open(stderr_path, "w") as stderr:
        agent = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "nodeagent",
                "--portal",
                portal.url,
                "--token",
                CLUSTER_TOKEN,
                "--gpus",
                "1",
                "--name",
                name,
                "--gpu-kind",
                "cpu",
                *extra,
            ],
            cwd=tmp_path,
            env=_agent_env(clean_env),
            stderr=stderr,
            stdout=subprocess.DEVNULL,
        )
    return agent, stderr_path


def test_cli_agent_on_sigterm_stops_its_workers_says_it_is_leaving_and_exits_0(
    portal, clean_env, tmp_path
):
    """A planned stop: the workers get the checkpoint-and-stop signal (SIGTERM), the portal
    hears the node is leaving and then the workers' exits, and the agent exits 0."""
    portal.set_desired([run_item(71, launch_spec(TRAPS_SIGTERM, one_rank()))])
    agent, stderr_path = _cli_agent(portal, clean_env, tmp_path, "node-cli")
    try:
        metrics = tmp_path / "var/agents/node-cli/attempt-71/rank-0.metrics.jsonl"
        wait_until(Path(str(metrics) + ".ready").exists, what="the worker's SIGTERM handler")
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=20) == 0
    finally:
        if agent.poll() is None:
            agent.kill()
    # It checkpointed (its SIGTERM handler ran) and exited 0, and the portal heard both.
    assert Path(str(metrics) + ".checkpointed").read_text() == "step 12"
    (leaving,) = portal.leaving
    assert leaving["reason"] == "SIGTERM" and leaving["boot_id"] == portal.boot_id
    assert 0 < leaving["grace_s"] <= 30
    exits = [a["ranks"][0] for a in portal.attempt_in_beats(71) if a["ranks"][0]["exit_code"] == 0]
    assert exits and exits[0]["state"] == "exited"
    log = stderr_path.read_text()
    assert "[node-cli]" in log
    assert "told the portal this node is leaving" in log
    assert "agent stopping (SIGTERM): killed 0 worker(s); exiting with 0" in log


def test_cli_agent_second_signal_kills_its_workers_at_once(portal, clean_env, tmp_path):
    portal.set_desired([run_item(72, launch_spec(IGNORES_SIGTERM, one_rank()))])
    agent, stderr_path = _cli_agent(
        portal, clean_env, tmp_path, "node-cli2", "--leave-timeout-s", "120"
    )
    try:
        metrics = tmp_path / "var/agents/node-cli2/attempt-72/rank-0.metrics.jsonl"
        wait_until(Path(str(metrics) + ".ready").exists, what="the worker's SIGTERM handler")
        agent.send_signal(signal.SIGINT)
        wait_until(lambda: portal.leaving, what="the agent to say it is leaving")
        time.sleep(0.5)
        assert agent.poll() is None  # waiting for a worker that ignores SIGTERM
        started = time.monotonic()
        agent.send_signal(signal.SIGINT)
        assert agent.wait(timeout=20) == 0
        assert time.monotonic() - started < 10
    finally:
        if agent.poll() is None:
            agent.kill()
    assert "exiting with 0" in stderr_path.read_text()
    (pids,) = [a["ranks"][0]["pid"] for a in portal.attempt_in_beats(72)][:1]
    assert not process_alive(pids)


def test_cli_agent_leave_deadline_kills_a_worker_that_ignores_the_stop(portal, clean_env, tmp_path):
    portal.set_desired([run_item(73, launch_spec(IGNORES_SIGTERM, one_rank()))])
    agent, stderr_path = _cli_agent(
        portal, clean_env, tmp_path, "node-cli3", "--leave-timeout-s", "2"
    )
    try:
        metrics = tmp_path / "var/agents/node-cli3/attempt-73/rank-0.metrics.jsonl"
        wait_until(Path(str(metrics) + ".ready").exists, what="the worker's SIGTERM handler")
        started = time.monotonic()
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=20) == 0
        assert time.monotonic() - started < 10
    finally:
        if agent.poll() is None:
            agent.kill()
    assert portal.leaving
    # The kill at the deadline is reported before the agent goes.
    killed = [a["ranks"][0] for a in portal.attempt_in_beats(73) if a["ranks"][0]["exit_code"]]
    assert killed and killed[-1]["exit_code"] == -signal.SIGKILL
    assert "exiting with 0" in stderr_path.read_text()


def test_cli_agent_waits_for_an_unreachable_portal_and_says_so(clean_env, tmp_path):
    stderr_path = tmp_path / "agent.stderr"
    with open(stderr_path, "w") as stderr:
        agent = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "nodeagent",
                "--portal",
                "http://127.0.0.1:9",
                "--token",
                "t",
                "--gpus",
                "1",
                "--name",
                "node-x",
                "--gpu-kind",
                "cpu",
            ],
            cwd=tmp_path,
            env=_agent_env(clean_env),
            stderr=stderr,
            stdout=subprocess.DEVNULL,
        )
    try:
        wait_until(lambda: "retrying in" in stderr_path.read_text(), what="a retry message")
        agent.send_signal(signal.SIGINT)
        assert agent.wait(timeout=20) == 0
    finally:
        if agent.poll() is None:
            agent.kill()
    assert "cannot reach http://127.0.0.1:9" in stderr_path.read_text()


def test_cli_agent_exits_1_when_the_portal_rejects_its_token(portal, clean_env, tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "nodeagent",
            "--portal",
            portal.url,
            "--token",
            "wrong",
            "--gpus",
            "1",
            "--name",
            "node-y",
            "--gpu-kind",
            "cpu",
        ],
        cwd=tmp_path,
        env=_agent_env(clean_env),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 1
    assert "rejected the cluster agent token" in proc.stderr


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


def test_the_agent_cli_refuses_a_bad_node_env_file_with_its_line(tmp_path, clean_env):
    env_file = tmp_path / "node.env"
    env_file.write_text("MASTER_PORT=1\n")
    token = tmp_path / "token"
    token.write_text("t")
    token.chmod(0o600)
    proc = subprocess.run(
        [sys.executable, "-m", "nodeagent", "--gpus", "1", "--token-file", str(token)]
        + ["--node-env-file", str(env_file)],
        cwd=tmp_path,
        env=_agent_env(clean_env),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "MASTER_PORT is set by the launch contract" in proc.stderr
    token.chmod(0o644)
    env_file.write_text("")
    proc = subprocess.run(
        [sys.executable, "-m", "nodeagent", "--gpus", "1", "--token-file", str(token)],
        cwd=tmp_path,
        env=_agent_env(clean_env),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "readable by others: chmod 600" in proc.stderr


def test_nvml_bindings_are_installed_and_a_node_without_the_driver_says_so(caplog):
    """nvidia-ml-py is a dependency (GPU nodes' telemetry); where no NVIDIA driver is loaded,
    as here, a cuda node reports zeros for its slots and logs why, once."""
    import pynvml

    from nodeagent.telemetry import Telemetry

    assert hasattr(pynvml, "nvmlDeviceGetTotalEccErrors")  # NVIDIA's bindings, not a stub
    if Path("/dev/nvidiactl").exists():
        pytest.skip("an NVIDIA driver is present: this test is of a node without one")
    with caplog.at_level("INFO", logger="nodeagent.telemetry"):
        telemetry = Telemetry(2, "cuda")
    assert [r["util"] for r in telemetry.read()] == [0.0, 0.0]
    assert any("no NVML telemetry" in m and "NVML" in m for m in caplog.messages)
    assert [r["kind"] for r in Telemetry(2, "cpu").read()] == ["cpu", "cpu"]


def test_agents_that_start_in_step_drift_apart_instead_of_beating_together():
    """512 agents registered at the same instant (a portal restart) with a 16 s interval: after
    ten beats, no one-second window holds more than a fifth of their heartbeats, where
    without jitter all 512 fell in the same one (bench/hollow.py measured that herd)."""
    import random

    from nodeagent.agent import JITTER, jittered

    rng = random.Random(20)
    interval, agents, beats = 16.0, 512, 10
    waits = [[jittered(interval, rng) for _ in range(beats)] for _ in range(agents)]
    assert all((1 - JITTER) * interval <= w <= (1 + JITTER) * interval for ws in waits for w in ws)
    mean = sum(map(sum, waits)) / (agents * beats)
    assert abs(mean - interval) < 0.05 * interval  # the interval the portal set, on average
    tenth_beat = sorted(sum(ws) for ws in waits)
    busiest = max(sum(1 for t in tenth_beat if start <= t < start + 1.0) for start in tenth_beat)
    assert busiest < agents / 5, busiest


def test_a_gpus_own_xid_goes_to_the_portal_as_a_failed_health_check(portal, running_agent):
    """The Xid events come from NVML on GPU nodes (nodeagent/xid.py; run for real by
    bench/gpu_check.py); here the telemetry's queue of node faults is filled as the NVML poll
    fills it. A job's own Xid (31, a page fault) is not held against the node; 79 is."""
    from nodeagent.xid import fault_report

    assert fault_report([{"gpu": 0, "xid": 31, "at": 0.0}]) is None
    wait_until(lambda: portal.accepted, what="a first heartbeat")
    # A CPU node has no Xid watch and reports no Xid: nothing invented.
    assert running_agent.telemetry.xid is None
    assert not any("xid" in r for b in portal.accepted for r in b.get("telemetry", []))
    running_agent.telemetry.faults = [{"gpu": 1, "xid": 79, "at": 0.0}]

    def reported():
        with portal.lock:
            return next((b["health"] for b in portal.accepted if "health" in b), None)

    health = wait_until(reported, what="the Xid in a heartbeat")
    assert not health["ok"] and health["reason"] == "GPU 1: Xid 79 (GPU has fallen off the bus)"
    assert running_agent.telemetry.faults == []
    assert not portal.invalid
