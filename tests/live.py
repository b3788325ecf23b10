"""A real Lockstep cluster for end-to-end tests: daphne, the scheduler, an rq worker and node
agents as separate processes, on the test database and the suite's Redis."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import requests
from django.conf import settings

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ClusterDatabase:
    """A database of the cluster's own, apart from pytest-django's: PostgreSQL when the suite
    runs with DATABASE_URL (a fresh database on that server), else a SQLite file."""

    def __init__(self, work: Path):
        self.base = os.environ.get("DATABASE_URL", "")
        self.name = f"lockstep_e2e_{os.getpid()}_{free_port()}"
        if self.base.startswith("postgres"):
            self._admin(f'CREATE DATABASE "{self.name}"')
            self.url = urlparse(self.base)._replace(path=f"/{self.name}").geturl()
        else:
            self.url = f"sqlite:///{(work / 'cluster.sqlite3').resolve()}"

    def _admin(self, sql: str) -> None:
        import psycopg

        with psycopg.connect(
            self.base.replace("postgres://", "postgresql://", 1), autocommit=True
        ) as conn:
            conn.execute(sql)

    def drop(self) -> None:
        if self.base.startswith("postgres"):
            self._admin(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')


def wait_for(predicate, timeout: float, what: str, interval: float = 0.25):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


def worker_pids(attempt_id: int) -> dict[int, int]:
    """rank -> pid of the live worker processes of an attempt (read from /proc environ)."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"LOCKSTEP_ATTEMPT_ID={attempt_id}".encode() in env:
            for item in env:
                if item.startswith(b"RANK="):
                    found[int(item[5:])] = int(proc.name)
    return found


class LiveCluster:
    def __init__(
        self,
        work: Path,
        *,
        agents: int = 2,
        gpus_per_agent: int = 2,
        env: dict[str, str] | None = None,
        agent_heartbeat_s: float = 0.5,
        runtime: str = "process",
        agent_args: dict[str, list[str]] | None = None,
        portals: int = 1,
    ):
        """`env` is applied over the test settings below (e.g. production defaults for a
        benchmark); `agent_heartbeat_s` is the agents' --heartbeat-s (the portal's
        LOCKSTEP_HEARTBEAT_S replaces it once they register); `portals` daphne processes
        serve the same database and channel layer on ports of their own, as several behind a
        proxy do in production (`urls`; `url` is the first)."""
        self.work = work
        self.agent_heartbeat_s = agent_heartbeat_s
        self.agent_args = agent_args or {}  # extra command-line arguments, by agent name
        self.ports = [free_port() for _ in range(portals)]
        self.port = self.ports[0]
        self.urls = [f"http://127.0.0.1:{port}" for port in self.ports]
        self.url = self.urls[0]
        self.agent_token = "test-agent-token"
        # In a file only its owner reads, as an operator would keep it (nodeagent --token-file).
        work.mkdir(parents=True, exist_ok=True)
        self.agent_token_file = work / "agent_token"
        self.agent_token_file.write_text(self.agent_token)
        self.agent_token_file.chmod(0o600)
        self.procs: dict[str, subprocess.Popen] = {}
        self.agent_names = [f"e2e-{chr(ord('a') + i)}" for i in range(agents)]
        self.gpus_per_agent = gpus_per_agent
        self.database = ClusterDatabase(work)
        self.env = dict(
            os.environ,
            DJANGO_SETTINGS_MODULE="portal.settings",
            DATABASE_URL=self.database.url,
            REDIS_URL=settings.REDIS_URL,
            LOCKSTEP_AGENT_TOKEN_FILE=str(self.agent_token_file),
            # Plain processes unless a test asks for containers (tests/test_container_runtime.py).
            LOCKSTEP_AGENT_RUNTIME=runtime,
            LOCKSTEP_CHECKPOINT_ROOT=str(work / "checkpoints"),
            LOCKSTEP_MODEL_ROOT=str(work / "models"),
            # The failed-auth counters live in the shared Redis per address, and every test
            # client is 127.0.0.1: tests that send wrong tokens on purpose must not get the
            # suite's agents and clients refused (tests/test_tokens.py covers the throttle).
            LOCKSTEP_THROTTLE_AUTH_FAILURES="1000000/min",
            LOCKSTEP_HEARTBEAT_S="0.5",
            LOCKSTEP_HEARTBEAT_TIMEOUT_S="6",
            LOCKSTEP_GPU_SAMPLE_S="1",
            LOCKSTEP_ELASTIC_GROW_AFTER_S="3",
            # Detectors tuned for seconds-long tests; strikes never cordon a node mid-suite
            # (cordoning is covered in test_failures_nodes.py).
            LOCKSTEP_HANG_MIN_S="12",
            LOCKSTEP_DUMP_WAIT_S="3",
            LOCKSTEP_STRAGGLER_WINDOW_STEPS="20",
            LOCKSTEP_STRAGGLER_CHECK_S="3",
            LOCKSTEP_STRAGGLER_MIN_EXCESS_S="0.06",
            LOCKSTEP_STRIKES_TO_CORDON="1000",
            # Nor does a rank slowed by the suite's own load move a job off its node
            # (tests/test_straggler_response.py turns it on).
            LOCKSTEP_STRAGGLER_MAX_MOVES="0",
            LOCKSTEP_RECLAIM_BACKOFF_S="5",
            # A two-node borrower is a gang beyond its team's quota (protection rule 5): a
            # reclaim waits this long for it, not the production 4 h.
            LOCKSTEP_RECLAIM_GANG_EXEMPT_S="20",
            LOCKSTEP_SCHEDULER_TICK_S="1",
            LOCKSTEP_RESTART_BACKOFF_S="1",
            LOCKSTEP_STOP_GRACE_S="20",
            # Below the ephemeral range (32768+), where the suite's own client sockets live.
            LOCKSTEP_MASTER_PORT_BASE=str(20000 + free_port() % 9000),
            LOCKSTEP_MASTER_PORT_SPAN="3000",
            PYTHONUNBUFFERED="1",
            # The agents' full health check (a collective of torch processes) at their start
            # costs seconds of CPU per agent; tests/test_node_health.py turns it on.
            LOCKSTEP_AGENT_HEALTH_CHECK_S="0",
        )
        self.env.update(env or {})

    def _start(self, name: str, argv: list[str]) -> None:
        log = open(self.work / f"{name}.log", "ab")  # noqa: SIM115 (the child keeps it)
        self.procs[name] = subprocess.Popen(
            argv,
            cwd=ROOT,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def manage(self, *args: str) -> str:
        """Run a manage.py command against the cluster's database; returns its stdout."""
        done = subprocess.run(
            [sys.executable, "manage.py", *args],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    def token(self, *args: str) -> str:
        return self.manage("issue_token", *args).strip().splitlines()[-1]

    def start(self) -> LiveCluster:
        py = sys.executable
        self.manage("migrate", "--noinput", "-v", "0")
        for i, port in enumerate(self.ports):
            self._start(
                "portal" if i == 0 else f"portal-{i + 1}",
                [py, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "portal.asgi:application"],
            )
        self._start("scheduler", [py, "manage.py", "run_scheduler"])
        self._start("rqworker", [py, "manage.py", "rqworker", "default"])
        wait_for(self._portal_up, 60, "the portal to answer")
        for name in self.agent_names:
            self.start_agent(name)
        return self

    def wait_for_gpus(self, api: Api, gpus: int, timeout: float = 60) -> None:
        """Until the registered nodes (as `api`'s user sees them) hold `gpus` GPUs in all."""
        wait_for(
            lambda: sum(n["gpus"] for n in api.get("/api/v1/nodes/").json()["results"]) == gpus,
            timeout,
            "the agents to register",
        )

    def restart(self, name: str, *, down_s: float = 0.0) -> None:
        """Stop one of the cluster's processes (SIGTERM), wait, and start it again."""
        proc = self.procs[name]
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            # daphne waits for open connections on SIGTERM; a crash is as good a test.
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=15)
        time.sleep(down_s)
        self._start(name, proc.args)

    def start_agent(self, name: str) -> None:
        self._start(
            f"agent-{name}",
            [
                sys.executable,
                "-m",
                "nodeagent",
                "--portal",
                self.url,
                "--token-file",
                str(self.agent_token_file),
                "--gpus",
                str(self.gpus_per_agent),
                "--name",
                name,
                "--heartbeat-s",
                str(self.agent_heartbeat_s),
                "--work-dir",
                str(self.work / "agents" / name),
                "--gpu-kind",
                "cpu",
                *self.agent_args.get(name, []),
            ],
        )

    def _portal_up(self) -> bool:
        self.check_alive()
        try:
            return all(
                requests.get(url + "/login/", timeout=5).status_code == 200 for url in self.urls
            )
        except requests.RequestException:  # refused, or too slow to answer yet: keep waiting
            return False

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                log = (self.work / f"{name}.log").read_text(errors="replace")[-3000:]
                raise AssertionError(f"{name} exited with {proc.returncode}:\n{log}")

    def stop(self) -> None:
        for proc in reversed(self.procs.values()):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.database.drop()

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-2500:]}"
            for p in sorted(self.work.glob("*.log"))
        )


class Api:
    def __init__(self, url: str, token: str):
        self.url = url
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"Bearer {token}"

    def get(self, path: str, **kwargs):
        return self.session.get(self.url + path, timeout=15, **kwargs)

    def post(self, path: str, json=None):
        return self.session.post(self.url + path, json=json, timeout=15)


def submit_training(api: Api, name: str, team: str, command: list[str], gpus: int = 4) -> int:
    """Submit a job of the reference trainer on the synthetic dataset (two restarts allowed);
    its id."""
    response = api.post(
        "/api/v1/jobs/",
        {
            "name": name,
            "team": team,
            "image": "lockstep/trainer:latest",
            "command": command,
            "dataset": "synthetic://addition",
            "gpus": gpus,
            "max_restarts": 2,
        },
    )
    assert response.status_code == 201, response.text
    return response.json()["id"]
