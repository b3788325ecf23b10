"""What the node agent's tests (tests/test_nodeagent*.py) share: launch specs, worker scripts,
waiting, and `PortalPeer`, a small server that plays the portal's side of
docs/agent-protocol.md over HTTP, the way a network peer would.

The fixtures here are named for pytest with `name=`: a test file imports the `*_fixture`
functions it needs (and those they depend on) and its tests ask for `clean_env`,
`supervisor_factory`, `portal` or `running_agent` as usual.
"""

from __future__ import annotations

import json
import os
import textwrap
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from nodeagent.agent import Agent
from nodeagent.supervisor import WorkerSupervisor

REPO = Path(__file__).resolve().parent.parent
CLUSTER_TOKEN = "cluster-secret"


def warm_supervisor(tmp_path: Path) -> tuple[WorkerSupervisor, Path]:
    """A supervisor whose zygote preloads a small module of the test's (fast to warm, and a
    `deploy` is a touch of its file)."""
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "warmmod.py").write_text("VERSION = 1\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOCKSTEP_", "OMP_"))}
    env["PYTHONPATH"] = f"{lib}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env["LOCKSTEP_ZYGOTE_PRELOAD"] = "warmmod"
    sup = WorkerSupervisor(tmp_path / "work", gpu_kind="cpu", base_env=env, warm_start=True)
    assert sup._zygote.wait_ready(90), sup._zygote.failed
    return sup, lib / "warmmod.py"


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


@pytest.fixture(name="clean_env")
def clean_env_fixture() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS")
        and not k.startswith(("LOCKSTEP_", "TORCHELASTIC_"))
    }
    env["NCCL_SOCKET_IFNAME"] = "lo"
    return env


@pytest.fixture(name="supervisor_factory")
def supervisor_factory_fixture(tmp_path: Path, clean_env: dict[str, str]):
    made: list[WorkerSupervisor] = []

    def make(gpu_kind: str = "cpu") -> WorkerSupervisor:
        sup = WorkerSupervisor(tmp_path / "work", gpu_kind=gpu_kind, base_env=clean_env)
        made.append(sup)
        return sup

    yield make
    for sup in made:  # never leave sleepers behind, even when a test fails
        sup.kill_all()


# -- the portal's side ----------------------------------------------------------------------


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


@pytest.fixture(name="portal")
def portal_fixture():
    peer = PortalPeer()
    yield peer
    peer.close()


@pytest.fixture(name="running_agent")
def running_agent_fixture(portal, tmp_path, clean_env, monkeypatch):
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


# -- the command line ------------------------------------------------------------------------


def agent_env(clean_env: dict[str, str]) -> dict[str, str]:
    env = dict(clean_env)
    env["PYTHONPATH"] = str(REPO)
    env.pop("LOCKSTEP_AGENT_TOKEN", None)
    env.pop("LOCKSTEP_PORTAL", None)
    # These workers are `python -c` scripts of the suite's interpreter: plain processes.
    env["LOCKSTEP_AGENT_RUNTIME"] = "process"
    return env
