"""Chaos benchmark: a real 4-rank training job on two local agents, with failures injected at a
fixed rate, and the platform's own account of what each one cost.

    .venv/bin/python bench/chaos.py             # the full run: 15 min of chaos (about 20 min)
    .venv/bin/python bench/chaos.py --quick     # a ~3 min smoke run (a few incidents)
    .venv/bin/python bench/chaos.py --replot bench/results/chaos-2026-11-29.json

What it does:

1. Freezes the platform's code: `git archive HEAD` into a fresh LOCKSTEP_VAR_DIR under
   var/bench-chaos-<stamp>/ (`--tree live` runs the working tree instead), so edits made in the
   checkout during a 20 minute run cannot change the code under test half-way.
2. Starts `lockstep up --agents 0 --no-demo-job` there (embedded redis, fresh SQLite, daphne,
   rq worker, scheduler) with fast-detection settings (LOCKSTEP_* below, recorded in the
   results), and starts the two agents `local-a` and `local-b` (2 CPU "GPUs" each) itself, with
   exactly the command line `lockstep up` would use. It does so because `lockstep up` shuts the
   whole platform down as soon as one of its children dies, so an agent crash cannot be
   injected under it; here the bench plays systemd and restarts a killed agent.
3. Calibrates: a short 4-rank job without checkpoints gives the median step time; the checkpoint
   interval is then `--checkpoint-target-s` (30 s) worth of steps (`--checkpoint-every` pins it).
4. Submits one 4-GPU job over REST (`python -m trainer --steps 10000000 --checkpoint-every N
   --checkpoint-interval-s 0`, max_restarts 100), lets it train failure-free for `--baseline-s`,
   then injects one failure every `--interval-s`, in rotation: worker SIGKILL, worker SIGSTOP
   (a hang), agent SIGKILL + restart after 5 s, agent SIGSTOP past the heartbeat timeout +
   SIGCONT. An injection waits until the job is stepping again (the wait is logged).
5. After `--duration-s` of chaos (counted from the job's first step) and the last recovery,
   reads the job's goodput, events and checkpoints from the REST API and every rank-0 metric
   file, cancels the job, stops every process it started (and checks none is left), and writes
   bench/results/chaos-<date>[-quick].json and the figures under docs/figures/.

Times are epoch seconds on this machine's clock, which the portal, the agents and the workers
share, so injection times and portal event times can be subtracted.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
PY = str(ROOT / ".venv" / "bin" / "python")
KINDS = ("worker-kill", "worker-stop", "agent-kill", "agent-stop")
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
RANK_ROTATION = (3, 2, 1, 0)  # which rank a worker fault hits, by incident number


def log(msg: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def iso_epoch(value: str | None) -> float | None:
    if not value:
        return None
    return dt.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


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


# --- the run --------------------------------------------------------------------------------


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


def snapshot_source(var_dir: Path) -> tuple[Path, str]:
    src = var_dir / "src"
    src.mkdir(parents=True)
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    archive = subprocess.run(["git", "archive", commit], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive.stdout, check=True)
    return src, commit


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


def calibrate(cluster: Cluster, steps: int) -> dict:
    """A short 4-rank job without checkpoints: the failure-free step time."""
    log(f"calibration: a {steps}-step 4-rank job without checkpoints")
    job_id = submit(cluster, "chaos-calibration", trainer_command(steps, 0), max_restarts=0)
    job = wait_state(cluster, job_id, {"SUCCEEDED", "FAILED", "CANCELLED"}, 900)
    if job["state"] != "SUCCEEDED":
        raise RuntimeError(f"calibration job ended {job['state']}: {job['reason']}")
    records = read_records(rank0_file(cluster.var, job["attempts"][0]["id"]))
    steps_rec = [r for r in records if r.get("kind") == "step"]
    warm = steps_rec[len(steps_rec) // 5 :]  # skip the first fifth (warm-up, lazy inits)
    gaps = [b["time"] - a["time"] for a, b in zip(warm, warm[1:], strict=False)]
    result = {
        "job_id": job_id,
        "steps": steps,
        "median_step_time_s": median(r["step_time_s"] for r in warm),
        "median_step_interval_s": median(gaps),
        "p95_step_time_s": sorted(r["step_time_s"] for r in warm)[int(0.95 * len(warm)) - 1],
        "startup_s": (steps_rec[0]["time"] - iso_epoch(job["attempts"][0]["created_at"])),
    }
    log(
        "calibration: median step {:.1f} ms (interval between step records {:.1f} ms)".format(
            result["median_step_time_s"] * 1000, result["median_step_interval_s"] * 1000
        )
    )
    return result


def rank_node(var_dir: Path, pid: int) -> str:
    """The agent (node) a worker runs under, from its metrics path <work-dir>/attempt-N/..."""
    return Path(proc_environ(pid).get("LOCKSTEP_METRICS_PATH", "")).parent.parent.name


def pick_agent(spec: str, var_dir: Path, attempt_id: int) -> str:
    """`rank0`: the node that hosts rank 0; `other`: a node that does not; else a node name."""
    if spec not in ("rank0", "other"):
        return spec
    pids = worker_pids(var_dir, attempt_id)
    nodes = {rank: rank_node(var_dir, pid) for rank, pid in pids.items()}
    if spec == "rank0":
        return nodes[0]
    return next(n for n in sorted(set(nodes.values())) if n != nodes[0])


def inject(kind: str, number: int, seen: int, live: dict, cluster: Cluster, args) -> dict:
    """Inject failure number `number` (the `seen`-th of its kind) into the live attempt;
    returns what was done and when."""
    attempt_id = live["attempt_id"]
    record = {
        "n": number,
        "kind": kind,
        "attempt": live["attempt"],
        "attempt_id": attempt_id,
        "portal_last_step": live["last_step"],
    }
    if kind in ("worker-kill", "worker-stop"):
        # Kills take ranks 3, 1, ...; stops take ranks 2, 0, ...
        rank = RANK_ROTATION[(2 * seen + (kind == "worker-stop")) % len(RANK_ROTATION)]
        pids = worker_pids(cluster.var, attempt_id)
        if rank not in pids:
            raise RuntimeError(f"no live worker of rank {rank} in attempt {attempt_id}: {pids}")
        sig = signal.SIGKILL if kind == "worker-kill" else signal.SIGSTOP
        node = rank_node(cluster.var, pids[rank])
        record.update(rank=rank, pid=pids[rank], node=node)
        record["t"] = time.time()
        os.kill(pids[rank], sig)
        log(f"#{number} {kind}: rank {rank} pid {pids[rank]} on {node} ({sig.name})")
    else:
        victims = args.agent_victims.split(",")
        agent_faults = sum(1 for k in args.done_kinds if k.startswith("agent-"))
        spec = victims[agent_faults % len(victims)]
        name = pick_agent(spec, cluster.var, attempt_id)
        pid = agent_pid(cluster.var, name)
        if pid is None:
            raise RuntimeError(f"agent {name} not found")
        record.update(node=name, pid=pid, victim_spec=spec)
        if kind == "agent-kill":
            # Read what a supervisor would restart it with before it is gone.
            argv, env = proc_cmdline(pid), proc_environ(pid)
            cwd = os.readlink(f"/proc/{pid}/cwd")
            record["t"] = time.time()
            os.kill(pid, signal.SIGKILL)
            log(f"#{number} agent-kill: {name} ({spec}) pid {pid} SIGKILL")
            old = cluster.agents.get(name)
            if old is not None and old.pid == pid:
                old.wait(10)
            time.sleep(args.agent_restart_delay_s)
            cluster.agents[name] = cluster.spawn_agent(name, argv, env, cwd)
            record["restarted_at"] = time.time()
            record["new_pid"] = cluster.agents[name].pid
            log(f"#{number} agent-kill: {name} restarted as pid {record['new_pid']}")
        else:
            record["t"] = time.time()
            os.kill(pid, signal.SIGSTOP)
            log(
                f"#{number} agent-stop: {name} ({spec}) pid {pid} SIGSTOP "
                f"for {args.agent_freeze_s:.0f}s"
            )
            time.sleep(args.agent_freeze_s)
            os.kill(pid, signal.SIGCONT)
            record["resumed_at"] = time.time()
            log(f"#{number} agent-stop: {name} SIGCONT")
    args.done_kinds.append(kind)
    return record


def run(args) -> dict:
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    var_dir = (ROOT / "var" / f"bench-chaos-{stamp}{'-quick' if args.quick else ''}").resolve()
    var_dir.mkdir(parents=True)
    if args.tree == "head":
        src, commit = snapshot_source(var_dir)
    else:
        src = ROOT
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    (var_dir / "logs").mkdir(exist_ok=True)
    cluster = Cluster(var_dir, src, args.port or free_port(), live_tree=args.tree == "live")
    config = {
        "started": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "var_dir": str(var_dir),
        "code": {"tree": args.tree, "commit": commit},
        "platform_env": PLATFORM_ENV,
        "platform_defaults_kept": PLATFORM_DEFAULTS,
        "duration_s": args.duration_s,
        "baseline_s": args.baseline_s,
        "interval_s": args.interval_s,
        "min_tail_s": args.min_tail_s,
        "kinds": args.kinds.split(","),
        "worker_rank_rotation": list(RANK_ROTATION),
        "agent_victims": args.agent_victims.split(","),
        "agent_restart_delay_s": args.agent_restart_delay_s,
        "agent_freeze_s": args.agent_freeze_s,
        "cluster": "2 agents (local-a, local-b) x 2 CPU 'GPUs', one 4-rank gloo DDP job",
        "host": {"cpus": os.cpu_count(), "load_avg_at_start": os.getloadavg()},
    }
    monitor = None
    result: dict = {"config": config}
    try:
        cluster.start()
        calibration = calibrate(cluster, args.calibration_steps)
        result["calibration"] = calibration
        every = args.checkpoint_every or max(
            10, round(args.checkpoint_target_s / calibration["median_step_interval_s"])
        )
        config["checkpoint_every_steps"] = every
        config["checkpoint_target_s"] = args.checkpoint_target_s
        command = trainer_command(args.steps, every)
        config["command"] = command
        config["max_restarts"] = 100
        log(f"checkpoint every {every} steps (~{args.checkpoint_target_s:.0f}s at the median step)")
        job_id = submit(cluster, "chaos", command, max_restarts=100)
        config["job_id"] = job_id
        monitor = Monitor(cluster, job_id)
        monitor.start()
        wait_state(cluster, job_id, {"RUNNING"}, 300)
        while not monitor.stepping(var_dir):
            time.sleep(0.5)
        t0 = time.time()
        config["t0"] = t0
        log(f"job {job_id} is training; failure-free baseline for {args.baseline_s:.0f}s")
        kinds = args.kinds.split(",")
        injections: list[dict] = []
        end = t0 + args.duration_s
        number = 0
        while True:
            scheduled = t0 + args.baseline_s + number * args.interval_s
            if scheduled > end - args.min_tail_s:
                break
            time.sleep(max(0.0, scheduled - time.time()))
            live = monitor.stepping(var_dir)
            while live is None and time.time() < end - args.min_tail_s:
                time.sleep(0.5)
                live = monitor.stepping(var_dir)
            if live is None:
                log("the job is not stepping; no more injections")
                break
            kind = kinds[number % len(kinds)]
            record = inject(kind, number, args.done_kinds.count(kind), live, cluster, args)
            record["scheduled"] = scheduled
            record["delay_s"] = round(record["t"] - scheduled, 2)
            record["step_at_injection"] = last_step_before(var_dir, live["attempt_id"], record["t"])
            injections.append(record)
            number += 1
        # Wait out the chaos window, then for the last incident's recovery.
        time.sleep(max(0.0, end - time.time()))
        if injections:
            last = injections[-1]
            deadline = time.time() + args.recovery_grace_s
            while time.time() < deadline:
                live = monitor.stepping(var_dir)
                if live and live["attempt"] > last["attempt"]:
                    break
                time.sleep(1)
            time.sleep(10)  # a few steps of the recovered attempt for its goodput
        t_end = time.time()
        config["t_end"] = t_end
        log("chaos over; collecting results")
        monitor.halt.set()
        job = cluster.get(f"/api/v1/jobs/{job_id}/")
        events = cluster.events(job_id)
        checkpoints = cluster.get(f"/api/v1/jobs/{job_id}/checkpoints/")
        nodes = cluster.get("/api/v1/nodes/")["results"]
        with contextlib.suppress(RuntimeError):
            cluster.post(f"/api/v1/jobs/{job_id}/cancel/")
        files = {}
        for attempt in job["attempts"]:
            path = rank0_file(var_dir, attempt["id"])
            files[attempt["number"]] = read_records(path) if path else []
        result.update(
            injections=injections,
            job={k: v for k, v in job.items() if k != "attempts"},
            attempts=job["attempts"],
            checkpoints=checkpoints,
            nodes=nodes,
            monitor=monitor.samples,
        )
        result["events"] = [strip_event(e) for e in events]
        result["rank0"] = {n: compact_records(r) for n, r in files.items()}
        result["analysis"] = analyse(result)
    finally:
        if monitor:
            monitor.halt.set()
        log("stopping every process of this run")
        leftovers = cluster.stop()
        config["killed_leftovers"] = leftovers
        remaining = my_pids(var_dir)
        config["processes_left"] = remaining
        log(f"stopped ({len(leftovers)} leftover(s) SIGKILLed; {len(remaining)} remaining)")
    return result


def strip_event(event: dict) -> dict:
    data = dict(event.get("data") or {})
    if "stacks" in data:
        stacks = data.pop("stacks")
        data["stacks_ranks"] = sorted(stacks)
        data["stacks_chars"] = {rank: len(text) for rank, text in stacks.items()}
    return {**event, "data": data, "t": iso_epoch(event["created_at"])}


def compact_records(records: list[dict]) -> dict:
    """Rank 0's records of one attempt, as columns (steps: step, time, step_time_s)."""
    steps = [r for r in records if r.get("kind") == "step"]
    return {
        "start": next((r for r in records if r.get("kind") == "start"), None),
        "step": [r["step"] for r in steps],
        "time": [round(r["time"], 3) for r in steps],
        "step_time_s": [round(r["step_time_s"], 4) for r in steps],
        "checkpoints": [
            {k: r.get(k) for k in ("step", "time", "save_s", "bytes")}
            for r in records
            if r.get("kind") == "checkpoint"
        ],
    }


# --- analysis -------------------------------------------------------------------------------


def analyse(result: dict) -> dict:
    config, injections = result["config"], result["injections"]
    every = config["checkpoint_every_steps"]
    attempts = {a["number"]: a for a in result["attempts"]}
    rank0 = {int(k): v for k, v in result["rank0"].items()}
    incidents_portal = {i["attempt"]: i for i in result["job"]["goodput"]["incidents"]}
    events = result["events"]
    t0, t_end = config["t0"], config["t_end"]

    def gaps(numbers, lo, hi):
        out = []
        for n in numbers:
            times = [t for t in rank0.get(n, {}).get("time", []) if lo <= t <= hi]
            out += [b - a for a, b in zip(times, times[1:], strict=False)]
        return out

    first_injection = injections[0]["t"] if injections else t_end
    # Failure-free stretch: every attempt's steps between the job's first step and the first
    # injection (attempt 1 is not always the one: it can fail on its own before stepping).
    baseline_gaps = gaps(list(rank0), t0, first_injection)
    baseline_interval = median(baseline_gaps)
    all_gaps = gaps(list(rank0), t0, t_end)
    save_s = [c["save_s"] for n in rank0 for c in rank0[n]["checkpoints"] if c.get("save_s")]

    rows = []
    for inj in injections:
        number = inj["attempt"]
        mine = [e for e in events if e.get("attempt") == inj["attempt_id"]]
        hang = next((e for e in mine if e["kind"] == "attempt.hang_detected"), None)
        ended = next((e for e in mine if e["kind"] in ("attempt.failed", "attempt.lost")), None)
        detect_event = hang or ended
        following = attempts.get(number + 1)
        first_step_t = None
        if following and rank0.get(number + 1, {}).get("time"):
            first_step_t = rank0[number + 1]["time"][0]
        portal = incidents_portal.get(number, {})
        resumed = following["resumed_from_step"] if following else None
        step_at = inj.get("step_at_injection")
        known = step_at is not None and resumed is not None
        lost_at_injection = step_at - resumed if known else None
        per_step = median(gaps([number], 0, inj["t"])) or baseline_interval
        lost_work_s = lost_at_injection * per_step if lost_at_injection is not None else None
        downtime = first_step_t - inj["t"] if first_step_t else None
        row = {
            "n": inj["n"],
            "kind": inj["kind"],
            "target": inj.get("node") + (f" rank {inj['rank']}" if "rank" in inj else ""),
            "attempt": number,
            "injected_at": inj["t"],
            "t_rel_s": round(inj["t"] - t0, 1),
            "delay_s": inj.get("delay_s"),
            "detected_by": detect_event["kind"] if detect_event else None,
            "end_state": ended["kind"].split(".")[1] if ended else None,
            "end_reason": (attempts[number]["ended"] or {}).get("reason"),
            "detect_s": round(detect_event["t"] - inj["t"], 1) if detect_event else None,
            "ended_after_s": round(ended["t"] - inj["t"], 1) if ended else None,
            "recover_s": round(first_step_t - ended["t"], 1) if first_step_t and ended else None,
            "downtime_s": round(downtime, 1) if downtime else None,
            "portal_detect_s": portal.get("detect_s"),
            "portal_recover_s": portal.get("recover_s"),
            "portal_lost_steps": portal.get("lost_steps"),
            "portal_lost_s": portal.get("lost_s"),
            "step_at_injection": step_at,
            "resumed_from_step": resumed,
            "lost_steps_at_injection": lost_at_injection,
            "lost_work_s": round(lost_work_s, 1) if lost_work_s is not None else None,
            "cost_s": round(downtime + lost_work_s, 1)
            if downtime and lost_work_s is not None
            else None,
            "recovered": bool(following and first_step_t),
            "lost_within_interval": (
                max(lost_at_injection or 0, portal.get("lost_steps") or 0) <= every + 1
                if resumed is not None
                else None
            ),
        }
        row["phases"] = recovery_phases(events, ended, following, first_step_t)
        rows.append(row)

    injected = {inj["attempt"] for inj in injections}
    unplanned = [i for i in result["job"]["goodput"]["incidents"] if i["attempt"] not in injected]

    goodput = result["job"]["goodput"]
    wall = t_end - t0
    chaos_window = t_end - first_injection
    costs = [r["cost_s"] for r in rows if r["cost_s"] is not None]
    # Detect + recover per incident = injection -> the next attempt's first step (downtime).
    detect_recover = [r["downtime_s"] for r in rows]
    interval_s = every * (baseline_interval or 0)
    save_overhead = (median(save_s) or 0) / interval_s if interval_s else None
    mean_cost = statistics.mean(costs) if costs else None
    hangs = [r for r in rows if r["kind"] == "worker-stop"]
    summary = {
        "baseline_step_interval_s": baseline_interval,
        "all_step_interval_median_s": median(all_gaps),
        "checkpoint_every_steps": every,
        "checkpoint_interval_s_at_baseline": round(interval_s, 1),
        "median_save_s": median(save_s),
        "save_overhead_fraction": round(save_overhead, 4) if save_overhead else None,
        "incidents": len(rows),
        "unplanned_incidents": unplanned,
        "injection_rate_per_min": round(len(rows) / (wall / 60), 3),
        "run_wall_s": round(wall, 1),
        "chaos_window_s": round(chaos_window, 1),
        "final_step": max((s for r in rank0.values() for s in r["step"]), default=0),
        "portal_goodput": goodput,
        "portal_checkpoint_policy": result["job"].get("checkpoint_policy"),
        "mean_cost_s": round(mean_cost, 1) if mean_cost else None,
        "median_downtime_s": median(r["downtime_s"] for r in rows),
        "median_detect_s": median(r["detect_s"] for r in rows),
        "median_recover_s": median(r["recover_s"] for r in rows),
        "median_detect_plus_recover_s": median(detect_recover),
    }
    # Measured: over the chaos window only, progress made at the failure-free rate.
    window_steps = steps_kept_in(rank0, attempts, first_injection, t_end)
    if baseline_interval:
        summary["effective_chaos_window_measured"] = round(
            window_steps * baseline_interval / chaos_window, 4
        )
        summary["kept_steps_in_chaos_window"] = window_steps
    # Measured the portal's way: each kept step is worth its own attempt's median step time.
    own = 0.0
    for number, cols in rank0.items():
        following = attempts.get(number + 1)
        keep_until = following["resumed_from_step"] if following else float("inf")
        per_step = median(gaps([number], 0, float("inf")))
        if per_step:
            own += per_step * sum(
                1
                for step, t in zip(cols["step"], cols["time"], strict=False)
                if first_injection <= t <= t_end and step <= keep_until
            )
    summary["effective_chaos_window_measured_own_rate"] = round(own / chaos_window, 4)
    if mean_cost is not None:
        for mtbf in (300.0, config["interval_s"]):
            summary[f"effective_derived_at_mtbf_{int(mtbf)}s"] = round(
                1 - (save_overhead or 0) - mean_cost / mtbf, 4
            )
        model_cost = (summary["median_detect_plus_recover_s"] or 0) + interval_s / 2
        summary["effective_model_at_mtbf_300s"] = round(
            1 - (save_overhead or 0) - model_cost / 300.0, 4
        )
    by_kind = {}
    for kind in dict.fromkeys(r["kind"] for r in rows):
        mine = [r for r in rows if r["kind"] == kind]
        by_kind[kind] = {
            "n": len(mine),
            "median_detect_s": median(r["detect_s"] for r in mine),
            "median_recover_s": median(r["recover_s"] for r in mine),
            "median_downtime_s": median(r["downtime_s"] for r in mine),
            "mean_cost_s": round(statistics.mean(c), 1)
            if (c := [r["cost_s"] for r in mine if r["cost_s"] is not None])
            else None,
        }
    summary["by_kind"] = by_kind
    phases = [r["phases"] for r in rows if r["phases"]]
    if phases:
        summary["median_recovery_phases_s"] = {
            key: median(p[key] for p in phases) for key in phases[0]
        }
    kind_costs = [k["mean_cost_s"] for k in by_kind.values() if k["mean_cost_s"] is not None]
    if kind_costs:
        # Each kind weighted equally (the rotation over a short run need not hit them equally).
        balanced = statistics.mean(kind_costs)
        summary["kind_balanced_mean_cost_s"] = round(balanced, 1)
        summary["effective_derived_kind_balanced_at_mtbf_300s"] = round(
            1 - (save_overhead or 0) - balanced / 300.0, 4
        )
    stall = median(save_s)
    downtime = summary["median_detect_plus_recover_s"]
    if stall and downtime is not None:
        # What Young/Daly's interval would give this toy at one failure per 5 minutes.
        tau = (2 * stall * 300.0) ** 0.5
        summary["young_daly_tau_at_mtbf_300s"] = round(tau, 1)
        summary["effective_model_young_daly_at_mtbf_300s"] = round(
            1 - stall / tau - (downtime + tau / 2) / 300.0, 4
        )
    summary["goals"] = {
        "every_incident_recovered_without_a_human": all(r["recovered"] for r in rows),
        "lost_work_within_one_interval_plus_one_step": all(
            r["lost_within_interval"] for r in rows if r["lost_within_interval"] is not None
        ),
        "hang_detected_within_2_min": bool(hangs)
        and all(r["detect_s"] is not None and r["detect_s"] <= 120 for r in hangs),
        "effective_at_least_90pct_at_1_failure_per_5_min_derived": (
            summary.get("effective_derived_at_mtbf_300s", 0) >= 0.9
        ),
    }
    kinds = {}
    for e in events:
        kinds[e["kind"]] = kinds.get(e["kind"], 0) + 1
    return {"incidents": rows, "summary": summary, "event_counts": kinds}


def recovery_phases(events, ended, following, first_step_t) -> dict | None:
    """Where a recovery's time went, from the portal's events: backoff until the job is
    requeued, placement, launch (every rank spawned), trainer start-up (imports, rendezvous,
    checkpoint load) until the first step."""
    if not (ended and following and first_step_t):
        return None
    after = [e for e in events if e["t"] >= ended["t"]]
    requeued = next((e["t"] for e in after if e["kind"] == "job.requeued"), None)
    started = next(
        (
            e["t"]
            for e in after
            if e["kind"] == "attempt.started" and e["attempt"] == following["id"]
        ),
        None,
    )
    running = next(
        (
            e["t"]
            for e in after
            if e["kind"] == "attempt.running" and e["attempt"] == following["id"]
        ),
        None,
    )
    if None in (requeued, started, running):
        return None
    return {
        "backoff_and_requeue_s": round(requeued - ended["t"], 1),
        "placement_s": round(started - requeued, 1),
        "launch_s": round(running - started, 1),
        "trainer_start_to_first_step_s": round(first_step_t - running, 1),
    }


def steps_kept_in(rank0: dict, attempts: dict, lo: float, hi: float) -> int:
    """Steps completed in [lo, hi] whose result survived (not redone by a later attempt)."""
    kept = 0
    for number, cols in rank0.items():
        following = attempts.get(number + 1)
        keep_until = following["resumed_from_step"] if following else float("inf")
        kept += sum(
            1
            for step, t in zip(cols["step"], cols["time"], strict=False)
            if lo <= t <= hi and step <= keep_until
        )
    return kept


# --- figures and report ---------------------------------------------------------------------


COLORS = {
    "worker-kill": "tab:red",
    "worker-stop": "tab:purple",
    "agent-kill": "tab:orange",
    "agent-stop": "tab:brown",
}


def plot(result: dict, out_dir: Path, tag: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = result["config"]["t0"]
    rows = result["analysis"]["incidents"]
    every = result["config"]["checkpoint_every_steps"]
    fig, ax = plt.subplots(figsize=(11, 4.8))
    for number, cols in sorted(result["rank0"].items(), key=lambda kv: int(kv[0])):
        if not cols["time"]:
            continue
        xs = [(t - t0) / 60 for t in cols["time"]]
        ax.plot(xs, cols["step"], lw=1.2, label=f"attempt {number}")
        ck = [c for c in cols["checkpoints"] if c.get("time")]
        ax.scatter(
            [(c["time"] - t0) / 60 for c in ck],
            [c["step"] for c in ck],
            s=9,
            color="black",
            zorder=3,
            label="checkpoint"
            if not ax.get_legend_handles_labels()[1].count("checkpoint")
            else None,
        )
    for row in rows:
        x = row["t_rel_s"] / 60
        color = COLORS.get(row["kind"], "gray")
        ax.axvline(x, color=color, ls="--", lw=1)
        if row["downtime_s"]:
            ax.axvspan(x, x + row["downtime_s"] / 60, color=color, alpha=0.12)
        ax.annotate(
            row["kind"], (x, 1.0), xycoords=("data", "axes fraction"), rotation=90,
            va="top", ha="right", fontsize=8, color=color,
        )  # fmt: skip
    # The host is shared and its load drifts, so the reference slope is the whole run's median
    # step interval (the baseline stretch alone can be faster or slower than the rest).
    base = result["analysis"]["summary"]["all_step_interval_median_s"]
    if base:
        end = (result["config"]["t_end"] - t0) / 60
        first = rows_first_step(result)
        ax.plot([0, end], [first, first + end * 60 / base], color="gray", lw=0.8, ls=":",
                label="no failures, at the run's median step time")  # fmt: skip
    ax.set_xlabel("minutes since the job's first step")
    ax.set_ylabel("training step (rank 0)")
    ax.set_title(
        f"Chaos run: 4-rank job, checkpoint every {every} steps; "
        "dashed = injection, shaded = until the next attempt's first step"
    )
    ax.legend(fontsize=7, ncol=2, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    steps_png = out_dir / f"chaos-steps{tag}.png"
    fig.savefig(steps_png, dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(11, 4.2))
    labels = [f"#{r['n']} {r['kind']}\n{r['target']}" for r in rows]
    detect = [r["detect_s"] or 0 for r in rows]
    ended = [max((r["ended_after_s"] or 0) - (r["detect_s"] or 0), 0) for r in rows]
    recover = [r["recover_s"] or 0 for r in rows]
    lost = [r["lost_work_s"] or 0 for r in rows]
    xs = range(len(rows))
    ax.bar(xs, detect, color="tab:red", label="time to detect")
    ax.bar(xs, ended, bottom=detect, color="tab:pink", label="stack capture (hangs)")
    bottom = [a + b for a, b in zip(detect, ended, strict=True)]
    ax.bar(xs, recover, bottom=bottom, color="tab:blue", label="time to recover (to first step)")
    bottom = [a + b for a, b in zip(bottom, recover, strict=True)]
    ax.bar(xs, lost, bottom=bottom, color="tab:gray", label="work since the checkpoint (redone)")
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel("seconds")
    ax.set_title("Per-incident cost: detect + recover + recomputed steps")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    bars_png = out_dir / f"chaos-incidents{tag}.png"
    fig.savefig(bars_png, dpi=110)
    plt.close(fig)
    return [steps_png, bars_png]


def rows_first_step(result: dict) -> int:
    firsts = [cols["step"][0] for cols in result["rank0"].values() if cols["step"]]
    return min(firsts, default=0)


def report(result: dict) -> str:
    """A markdown table of the incidents and the summary, for docs/reliability.md."""
    rows = result["analysis"]["incidents"]
    s = result["analysis"]["summary"]
    lines = [
        "| # | kind | target | t (s) | detected by | detect (s) | portal detect_s | ended (s) "
        "| recover (s) | portal recover_s | downtime (s) | step at fault | resumed from "
        "| lost steps (at fault / portal) | lost work (s) | within N+1 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['n']} | {r['kind']} | {r['target']} | {r['t_rel_s']} | {r['detected_by']} "
            f"| {r['detect_s']} | {r['portal_detect_s']} | {r['ended_after_s']} "
            f"| {r['recover_s']} | {r['portal_recover_s']} | {r['downtime_s']} "
            f"| {r['step_at_injection']} | {r['resumed_from_step']} "
            f"| {r['lost_steps_at_injection']} / {r['portal_lost_steps']} | {r['lost_work_s']} "
            f"| {'yes' if r['lost_within_interval'] else 'NO'} |"
        )
    lines.append("")
    lines.append("```")
    lines.append(json.dumps(s, indent=1, default=str))
    lines.append("```")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="~3 min smoke run (sets shorter times)")
    p.add_argument("--duration-s", type=float, default=900, help="chaos window incl. baseline")
    p.add_argument("--baseline-s", type=float, default=90, help="failure-free stretch first")
    p.add_argument("--interval-s", type=float, default=150, help="one injection every N s")
    p.add_argument("--min-tail-s", type=float, default=60, help="no injection this close to end")
    p.add_argument("--recovery-grace-s", type=float, default=300)
    p.add_argument("--kinds", default=",".join(KINDS), help="rotation of failure kinds")
    p.add_argument(
        "--agent-victims",
        default="other,rank0",
        help="agent faults in turn hit: other (a node without rank 0), rank0 (rank 0's node), "
        "or a node name (local-a, local-b)",
    )
    p.add_argument("--agent-restart-delay-s", type=float, default=5)
    p.add_argument("--agent-freeze-s", type=float, default=20, help="> heartbeat timeout + tick")
    p.add_argument("--checkpoint-target-s", type=float, default=30)
    p.add_argument("--checkpoint-every", type=int, default=0, help="steps (0 = calibrate)")
    p.add_argument("--calibration-steps", type=int, default=300)
    p.add_argument("--steps", type=int, default=10_000_000)
    p.add_argument("--port", type=int, default=0)
    p.add_argument(
        "--tree",
        choices=("head", "live"),
        default="head",
        help="head: a git-archive snapshot of HEAD (default); live: the checkout",
    )
    p.add_argument("--out", type=Path, default=None, help="results JSON path")
    p.add_argument("--figures", type=Path, default=ROOT / "docs" / "figures")
    p.add_argument("--replot", type=Path, default=None, help="re-analyse and plot a results file")
    args = p.parse_args(argv)
    args.done_kinds = []
    if args.quick:
        args.duration_s, args.baseline_s, args.interval_s = 180, 20, 40
        args.min_tail_s, args.calibration_steps, args.checkpoint_target_s = 20, 150, 15
    tag = "-quick" if args.quick else ""
    if args.replot:
        result = json.loads(args.replot.read_text())
        result["analysis"] = analyse(result)
        args.replot.write_text(json.dumps(result, indent=1, default=str))
        out = args.replot
    else:
        result = run(args)
        out = args.out or ROOT / "bench" / "results" / f"chaos-{dt.date.today()}{tag}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1, default=str))
    if "analysis" not in result:
        log("no analysis (the run failed early)")
        return 1
    tag = "-quick" if "-quick" in out.name else ""
    figures = plot(result, args.figures, tag)
    print(report(result))
    log(f"results: {out}; figures: {', '.join(str(f) for f in figures)}")
    goals = result["analysis"]["summary"]["goals"]
    return 0 if all(goals.values()) else 2


if __name__ == "__main__":
    sys.exit(main())
