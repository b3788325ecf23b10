"""`lockstep up`: the whole platform on one machine, on the embedded defaults.

Starts the embedded Redis (unless REDIS_URL is set), migrates, creates the demo data, then runs
daphne, an rq worker, the scheduler and two local agents (2 GPUs each, CPU slots without a GPU),
submits a 4-GPU demo job that spans both agents, prints the URL and credentials, and supervises
everything until Ctrl-C, which stops every process it started (a second Ctrl-C kills what is
left at once). A start clears nothing: it runs over the state `var/` holds, uncordons its own
demo nodes where the strikes of its earlier runs cordoned them, and when it cannot start it
says each node's true state. One runs per var dir: a second start over the same state (or on a
port another program holds) is refused, exit 3, before it starts anything; what a killed one
left running is stopped first (portal/up_guard.py).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import requests

from nodeagent.exclusive import EXIT_WORK_DIR_HELD
from portal.embedded_redis import start_embedded_redis
from portal.up_guard import EXIT_REFUSED, alive, descendants, refusal

ROOT = Path(__file__).resolve().parent.parent
# About five minutes on a laptop's CPU with four ranks.
DEMO_STEPS = 2000
AGENTS_TIMEOUT_S = 60.0


def demo_command(steps: int) -> list[str]:
    return ["python", "-m", "trainer", "--steps", str(steps), "--checkpoint-every", "100"]


# Stopping, in stages (agents first: they stop their workers and may still tell the portal;
# then the platform; Redis last), each SIGTERM with a bounded wait, then SIGKILL for what is
# left. daphne documents SIGINT/SIGTERM for a graceful stop; it can hang at exit when a request
# was in flight (its worker threads wait on the stopped event loop), hence the SIGKILL after
# the timeout. A second Ctrl-C (or SIGTERM) during the stop kills what is left at once.
STOP_STAGES: tuple[tuple[str, float], ...] = (("agent-", 10.0), ("", 5.0), ("redis", 3.0))


class Supervisor:
    def __init__(self, log_dir: Path):
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.log_dir = log_dir
        self.stopping = False  # set by the first stop signal; later ones only hurry the stop
        self.hurry = False
        log_dir.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, argv: list[str], env: dict) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 (kept open for the child)
        proc = subprocess.Popen(
            argv, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.procs.append((name, proc))
        print(f"  started {name} (pid {proc.pid}, log {self.log_dir / (name + '.log')})")
        return proc

    def exited_with(self, prefix: str, status: int) -> bool:
        """Whether a process whose name starts with `prefix` exited with `status`."""
        return any(name.startswith(prefix) and proc.poll() == status for name, proc in self.procs)

    def started(self, prefix: str) -> bool:
        """Whether a process whose name starts with `prefix` was started here."""
        return any(name.startswith(prefix) for name, _proc in self.procs)

    def adopt(self, name: str, proc: subprocess.Popen) -> None:
        self.procs.append((name, proc))

    def dead(self) -> list[str]:
        return [f"{name} (exit {p.returncode})" for name, p in self.procs if p.poll() is not None]

    def on_signal(self, signum, frame) -> None:
        """SIGINT/SIGTERM: the first one stops (KeyboardInterrupt into the main flow); any
        later one, while stopping, kills what is still alive instead of interrupting the stop."""
        if self.stopping:
            if not self.hurry:
                print("  again: killing what is left", flush=True)
            self.hurry = True
            return
        self.stopping = True
        raise KeyboardInterrupt

    def stop_all(self) -> None:
        """Stop everything started, in STOP_STAGES order; returns when every process started
        here, and every process below them, is gone."""
        self.stopping = True
        seen = descendants(os.getpid())
        done: set[int] = set()
        for prefix, grace in STOP_STAGES:
            stage = [
                (name, proc)
                for name, proc in reversed(self.procs)
                if id(proc) not in done and name.startswith(prefix)
            ]
            done.update(id(proc) for _name, proc in stage)
            seen.update(descendants(os.getpid()))
            self._stop_stage(stage, grace)
        self._kill_leftovers(seen)

    def _stop_stage(self, stage: list[tuple[str, subprocess.Popen]], grace: float) -> None:
        for _name, proc in stage:
            if proc.poll() is None:
                _signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while any(proc.poll() is None for _name, proc in stage):
            if self.hurry or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        for name, proc in stage:
            if proc.poll() is None:
                if not self.hurry:
                    print(f"  {name} did not stop within {grace:.0f}s; killing it", flush=True)
                _signal_group(proc.pid, signal.SIGKILL)
            else:
                # Whatever the leader left in its process group goes with it.
                _signal_group(proc.pid, signal.SIGKILL)
        for _name, proc in stage:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:  # unkillable (D state): nothing more to do
                pass

    def _kill_leftovers(self, seen: dict[int, int]) -> None:
        """SIGKILL every process that was below us during the stop and still lives (an agent's
        workers in sessions of their own, an rq work horse), then wait for them briefly."""
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            left = alive(seen)
            if not left:
                return
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _agent_token_file(var: Path) -> Path:
    """The cluster agent token's file (mode 600), made on the first run. The portal and the
    agents read it from there (LOCKSTEP_AGENT_TOKEN_FILE, --token-file): the token itself is
    never on a command line or in an environment a job could read. A token given in
    $LOCKSTEP_AGENT_TOKEN is moved into the file."""
    path = var / "agent_token"
    given = os.environ.pop("LOCKSTEP_AGENT_TOKEN", None)
    if given or not path.exists():
        path.touch(mode=0o600)
        path.chmod(0o600)
        path.write_text(given or secrets.token_urlsafe(32))
    path.chmod(0o600)
    return path


def _wait_http(url: str, timeout: float, sup: Supervisor) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sup.dead():
            raise RuntimeError(f"a process exited during start-up: {', '.join(sup.dead())}")
        try:
            requests.get(url, timeout=10)
            return
        except requests.ConnectionError:
            time.sleep(0.3)
        except requests.Timeout:  # the first request imports the views: slow on a busy laptop
            pass
    raise RuntimeError(f"{url} did not answer within {timeout:.0f}s")


def _prepare(py: str, env: dict, var: Path, sup: Supervisor) -> dict:
    """Redis (unless REDIS_URL names one), migrations, the demo team and users: the demo's
    passwords and token."""
    if "REDIS_URL" not in os.environ:
        sup.adopt(
            "redis",
            start_embedded_redis(var / "redis.sock", log_path=var / "logs" / "redis.log"),
        )
        print(f"  started embedded redis on {var / 'redis.sock'}")
    subprocess.run(
        [py, "manage.py", "migrate", "--noinput", "-v", "0"], env=env, cwd=ROOT, check=True
    )
    seeded = subprocess.run(
        # The passwords and token handed out at the first start are handed out again, so a
        # restart logs nobody out (seed_demo's docstring).
        [py, "manage.py", "seed_demo", "--keep", str(var / "demo-credentials.json")],
        env=env,
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(seeded.stdout.strip().splitlines()[-1])


def _start_platform(py: str, env: dict, port: int, sup: Supervisor) -> None:
    daphne = [py, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "portal.asgi:application"]
    sup.start("portal", daphne, env)
    sup.start("rqworker", [py, "manage.py", "rqworker", "default", "--with-scheduler"], env)
    sup.start("scheduler", [py, "manage.py", "run_scheduler"], env)


DEMO_IMAGE = "lockstep/trainer:latest"


def _agent_runtime() -> str:
    """How the local agents run jobs: $LOCKSTEP_AGENT_RUNTIME if set; else in containers of
    the trainer's image where podman has it (`make up` builds it when podman is installed),
    else as plain processes (not isolated; the banner says so)."""
    wanted = os.environ.get("LOCKSTEP_AGENT_RUNTIME")
    if wanted:
        return wanted
    podman = shutil.which("podman")
    if podman is None:
        return "process"
    found = subprocess.run(
        [podman, "image", "inspect", DEMO_IMAGE], capture_output=True, check=False, timeout=60
    )
    return "auto" if found.returncode == 0 else "process"


def _runtime_line(nodes: dict[str, dict]) -> str:
    runtimes = {(n.get("runtime"), n.get("engine")) for n in nodes.values()}
    if runtimes and all(runtime == "container" for runtime, _ in runtimes):
        engines = ", ".join(sorted({engine for _, engine in runtimes}))
        return f"jobs run in their own images ({engines} containers, isolated)"
    return (
        "jobs run as plain processes of this user: NOT isolated (no container engine or no "
        f"{DEMO_IMAGE} image; install podman and run `make image`, see docs/runtime.md)"
    )


def _agent_names(count: int) -> list[str]:
    return [f"local-{chr(ord('a') + i)}" for i in range(count)]


def _remove_agent_containers(var: Path, names: list[str]) -> int:
    """Remove every container this run's agents left listed. An agent removes its own when it
    stops, but one that overran its stop's grace (a slow save on a loaded machine) was killed
    before it could, and the container outlived `make up`'s stop. Returns how many went."""
    podman = shutil.which("podman")
    if podman is None:
        return 0
    from nodeagent.container import Engine, EngineError, agent_identity

    engine = Engine("podman", podman)
    dirs = [var / "agents" / name for name in names]
    try:
        return sum(engine.remove_all(agent_identity(d)) for d in dirs if d.is_dir())
    except EngineError as exc:  # the stop goes on; what is left is podman's to show
        print(f"  cannot remove the agents' containers: {exc}", flush=True)
        return 0


def _start_agents(py: str, env: dict, url: str, args, var: Path, sup: Supervisor) -> None:
    runtime = _agent_runtime()
    for name in _agent_names(args.agents):
        sup.start(
            f"agent-{name}",
            [
                py,
                "-m",
                "nodeagent",
                "--portal",
                url,
                "--token-file",
                env["LOCKSTEP_AGENT_TOKEN_FILE"],
                "--runtime",
                runtime,
                "--gpus",
                str(args.gpus_per_agent),
                "--name",
                name,
                "--work-dir",
                str(var / "agents" / name),
            ],
            env,
        )


def _local_nodes(api: requests.Session, url: str, names: list[str]) -> dict[str, dict]:
    nodes = api.get(url + "/api/v1/nodes/", params={"page_size": 1000}, timeout=5).json()
    return {n["name"]: n for n in nodes["results"] if n["name"] in names}


def _registered(node: dict | None, since: datetime) -> bool:
    """Registered by this run's agent: its last word came after the agents were started (an
    earlier run's node row may still say `up` for a heartbeat timeout after it stopped)."""
    return node is not None and datetime.fromisoformat(node["last_heartbeat_at"]) >= since


def node_report(nodes: dict[str, dict], names: list[str], since: datetime, log_dir: Path) -> str:
    """One line per local node with its true state: not registered (and where its log is),
    or registered and up, cordoned, draining or down, with the reason."""
    lines = []
    for name in names:
        node = nodes.get(name)
        if not _registered(node, since):
            lines.append(f"  {name}: not registered; see {log_dir / f'agent-{name}.log'}")
        elif node["state"] == "up":
            lines.append(f"  {name}: registered, up ({node['gpus']} GPUs)")
        else:
            reason = f": {node['state_reason']}" if node["state_reason"] else ""
            lines.append(f"  {name}: registered but {node['state']}{reason}")
    return "\n".join(lines)


def _wait_for_agents(
    api: requests.Session, url: str, names: list[str], since: datetime, sup: Supervisor, log_dir
) -> dict[str, dict]:
    """Until every local agent has registered (whatever state its node is in)."""
    deadline = time.monotonic() + AGENTS_TIMEOUT_S
    while True:
        nodes = _local_nodes(api, url, names)
        if all(_registered(nodes.get(name), since) for name in names):
            return nodes
        dead = sup.dead()
        if dead or time.monotonic() > deadline:
            why = f"{', '.join(dead)} exited" if dead else f"not within {AGENTS_TIMEOUT_S:.0f}s"
            raise RuntimeError(
                f"the agents did not all register ({why}):\n"
                + node_report(nodes, names, since, log_dir)
            )
        time.sleep(0.5)


def _release_automatic_cordons(py: str, env: dict, names: list[str]) -> None:
    """Demo nodes cordoned by the strikes of up's own earlier runs (each restart of an agent
    with a job on it counted as a failure) are uncordoned, with a node.uncordoned event; an
    admin's cordon or drain stays."""
    if not names:
        return
    done = subprocess.run(
        [
            py,
            "manage.py",
            "release_automatic_cordons",
            "--by",
            "lockstep up",
            "--reason",
            "a local demo node of lockstep up; its strikes came from earlier runs of up",
            *names,
        ],
        env=env,
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    )
    for line in done.stdout.strip().splitlines()[:-1]:
        print(f"  {line}")


def _check_nodes(
    api: requests.Session, url: str, names: list[str], since: datetime, sup: Supervisor, log_dir
) -> None:
    """Every local node up, or a warning with the true state of those that are not (a node an
    admin cordoned stays so; the platform runs, its jobs wait for GPUs)."""
    deadline = time.monotonic() + 10
    while True:
        nodes = _local_nodes(api, url, names)
        if all(nodes[name]["state"] == "up" for name in names) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if not all(nodes[name]["state"] == "up" for name in names):
        print(
            "  warning: not every local node takes work (uncordon one in the console's Nodes "
            "page or with POST /api/v1/nodes/ID/uncordon/):\n"
            + node_report(nodes, names, since, log_dir),
            flush=True,
        )


def _submit_demo_job(api: requests.Session, url: str, total: int, steps: int) -> None:
    """Something live to look at, unless a job already runs (a restarted `make up`)."""
    live = api.get(
        url + "/api/v1/jobs/",
        params={"state": "QUEUED,STARTING,RUNNING,RESTARTING"},
        timeout=5,
    ).json()
    if live["count"] == 0:
        gpus = min(4, total)
        job = api.post(
            url + "/api/v1/jobs/",
            timeout=10,
            json={
                "name": "demo-addition",
                "team": "demo",
                "image": "lockstep/trainer:latest",
                "command": demo_command(steps),
                "dataset": "synthetic://addition",
                "gpus": gpus,
            },
        ).json()
        print(f"  submitted demo job {job['id']} ({gpus} GPUs across the agents)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lockstep up", description=__doc__)
    parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8000")))
    parser.add_argument("--agents", type=int, default=2)
    parser.add_argument("--gpus-per-agent", type=int, default=2)
    parser.add_argument("--no-demo-job", action="store_true")
    parser.add_argument(
        "--demo-steps",
        type=int,
        default=int(os.environ.get("LOCKSTEP_UP_DEMO_STEPS", DEMO_STEPS)),
        help="training steps of the demo job (default %(default)s, about five minutes)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="only say whether a start would be refused because a lockstep up already runs "
        "over this var dir (exit 3), and start nothing: `make up` asks before it builds",
    )
    args = parser.parse_args(argv)
    var = Path(os.environ.get("LOCKSTEP_VAR_DIR", ROOT / "var")).resolve()
    var.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{args.port}"
    # Before anything starts, and outside the stop below: a refused start touches nothing.
    try:
        refused = refusal(var, args.port, url, check_only=args.check)
    except KeyboardInterrupt:  # during the stop of a killed run's leftovers
        print("\nlockstep up: interrupted before it started anything", file=sys.stderr)
        return 130
    if refused:
        print(f"lockstep up: {refused}", file=sys.stderr)
        return EXIT_REFUSED
    if args.check:
        return 0
    env = dict(
        os.environ,
        DJANGO_SETTINGS_MODULE="portal.settings",
        PYTHONUNBUFFERED="1",
        LOCKSTEP_VAR_DIR=str(var),
    )
    env["LOCKSTEP_AGENT_TOKEN_FILE"] = str(_agent_token_file(var))
    env.pop("LOCKSTEP_AGENT_TOKEN", None)
    sup = Supervisor(var / "logs")
    # SIGINT too: a shell that starts us in the background sets SIGINT to "ignore".
    signal.signal(signal.SIGTERM, sup.on_signal)
    signal.signal(signal.SIGINT, sup.on_signal)
    py = sys.executable
    try:
        demo = _prepare(py, env, var, sup)
        _start_platform(py, env, args.port, sup)
        _wait_http(url + "/login/", 60, sup)
        api = requests.Session()
        api.headers["Authorization"] = f"Bearer {demo['alice_token']}"
        names = _agent_names(args.agents)
        since = datetime.now(UTC)
        _start_agents(py, env, url, args, var, sup)
        nodes = _wait_for_agents(api, url, names, since, sup, var / "logs")
        _release_automatic_cordons(py, env, names)
        _check_nodes(api, url, names, since, sup, var / "logs")
        total = args.agents * args.gpus_per_agent
        if not args.no_demo_job:
            _submit_demo_job(api, url, total, args.demo_steps)
        print(
            f"""
Lockstep is up: {url}
  admin / {demo["admin_password"] or "(the password you set)"}   (cluster admin)
  alice / {demo["alice_password"] or "(the password you set)"}   (researcher in team demo)
  alice's API token: {demo["alice_token"]}
  try:  LOCKSTEP_TOKEN={demo["alice_token"]} .venv/bin/lockstep jobs
  {_runtime_line(nodes)}
Logs in {var / "logs"}. Ctrl-C stops everything.""",
            flush=True,
        )
        while True:
            dead = sup.dead()
            if dead:
                print(f"lockstep up: {', '.join(dead)} stopped; shutting down", file=sys.stderr)
                return 1
            time.sleep(1)
    except KeyboardInterrupt:
        print("\nstopping... (Ctrl-C again kills what is left)", flush=True)
        return 0
    except (RuntimeError, subprocess.CalledProcessError, requests.RequestException) as exc:
        print(f"lockstep up: {exc}", file=sys.stderr)
        return 1
    finally:
        sup.stop_all()
        # Only this run's agents' containers, and none where an agent found its work dir
        # held: the holder's containers are live (nodeagent/cli.py, EXIT_WORK_DIR_HELD).
        if sup.started("agent-") and not sup.exited_with("agent-", EXIT_WORK_DIR_HELD):
            left = _remove_agent_containers(var, _agent_names(args.agents))
            if left:
                print(f"  removed {left} container(s) an agent left behind", flush=True)
        print("stopped", flush=True)


if __name__ == "__main__":  # `lockstep up` hands over to `python -m portal.up`
    sys.exit(main())
