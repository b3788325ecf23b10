"""Hollow nodes (issue 20): simulated nodes that speak the real agent protocol to a real portal,
so the portal, its database, the channel layer and the scheduler carry a cluster's load
without a cluster (Kubernetes' kubemark does the same for the API server).

A hollow node registers with the cluster agent token, then heartbeats at the interval the
portal gives it: for every attempt the portal wants it to run, each local rank is reported
running, with one step record per rank every `step_s` (loss, tokens/s, step time, compute
time) and a log line now and then, plus one telemetry reading per GPU; after `steps` steps
its ranks exit 0, so jobs finish and the real scheduler places the next ones. A stop (a
preemption, a cancel) is obeyed at once. Unacknowledged records are sent again, as the real
agent does. Each step's `loss` is the time the rank "wrote" it, so a watcher that receives the
point over the job's websocket knows the lag.

Watchers open the job page's websocket (`ws/jobs/{id}/`) with a user's token and count every
metric point they receive, by (rank, step, name), so the harness can check that each point
reached each watcher exactly once.

    .venv/bin/python bench/hollow.py --nodes 64 --gpus 8 --jobs 40 --watchers 50 --seconds 60
    # starts its own portal (tests/live.LiveCluster, no real agents; --portals daphne
    # processes) and writes bench/results/hollow.json. The full-size run of docs/production.md:
    .venv/bin/python bench/hollow.py --nodes 512 --jobs 0 --queued 10000 --watchers 200 \
        --heartbeat-s 16 --step-s 16 --seconds 160 --portals 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.hollow_probes import (  # noqa: E402
    PassSampler,
    ProcessSampler,
    database_bytes,
    logged_errors,
    machine_probe_s,
    metric_tiers,
)
from bench.hollow_report import Stats, goals, metric_budget, summary  # noqa: E402
from bench.hollow_watchers import Watcher  # noqa: E402
from jobs.settings_table import DEFAULTS  # noqa: E402
from nodeagent.agent import jittered  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
REGISTER_PATH = "/api/v1/agent/register/"
HEARTBEAT_PATH = "/api/v1/agent/heartbeat/"


STEP_NAMES = ("loss", "tokens_per_s", "step_time_s", "compute_s")
# Settings the suite's live clusters shorten (tests/live.py) that a load run keeps at their
# production defaults.
PRODUCTION_SETTINGS = (
    "HANG_MIN_S",
    "DUMP_WAIT_S",
    "GPU_SAMPLE_S",
    "STRAGGLER_WINDOW_STEPS",
    "STRAGGLER_CHECK_S",
    "STRAGGLER_MIN_EXCESS_S",
    "STRIKES_TO_CORDON",
    "STRAGGLER_MAX_MOVES",
    "RECLAIM_BACKOFF_S",
    "RECLAIM_GANG_EXEMPT_S",
    "RESTART_BACKOFF_S",
    "STOP_GRACE_S",
    "ELASTIC_GROW_AFTER_S",
)


class HollowNode(threading.Thread):
    def __init__(
        self,
        url: str,
        cluster_token: str,
        name: str,
        *,
        gpus: int,
        steps: int,
        step_s: float,
        stats: Stats,
        stop: threading.Event,
        go: threading.Event,
    ) -> None:
        super().__init__(name=f"hollow-{name}", daemon=True)
        self.go = go  # ranks step only once the watchers are connected
        self.registered = threading.Event()
        self.url, self.cluster_token, self.node = url.rstrip("/"), cluster_token, name
        self.gpus, self.steps, self.step_s = gpus, steps, step_s
        self.stats, self.stop = stats, stop
        self.http = requests.Session()
        self.heartbeat_s = 1.0
        self.token = ""
        self.boot = f"hollow-{name}-{time.time_ns()}"
        # attempt id -> {"launch": ..., "started": t, "step": n, "pending": [records], "done": t}
        self.attempts: dict[int, dict[str, Any]] = {}

    def register(self) -> None:
        body = {
            "name": self.node,
            "gpus": self.gpus,
            "gpu_kind": "cpu",
            "hostname": self.node,
            "address": "127.0.0.1",
            "rack": f"rack-{hash(self.node) % 16}",
            "boot_id": self.boot,
            "runtime": "container",
            "engine": "podman",
        }
        response = self.http.post(
            self.url + REGISTER_PATH,
            json=body,
            headers={"Authorization": f"Bearer {self.cluster_token}"},
            timeout=30,
        )
        response.raise_for_status()
        data = response.json()
        self.token, self.heartbeat_s = data["node_token"], float(data.get("heartbeat_s", 1.0))

    def run(self) -> None:
        try:
            self.register()
        except requests.RequestException as exc:
            self.stats.error(f"register: {type(exc).__name__}")
            return
        finally:
            self.registered.set()
        next_beat = time.monotonic()
        while not self.stop.is_set():
            self.stop.wait(max(0.0, next_beat - time.monotonic()))
            next_beat = time.monotonic() + jittered(self.heartbeat_s)  # as the real agent
            if not self.stop.is_set():
                self.beat()

    def _advance(self, now: float) -> None:
        """Each running rank's steps since the last beat, as records waiting to be sent."""
        for state in self.attempts.values():
            if state["done"] is not None:
                continue
            if not self.go.is_set():
                state["started"] = now  # placed, not yet stepping
                continue
            due = min(self.steps, int((now - state["started"]) / self.step_s))
            launch = state["launch"]
            for step in range(state["step"] + 1, due + 1):
                at = state["started"] + step * self.step_s
                for entry in launch["ranks"]:
                    rank = int(entry["rank"])
                    state["pending"].append(
                        {
                            "kind": "step",
                            "rank": rank,
                            "step": step,
                            "loss": at,  # the time it was "written": the watchers' lag
                            "tokens_per_s": 1000.0,
                            "step_time_s": self.step_s,
                            "compute_s": self.step_s / 2,
                            "time": at,
                        }
                    )
            state["step"] = max(state["step"], due)
            if state["step"] >= self.steps:
                state["done"] = now

    def beat(self) -> None:
        now = time.time()
        self._advance(now)
        reports, sent = [], {}
        for attempt_id, state in self.attempts.items():
            records = state["pending"][:2000]
            sent[attempt_id] = len(records)
            exited = state["done"] is not None and len(records) == len(state["pending"])
            ranks = [
                {
                    "rank": int(e["rank"]),
                    "pid": 10000 + int(e["rank"]),
                    "state": "exited" if exited else "running",
                    "exit_code": 0 if exited else None,
                    **(
                        {"exited_at": state["done"]}
                        if exited
                        else {"cpu_s": now - state["started"]}
                    ),
                }
                for e in state["launch"]["ranks"]
            ]
            logs = (
                [
                    {
                        "rank": int(state["launch"]["ranks"][0]["rank"]),
                        "text": f"step {state['step']}\n",
                    }
                ]
                if records
                else []
            )
            reports.append(
                {"attempt_id": attempt_id, "ranks": ranks, "records": records, "logs": logs}
            )
        body = {
            "boot_id": self.boot,
            "telemetry": [
                {"index": i, "kind": "cpu", "util": 50.0, "mem_used": 0, "mem_total": 0}
                for i in range(self.gpus)
            ],
            "attempts": reports,
        }
        sent_wall = time.time()
        with self.stats.lock:
            for state in self.attempts.values():
                job, number = state["launch"]["job_id"], state["launch"]["attempt"]
                for record in state["pending"][:2000]:
                    key = (job, number, record["rank"], record["step"])
                    self.stats.sent_at.setdefault(key, sent_wall)
        started = time.monotonic()
        try:
            response = self.http.post(
                self.url + HEARTBEAT_PATH,
                json=body,
                headers={"Authorization": f"Bearer {self.token}"},
                timeout=30,
            )
        except requests.RequestException as exc:
            self.stats.error(f"heartbeat: {type(exc).__name__}")
            return
        if response.status_code != 200:
            self.stats.error(f"heartbeat: HTTP {response.status_code}")
            return
        self.stats.beat(time.monotonic() - started, server_s(response))
        with self.stats.lock:
            for attempt_id, count in sent.items():
                state = self.attempts[attempt_id]
                job, number = state["launch"]["job_id"], state["launch"]["attempt"]
                for record in state["pending"][:count]:
                    for name in STEP_NAMES:
                        key = (job, number, record["rank"], record["step"], name)
                        self.stats.acked[key] += 1
                        self.stats.acked_at.setdefault(key, time.monotonic())
        for attempt_id, count in sent.items():
            del self.attempts[attempt_id]["pending"][:count]
        self.apply(response.json(), now)

    def apply(self, response: dict[str, Any], now: float) -> None:
        self.heartbeat_s = float(response.get("heartbeat_s", self.heartbeat_s))
        desired = {}
        for item in response.get("desired") or []:
            desired[int(item["attempt_id"])] = item
        for attempt_id in list(self.attempts):
            state = self.attempts[attempt_id]
            item = desired.get(attempt_id)
            if item is None:
                # No longer wanted (ended, or fenced): forgotten once its exit was sent.
                if state["done"] is not None and not state["pending"] or state["done"] is None:
                    del self.attempts[attempt_id]
            elif item.get("action") == "stop" and state["done"] is None:
                state["done"] = now  # checkpoint-and-stop: exits at once
        for attempt_id, item in desired.items():
            if item.get("action") == "run" and attempt_id not in self.attempts:
                self.attempts[attempt_id] = {
                    "launch": item["launch"],
                    "started": now,
                    "step": 0,
                    "pending": [],
                    "done": None,
                }


def run_load(
    url: str | list[str],
    cluster_token: str,
    user_token: str,
    *,
    nodes: int,
    gpus: int,
    submit: Callable[[], list[int]],
    watchers: int,
    seconds: float,
    steps: int,
    step_s: float,
    settle_s: float = 5.0,
    measure: Callable[[str], None] | None = None,
    watch_passes: bool = False,
    read_back: Callable[[Stats, list[int]], None] | None = None,
) -> tuple[Stats, float, list[int]]:
    """Register `nodes` hollow nodes, then `submit()` the jobs (a job needs registered GPUs),
    open `watchers` websockets spread over them, and let the ranks step for `seconds` (then
    `settle_s` more for the last records to reach the watchers). `url` may be several
    portals' addresses: nodes and watchers are spread over them in turn, as a proxy in front
    of several daphne processes would. `measure("start")` and `measure("stop")` are called as
    the steady state begins and ends. Returns the stats, the measured seconds and the job
    ids."""
    urls = [url] if isinstance(url, str) else list(url)
    stats, stop, go, quiet = Stats(), threading.Event(), threading.Event(), threading.Event()
    hollow = [
        HollowNode(
            urls[i % len(urls)],
            cluster_token,
            f"hollow-{i:04d}",
            gpus=gpus,
            steps=steps,
            step_s=step_s,
            stats=stats,
            stop=stop,
            go=go,
        )
        for i in range(nodes)
    ]
    for node in hollow:
        node.start()
    for node in hollow:
        node.registered.wait(120)
    jobs = submit()
    tabs = [
        Watcher(i, urls[i % len(urls)], user_token, jobs[i % len(jobs)], stats, quiet)
        for i in range(watchers)
    ]
    stats.watching.update((tab.index, tab.job_id) for tab in tabs)
    for tab in tabs:
        tab.start()
    for tab in tabs:
        tab.connected.wait(60)
    with stats.lock:
        stats.beats.clear()  # registration and placement are not the steady state measured
        stats.beats_app.clear()
        stats.passes.clear()
    passes = PassSampler(stats) if watch_passes else None
    started = time.monotonic()
    if measure:
        measure("start")
    if passes:
        passes.start()
    go.set()
    time.sleep(seconds)
    if passes:
        passes.halt.set()
    if measure:
        measure("stop")
    stop.set()
    with stats.lock:
        stats.stopped_at = time.monotonic()
    for node in hollow:
        node.join(60)
    elapsed = time.monotonic() - started
    time.sleep(settle_s)
    quiet.set()
    for tab in tabs:
        tab.join(10)
    if read_back is not None:
        read_back(stats, sorted(set(stats.watching.values())))
    return stats, elapsed, jobs


MIX = (8, 16, 32, 64)  # the target's gangs, in turn


def job_sizes(count: int, cluster_gpus: int, flagship: int = 0) -> list[int]:
    """GPUs of the jobs to run: a `flagship` first (if asked), then `count` gangs of the
    mix, or with `count` 0 as many as fill the rest of the cluster (whole 8-GPU nodes)."""
    sizes = [flagship] if flagship else []
    free = cluster_gpus - flagship
    i = 0
    while (count and len(sizes) < count + bool(flagship)) or (not count and free >= MIX[0]):
        gpus = min(MIX[i % len(MIX)], cluster_gpus)
        i += 1
        if not count and gpus > free:
            continue  # a smaller one of the next turns fills what is left
        sizes.append(gpus)
        free -= gpus
    return sizes


def submit_jobs(api: Any, sizes: list[int]) -> list[int]:
    jobs = []
    for i, gpus in enumerate(sizes):
        response = api.post(
            "/api/v1/jobs/",
            {
                "name": f"load-{i}",
                "team": "load",
                "image": "lockstep/trainer:latest",
                "command": ["python", "-m", "trainer"],
                "gpus": gpus,
            },
        )
        response.raise_for_status()
        jobs.append(response.json()["id"])
    return jobs


def wait_placed(api: Any, jobs: list[int], timeout_s: float = 300) -> None:
    waiting, deadline = set(jobs), time.monotonic() + timeout_s
    while waiting and time.monotonic() < deadline:
        waiting = {j for j in waiting if api.get(f"/api/v1/jobs/{j}/").json()["state"] == "QUEUED"}
        time.sleep(1 if waiting else 0)
    if waiting:
        raise SystemExit(f"{len(waiting)} jobs still queued after {timeout_s:.0f}s")


BACKLOG = """
from django.contrib.auth import get_user_model
from django.db import transaction
from django.utils import timezone
from jobs import actions
from teams.models import Team
owner, team = get_user_model().objects.get(username="alice"), Team.objects.get(name="load")
for start in range({start}, {count}, 500):
    with transaction.atomic():
        for i in range(start, min({count}, start + 500)):
            actions.do_submit_job(
                owner=owner, team=team, now=timezone.now(), name=f"backlog-{{i}}",
                image="lockstep/trainer:latest", command=["python", "-m", "trainer"],
                gpus=(8, 16, 32, 64)[i % 4],
            )
"""


def server_s(response: Any) -> float | None:
    """The portal's own time for a request, from its Server-Timing header (`app;dur=ms`)."""
    for part in response.headers.get("Server-Timing", "").split(","):
        name, _, params = part.strip().partition(";")
        if name == "app" and params.startswith("dur="):
            try:
                return float(params[4:]) / 1000
            except ValueError:
                return None
    return None


def read_back(api: Any, stats: Stats, jobs: list[int]) -> None:
    """What the portal stored of `jobs` (through the API, as a page reads it), and why their
    ended attempts ended: the truth a watcher's points are checked against."""
    stored: dict[int, set] = {}
    for job in jobs:
        detail = api.get(f"/api/v1/jobs/{job}/").json()
        keys = stored.setdefault(job, set())
        for attempt in detail["attempts"]:
            if attempt.get("ended"):
                stats.ended[(attempt["ended"].get("reason") or "")[:80]] += 1
            for name in STEP_NAMES:
                series = api.get(
                    f"/api/v1/jobs/{job}/metrics/",
                    params={"name": name, "max_points": 100_000, "attempt": attempt["number"]},
                ).json()
                for rank, points in series["ranks"].items():
                    keys.update(
                        (job, attempt["number"], int(rank), step, name) for step in points["step"]
                    )
    with stats.lock:
        stats.stored = stored


def submit_backlog(live: Any, count: int) -> None:
    """`count` more jobs of the mix that find the cluster full and queue, so that every pass
    plans a queue of that length: through the submit action (what the API calls once a body
    is valid), 500 to a transaction, because 10,000 API calls would take the run's minutes."""
    for start in range(0, count, 2000):  # each call well inside manage()'s time limit
        live.manage("shell", "-c", BACKLOG.format(start=start, count=min(count, start + 2000)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument(
        "--jobs", type=int, default=40, help="jobs run, 8-64 GPUs (0: as many as fill the cluster)"
    )
    parser.add_argument("--flagship", type=int, default=0, help="GPUs of one big job run first")
    parser.add_argument(
        "--queued", type=int, default=0, help="jobs more, queued behind a full cluster"
    )
    parser.add_argument("--portals", type=int, default=1, help="daphne processes")
    parser.add_argument(
        "--heartbeat-s", type=float, default=1.0, help="the portal's LOCKSTEP_HEARTBEAT_S"
    )
    parser.add_argument("--watchers", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--steps", type=int, default=100000, help="steps a hollow attempt runs")
    parser.add_argument("--step-s", type=float, default=1.0)
    parser.add_argument(
        "--db-pool",
        type=int,
        default=4,
        help="LOCKSTEP_DB_POOL_MAX for the portal's processes (PostgreSQL only; 0: no pool)",
    )
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "hollow.json"))
    args = parser.parse_args(argv)

    # The portal as the suite starts it: its own database (PostgreSQL with DATABASE_URL, else
    # SQLite) and the embedded Redis unless REDIS_URL is set.
    import tempfile

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
    import django

    import tests.embedded_services  # noqa: F401  (REDIS_URL: the embedded redis)

    django.setup()
    from tests.live import Api, LiveCluster

    probe_s = machine_probe_s()  # before anything of the run loads the machine
    with tempfile.TemporaryDirectory() as work:
        # Production's detectors and timings, not the suite's (tests/live.py): a node is lost
        # after 30 s of silence, a job is hung after a minute without a step (the suite's 12 s
        # declared attempts stepping every 16 s hung after their first step), GPUs sampled
        # every 10 s.
        env = {
            **{f"LOCKSTEP_{name}": str(DEFAULTS[name]) for name in PRODUCTION_SETTINGS},
            "LOCKSTEP_HEARTBEAT_S": f"{args.heartbeat_s:g}",
            "LOCKSTEP_HEARTBEAT_TIMEOUT_S": f"{max(30.0, 10 * args.heartbeat_s):g}",
            # One user submits the whole cluster's jobs here, faster than a person may.
            "LOCKSTEP_THROTTLE_SUBMIT": "100000/min",
        }
        env["LOCKSTEP_DB_POOL_MAX"] = str(args.db_pool)
        live = LiveCluster(Path(work), agents=0, env=env, portals=args.portals)
        try:
            live.start()
            token = live.token("alice", "--team", "load", "--quota", str(args.nodes * args.gpus))
            api = Api(live.url, token)
            sampler = ProcessSampler(
                {"harness": os.getpid()} | {k: p.pid for k, p in live.procs.items()},
                postgres=live.database.url.startswith("postgres"),
            )
            sqlite = Path(work) / "cluster.sqlite3"
            size: dict[str, int] = {}

            def measure(when: str) -> None:
                size[when] = database_bytes(live.database.url, sqlite)
                if when == "start":
                    sampler.start()
                else:
                    sampler.halt.set()
                    sampler.join(5)

            def submit() -> list[int]:
                sizes = job_sizes(args.jobs, args.nodes * args.gpus, args.flagship)
                jobs = submit_jobs(api, sizes)
                # The jobs that fit the cluster together (whole nodes, in submission order)
                # start before the ranks step; any more queue.
                fits = [sum(sizes[: i + 1]) <= args.nodes * args.gpus for i in range(len(sizes))]
                wait_placed(api, [j for j, fit in zip(jobs, fits, strict=True) if fit])
                submit_backlog(live, args.queued)
                return jobs

            stats, elapsed, _jobs = run_load(
                live.urls,
                live.agent_token,
                token,
                nodes=args.nodes,
                gpus=args.gpus,
                submit=submit,
                watchers=args.watchers,
                seconds=args.seconds,
                steps=args.steps,
                step_s=args.step_s,
                measure=measure,
                watch_passes=True,
                read_back=lambda stats, jobs: read_back(api, stats, jobs),
            )
            vendor = "postgresql" if live.database.url.startswith("postgres") else "sqlite"
            tiers = metric_tiers(live.database.url)
        finally:
            live.stop()
            portal_errors = logged_errors(Path(work))
    grown = size.get("stop", 0) - size.get("start", 0)
    measured = summary(stats, elapsed) | metric_budget(tiers)
    result = {
        "args": vars(args),
        **measured,
        "goals": goals(measured),
        "database": vendor,
        "database_growth_bytes": grown,
        "database_growth_per_hour_bytes": round(grown * 3600 / max(1.0, args.seconds)),
        "processes": sampler.result(),
        # What the portal's processes logged as errors: why a watcher was closed, say.
        "portal_errors": portal_errors,
        "cores": os.cpu_count(),
        "machine_probe_s": probe_s,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0 if not stats.errors else 1


if __name__ == "__main__":
    sys.exit(main())
