"""`lockstep up`: the whole platform on one machine, on the embedded defaults.

Starts the embedded Redis (unless REDIS_URL is set), migrates, creates the demo data, then runs
daphne, an rq worker, the scheduler and two local agents (2 GPUs each, CPU slots without a GPU),
submits a 4-GPU demo job that spans both agents, prints the URL and credentials, and supervises
everything until Ctrl-C, which stops every process it started.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import requests

from portal.embedded_redis import start_embedded_redis

ROOT = Path(__file__).resolve().parent.parent
# About five minutes on a laptop's CPU with four ranks.
DEMO_COMMAND = ["python", "-m", "trainer", "--steps", "2000", "--checkpoint-every", "100"]


class Supervisor:
    def __init__(self, log_dir: Path):
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, argv: list[str], env: dict) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 (kept open for the child)
        proc = subprocess.Popen(
            argv, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.procs.append((name, proc))
        print(f"  started {name} (pid {proc.pid}, log {self.log_dir / (name + '.log')})")
        return proc

    def adopt(self, name: str, proc: subprocess.Popen) -> None:
        self.procs.append((name, proc))

    def dead(self) -> list[str]:
        return [f"{name} (exit {p.returncode})" for name, p in self.procs if p.poll() is not None]

    def stop_all(self) -> None:
        # Agents first (they stop their workers), then the rest, Redis last.
        for _name, proc in reversed(self.procs):
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 10
        for name, proc in reversed(self.procs):
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                print(f"  {name} did not stop; killing it")
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _agent_token(var: Path) -> str:
    token = os.environ.get("LOCKSTEP_AGENT_TOKEN")
    if token:
        return token
    path = var / "agent_token"
    if not path.exists():
        path.write_text(secrets.token_urlsafe(32))
        path.chmod(0o600)
    return path.read_text().strip()


def _wait_http(url: str, timeout: float, sup: Supervisor) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sup.dead():
            raise RuntimeError(f"a process exited during start-up: {', '.join(sup.dead())}")
        try:
            requests.get(url, timeout=2)
            return
        except requests.ConnectionError:
            time.sleep(0.3)
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
        [py, "manage.py", "seed_demo"],
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


def _start_agents(py: str, env: dict, url: str, args, var: Path, sup: Supervisor) -> None:
    for i in range(args.agents):
        name = f"local-{chr(ord('a') + i)}"
        sup.start(
            f"agent-{name}",
            [
                py,
                "-m",
                "nodeagent",
                "--portal",
                url,
                "--token",
                env["LOCKSTEP_AGENT_TOKEN"],
                "--gpus",
                str(args.gpus_per_agent),
                "--name",
                name,
                "--work-dir",
                str(var / "agents" / name),
            ],
            env,
        )


def _wait_for_agents(api: requests.Session, url: str, total: int, sup: Supervisor) -> None:
    deadline = time.monotonic() + 60
    while (
        sum(
            n["gpus"]
            for n in api.get(url + "/api/v1/nodes/", timeout=5).json()["results"]
            if n["state"] == "up"
        )
        < total
    ):
        if time.monotonic() > deadline or sup.dead():
            raise RuntimeError("the agents did not register; see var/logs/agent-*.log")
        time.sleep(0.5)


def _submit_demo_job(api: requests.Session, url: str, total: int) -> None:
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
                "command": DEMO_COMMAND,
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
    args = parser.parse_args(argv)

    def on_term(signum, frame):
        raise KeyboardInterrupt

    # SIGINT too: a shell that starts us in the background sets SIGINT to "ignore".
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    var = Path(os.environ.get("LOCKSTEP_VAR_DIR", ROOT / "var")).resolve()
    var.mkdir(parents=True, exist_ok=True)
    env = dict(
        os.environ,
        DJANGO_SETTINGS_MODULE="portal.settings",
        PYTHONUNBUFFERED="1",
        LOCKSTEP_VAR_DIR=str(var),
    )
    env["LOCKSTEP_AGENT_TOKEN"] = _agent_token(var)
    sup = Supervisor(var / "logs")
    py = sys.executable
    url = f"http://127.0.0.1:{args.port}"
    try:
        demo = _prepare(py, env, var, sup)
        _start_platform(py, env, args.port, sup)
        _wait_http(url + "/login/", 60, sup)
        _start_agents(py, env, url, args, var, sup)
        api = requests.Session()
        api.headers["Authorization"] = f"Bearer {demo['alice_token']}"
        total = args.agents * args.gpus_per_agent
        _wait_for_agents(api, url, total, sup)
        if not args.no_demo_job:
            _submit_demo_job(api, url, total)
        print(
            f"""
Lockstep is up: {url}
  admin / {demo["admin_password"]}   (cluster admin)
  alice / {demo["alice_password"]}   (researcher in team demo)
  alice's API token: {demo["alice_token"]}
  try:  LOCKSTEP_TOKEN={demo["alice_token"]} .venv/bin/lockstep jobs
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
        print("\nstopping...")
        return 0
    except (RuntimeError, subprocess.CalledProcessError, requests.RequestException) as exc:
        print(f"lockstep up: {exc}", file=sys.stderr)
        return 1
    finally:
        sup.stop_all()


if __name__ == "__main__":  # `lockstep up` hands over to `python -m portal.up`
    sys.exit(main())
