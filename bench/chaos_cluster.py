"""The chaos benchmark's cluster (bench/chaos.py): the platform it starts and stops (`lockstep up`
plus two agents it supervises itself), finding its processes through /proc, rank 0's metric
files, and the REST calls that submit a job and watch it."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
PY = str(ROOT / ".venv" / "bin" / "python")
# Settings for fast detection on a two-node toy cluster (read by portal/settings.py).
PLATFORM_ENV = {
    "LOCKSTEP_HEARTBEAT_S": "1",
    "LOCKSTEP_HEARTBEAT_TIMEOUT_S": "10",
    "LOCKSTEP_HANG_MIN_S": "30",
    "LOCKSTEP_DUMP_WAIT_S": "3",
    "LOCKSTEP_RESTART_BACKOFF_S": "1",
    "LOCKSTEP_RESTART_BACKOFF_MAX_S": "4",
    "LOCKSTEP_STRIKES_TO_CORDON": "1000",
    "LOCKSTEP_STARTUP_PROGRESS_TIMEOUT_S": "120",
    "LOCKSTEP_EARLY_FAILURES_USER_ERROR": "100",
}
# Defaults of settings we leave alone but that shape the numbers (recorded in the results).
PLATFORM_DEFAULTS = {
    "LOCKSTEP_SCHEDULER_TICK_S": "5",
    "LOCKSTEP_HANG_STEP_FACTOR": "10",
    "LOCKSTEP_STOP_GRACE_S": "60",
    "LOCKSTEP_KEEP_CHECKPOINTS": "3",
}


def log(msg: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- /proc helpers --------------------------------------------------------------------------


def proc_environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    env = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def proc_cmdline(pid: int) -> list[str]:
    try:
        return [p.decode() for p in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if p]
    except OSError:
        return []


def is_session_leader(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = stat[stat.rfind(")") + 2 :].split()
    return int(fields[3]) == pid  # field 6 of stat: session id


def my_pids(var_dir: Path) -> list[int]:
    """Every process whose environment names our LOCKSTEP_VAR_DIR (ours, nobody else's)."""
    mine = []
    for proc in Path("/proc").iterdir():
        if (
            proc.name.isdigit()
            and int(proc.name) != os.getpid()
            and proc_environ(int(proc.name)).get("LOCKSTEP_VAR_DIR") == str(var_dir)
        ):
            mine.append(int(proc.name))
    return mine


def worker_pids(var_dir: Path, attempt_id: int) -> dict[int, int]:
    """rank -> pid of the live workers of one attempt of our cluster."""
    found = {}
    for pid in my_pids(var_dir):
        env = proc_environ(pid)
        if env.get("LOCKSTEP_ATTEMPT_ID") == str(attempt_id) and is_session_leader(pid):
            found[int(env["RANK"])] = pid
    return found


def agent_pid(var_dir: Path, name: str) -> int | None:
    """The agent `name` of our cluster, found the way an operator would (pgrep -f)."""
    out = subprocess.run(
        ["pgrep", "-f", f"nodeagent.*--name {name}"], capture_output=True, text=True
    ).stdout.split()
    for pid in map(int, out):
        if str(var_dir / "agents" / name) in proc_cmdline(pid):
            return pid
    return None


# --- metric files ---------------------------------------------------------------------------


def read_records(path: Path, tail_bytes: int = 0) -> list[dict]:
    """JSON lines of a metrics file (only the last `tail_bytes` of it when given)."""
    records = []
    with contextlib.suppress(OSError), open(path, "rb") as f:
        if tail_bytes:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - tail_bytes))
        lines = f.read().decode(errors="replace").splitlines()
        for line in lines[1:] if tail_bytes else lines:
            with contextlib.suppress(ValueError):
                records.append(json.loads(line))
    return records


def rank0_file(var_dir: Path, attempt_id: int) -> Path | None:
    found = list((var_dir / "agents").glob(f"*/attempt-{attempt_id}/rank-0.metrics.jsonl"))
    return found[0] if found else None


def last_step_before(var_dir: Path, attempt_id: int, when: float) -> int | None:
    path = rank0_file(var_dir, attempt_id)
    if path is None:
        return None
    steps = [
        r["step"]
        for r in read_records(path)
        if r.get("kind") == "step" and r.get("time", 0) <= when
    ]
    return max(steps) if steps else None


# --- the platform ---------------------------------------------------------------------------


def snapshot_source(var_dir: Path) -> tuple[Path, str]:
    """HEAD's tree, extracted under `var_dir`/src for the platform to run; and HEAD's commit."""
    src = var_dir / "src"
    src.mkdir(parents=True)
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    archive = subprocess.run(["git", "archive", commit], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive.stdout, check=True)
    return src, commit


class Cluster:
    """`lockstep up` (portal, redis, rq worker, scheduler) plus our own two agents."""

    def __init__(self, var_dir: Path, src: Path, port: int, live_tree: bool):
        self.var = var_dir
        self.src = src
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.live_tree = live_tree
        self.up: subprocess.Popen | None = None
        self.agents: dict[str, subprocess.Popen] = {}
        self.token = ""
        self.api = requests.Session()
        self.env = dict(os.environ, **PLATFORM_ENV, LOCKSTEP_VAR_DIR=str(var_dir))
        self.env.pop("REDIS_URL", None)
        self.env.pop("DATABASE_URL", None)
        if not live_tree:
            self.env["PYTHONPATH"] = str(src)
        self.up_lines: list[str] = []

    def start(self) -> None:
        if self.live_tree:
            argv = [str(ROOT / ".venv/bin/lockstep"), "up"]
        else:
            code = "import sys; from portal.up import main; sys.exit(main(sys.argv[1:]))"
            argv = [PY, "-c", code]
        argv += ["--port", str(self.port), "--agents", "0", "--no-demo-job"]
        log(f"starting the platform in {self.var} (code from {self.src}) on {self.url}")
        self.up = subprocess.Popen(
            argv,
            cwd=self.src,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        up_log = open(self.var / "lockstep-up.out", "a")  # noqa: SIM115 (closed by the thread)
        ready = threading.Event()

        def pump():
            for line in self.up.stdout:
                up_log.write(line)
                up_log.flush()
                self.up_lines.append(line)
                if m := re.search(r"alice's API token: (\S+)", line):
                    self.token = m.group(1)
                    ready.set()
            up_log.close()
            ready.set()

        threading.Thread(target=pump, daemon=True).start()
        if not ready.wait(180) or not self.token:
            raise RuntimeError("lockstep up did not come up:\n" + "".join(self.up_lines[-30:]))
        self.api.headers["Authorization"] = f"Bearer {self.token}"
        agent_token = (self.var / "agent_token").read_text().strip()
        for name in ("local-a", "local-b"):
            argv = [
                PY, "-m", "nodeagent", "--portal", self.url, "--token", agent_token,
                "--gpus", "2", "--name", name, "--work-dir", str(self.var / "agents" / name),
            ]  # fmt: skip
            env = dict(
                self.env,
                DJANGO_SETTINGS_MODULE="portal.settings",
                PYTHONUNBUFFERED="1",
                LOCKSTEP_AGENT_TOKEN=agent_token,
            )
            self.agents[name] = self.spawn_agent(name, argv, env, cwd=str(self.src))
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            nodes = self.get("/api/v1/nodes/")["results"]
            if sum(n["gpus"] for n in nodes if n["state"] == "up") >= 4:
                log("both agents registered (4 CPU GPUs)")
                return
            time.sleep(0.5)
        raise RuntimeError("the agents did not register")

    def spawn_agent(self, name: str, argv: list[str], env: dict, cwd: str) -> subprocess.Popen:
        out = open(self.var / "logs" / f"agent-{name}.log", "ab")  # noqa: SIM115
        proc = subprocess.Popen(
            argv, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        out.close()
        return proc

    def get(self, path: str, **params):
        response = self.api.get(self.url + path, params=params or None, timeout=30)
        response.raise_for_status()
        return response.json()

    def post(self, path: str, body: dict | None = None):
        response = self.api.post(self.url + path, json=body or {}, timeout=30)
        if response.status_code >= 400:
            raise RuntimeError(f"POST {path}: {response.status_code} {response.text}")
        return response.json()

    def events(self, job_id: int) -> list[dict]:
        events, since = [], None
        while True:
            params = {"since_id": since} if since else {}
            page = self.get(f"/api/v1/jobs/{job_id}/events/", **params)
            events += page
            if len(page) < 1000:
                return events
            since = page[-1]["id"]

    def stop(self) -> list[int]:
        """Stop everything we started; returns the pids that had to be SIGKILLed at the end."""
        for pid in my_pids(self.var):  # a frozen process cannot act on SIGTERM
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        for proc in self.agents.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.agents.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(20)
        if self.up and self.up.poll() is None:
            self.up.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.up.wait(40)
        time.sleep(1)
        leftovers = my_pids(self.var)
        for pid in leftovers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return leftovers


# --- the job --------------------------------------------------------------------------------


class Monitor(threading.Thread):
    """Polls the job every `every` seconds: state, live attempt, portal's last step."""

    def __init__(self, cluster: Cluster, job_id: int, every: float = 2.0):
        super().__init__(daemon=True)
        self.cluster, self.job_id, self.every = cluster, job_id, every
        self.samples: list[dict] = []
        self.latest: dict | None = None
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            try:
                job = self.cluster.get(f"/api/v1/jobs/{self.job_id}/")
                live = [a for a in job["attempts"] if a["ended_at"] is None]
                sample = {
                    "t": time.time(),
                    "state": job["state"],
                    "attempt": live[0]["number"] if live else None,
                    "attempt_id": live[0]["id"] if live else None,
                    "attempt_state": live[0]["state"] if live else None,
                    "last_step": live[0]["last_step"] if live else None,
                    "resumed_from_step": live[0]["resumed_from_step"] if live else None,
                }
                self.latest = {**sample, "job": job}
                self.samples.append(sample)
            except (requests.RequestException, ValueError) as exc:
                self.samples.append({"t": time.time(), "error": str(exc)[:200]})
            self.halt.wait(self.every)

    def stepping(self, var_dir: Path, min_steps: int = 5) -> dict | None:
        """The live attempt if it runs and its rank 0 made a step in the last 5 s."""
        latest = self.latest
        if not latest or latest["attempt_state"] != "running":
            return None
        path = rank0_file(var_dir, latest["attempt_id"])
        if path is None:
            return None
        steps = [r for r in read_records(path, 4096) if r.get("kind") == "step"]
        if len(steps) < min_steps or time.time() - steps[-1]["time"] > 5:
            return None
        return latest


def trainer_command(steps: int, checkpoint_every: int) -> list[str]:
    return [
        "python", "-m", "trainer", "--steps", str(steps),
        "--checkpoint-every", str(checkpoint_every),
        # Pin the interval to the step count: without this the trainer would also save on the
        # portal's Young/Daly suggestion (LOCKSTEP_CHECKPOINT_INTERVAL_S), which moves as the
        # job's measured failure rate changes.
        "--checkpoint-interval-s", "0",
        "--log-every", "200",
    ]  # fmt: skip


def submit(cluster: Cluster, name: str, command: list[str], **extra) -> int:
    body = {
        "name": name,
        "team": "demo",
        "image": "lockstep/trainer:latest",
        "command": command,
        "dataset": "synthetic://addition",
        "gpus": 4,
        **extra,
    }
    return cluster.post("/api/v1/jobs/", body)["id"]


def wait_state(cluster: Cluster, job_id: int, states: set[str], timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = cluster.get(f"/api/v1/jobs/{job_id}/")
        if job["state"] in states:
            return job
        time.sleep(1)
    raise RuntimeError(f"job {job_id} not in {states} after {timeout:.0f}s")
