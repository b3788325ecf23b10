"""Platform overhead benchmark (issue 5): the same training run launched by plain `torchrun` and
by Lockstep (a real LiveCluster: portal, scheduler, rq worker, one node agent with 2 CPU slots)
on the same machine, interleaved so load drift hits both.

Three cluster settings, each a cluster of its own, each with its own torchrun baseline:
  production       the production defaults of jobs/conf.py (1 s heartbeats, 5 s tick, ...)
  production-cold  the same with the agent's warm start off (LOCKSTEP_AGENT_COLD_START=1)
  test             the test settings LiveCluster uses by default (0.5 s heartbeats, 1 s tick)
Two configurations in every round:
  saturated   2 ranks x 1 thread on the 2 cores: no core left for anything else
  headroom    1 rank x 1 thread: a core left for the platform, as the host cores of a GPU
              node mostly are
Throughput per run = median rank-0 tokens_per_s over the step records after WARMUP steps.

While each run trains, a sampler reads /proc every SAMPLE_S: the CPU time of every platform
process (portal, scheduler, rq worker, agent, zygote, redis), of torchrun's own process, of
the ranks, of this script, and the machine's busy time (the rest is other users' load). CPU
is charged over the measured window (rank 0's step WARMUP to its last step). The rank-0
worker's environment, nice level, CPU affinity and scheduling policy are recorded under each
launcher and compared.

    flock /tmp/lockstep-bench.lock .venv/bin/python bench/overhead.py
    # writes bench/results/overhead.json and docs/figures/overhead.png
    # env: BENCH_ROUNDS, BENCH_STEPS, BENCH_SETTINGS (production,production-cold,test),
    # BENCH_CONFIGS (saturated,headroom), BENCH_CONTROL=1 (a second torchrun run in every
    # round: the torchrun/torchrun ratio is the noise floor the Lockstep ratio is read against),
    # BENCH_OUT (results file, default bench/results/overhead.json)
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
import django  # noqa: E402

import tests.embedded_services as embedded  # noqa: E402  (REDIS_URL: the embedded redis)

django.setup()
from jobs.settings_table import DEFAULTS  # noqa: E402
from tests.live import Api, LiveCluster, wait_for  # noqa: E402

STEPS = int(os.environ.get("BENCH_STEPS", "160"))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
SETTINGS = os.environ.get("BENCH_SETTINGS", "production,production-cold,test").split(",")
CONFIG_NAMES = os.environ.get("BENCH_CONFIGS", "saturated,headroom").split(",")
CONTROL = os.environ.get("BENCH_CONTROL", "0") == "1"
OUT = Path(os.environ.get("BENCH_OUT", "bench/results/overhead.json"))
EVERY, WARMUP, SAMPLE_S = 20, 10, 0.2
TRAIN = [
    "-m",
    "trainer",
    "--steps",
    str(STEPS),
    "--checkpoint-every",
    str(EVERY),
    "--log-every",
    "20",
]
CONFIGS = {
    "saturated": {"ranks": 2, "env": {}},  # both launchers set OMP_NUM_THREADS=1 for 2 ranks
    "headroom": {"ranks": 1, "env": {"OMP_NUM_THREADS": "1"}},
}
# LiveCluster's test settings that have a production default in jobs/conf.py.
_TEST_OVERRIDES = [
    "HEARTBEAT_S",
    "HEARTBEAT_TIMEOUT_S",
    "HANG_MIN_S",
    "DUMP_WAIT_S",
    "STRAGGLER_WINDOW_STEPS",
    "STRAGGLER_CHECK_S",
    "STRAGGLER_MIN_EXCESS_S",
    "STRIKES_TO_CORDON",
    "RECLAIM_BACKOFF_S",
    "SCHEDULER_TICK_S",
    "RESTART_BACKOFF_S",
    "STOP_GRACE_S",
]
PRODUCTION_ENV = {f"LOCKSTEP_{name}": str(DEFAULTS[name]) for name in _TEST_OVERRIDES}
PRODUCTION_AGENT_HEARTBEAT_S = 2.0  # nodeagent's --heartbeat-s default (the portal's wins)
# Cluster settings of each phase: (env over LiveCluster's test settings, agent --heartbeat-s).
VARIANTS = {
    "production": (PRODUCTION_ENV, PRODUCTION_AGENT_HEARTBEAT_S),
    # The same with the agent's warm start (nodeagent/zygote.py) off: every rank a fresh
    # interpreter, as torchrun starts them.
    "production-cold": (
        {**PRODUCTION_ENV, "LOCKSTEP_AGENT_COLD_START": "1"},
        PRODUCTION_AGENT_HEARTBEAT_S,
    ),
    "test": ({}, 0.5),
}

CLK = os.sysconf("SC_CLK_TCK")
SECRET_WORDS = ("TOKEN", "SECRET", "PASSWORD", "KEY", "DATABASE_URL")


# -- /proc readings ----------------------------------------------------------------------------


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rfind(")") + 2 :].split()  # fields from 3 (state) on


def cpu_s(pid: int, children: bool = True) -> float | None:
    """utime+stime (+ reaped children's) of a process, in seconds."""
    f = _stat_fields(pid)
    if f is None:
        return None
    ticks = int(f[11]) + int(f[12]) + ((int(f[13]) + int(f[14])) if children else 0)
    return ticks / CLK


def child_pids(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def is_zygote(pid: int) -> bool:
    """The agent's warm-start process (nodeagent/zygote.py), not a worker."""
    try:
        return b"nodeagent.zygote" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def machine_cpu() -> tuple[float, float]:
    """(busy, steal) seconds of the whole machine since boot."""
    f = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = f[:8]
    return (user + nice + system + irq + softirq) / CLK, steal / CLK


def describe_worker(pid: int) -> dict | None:
    f = _stat_fields(pid)
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        env = dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)
        affinity = sorted(os.sched_getaffinity(pid))
        policy = os.sched_getscheduler(pid)
    except OSError:
        return None
    if f is None:
        return None
    for name in env:
        if any(word in name.upper() for word in SECRET_WORDS):
            env[name] = "<redacted>"
    return {
        "pid": pid,
        "nice": int(f[16]),
        "num_threads": int(f[17]),
        "cpu_affinity": affinity,
        "sched_policy": policy,
        "env": env,
    }


class Sampler(threading.Thread):
    """Samples CPU time of named processes, the launcher's children (the ranks), this script
    and the machine every SAMPLE_S until stopped."""

    def __init__(self, named: dict[str, int], launcher: int):
        super().__init__(daemon=True)
        self.named, self.launcher = named, launcher
        self.samples: list[tuple[float, dict[str, float]]] = []
        self.workers: dict[int, float] = {}  # pid -> last CPU seconds seen
        self.rank0: dict | None = None
        self.forked = False
        self.max_threads: dict[int, int] = {}
        self._halt = threading.Event()

    def sample(self) -> None:
        now = time.time()
        row = {}
        for name, pid in self.named.items():
            # The agent and torchrun reap the ranks (cold start): not their CPU.
            value = cpu_s(pid, children=name not in ("agent", "launcher"))
            if value is not None:
                row[name] = value
        # The ranks: the launcher's children, or (warm start) the children of the agent's
        # zygote, which is charged to the platform. Reaped children of a rank count as its own;
        # the launcher's and the zygote's reaped children (the ranks) are not theirs.
        workers = []
        for pid in child_pids(self.launcher):
            if is_zygote(pid):
                row["zygote"] = cpu_s(pid, children=False) or 0.0
                forked = child_pids(pid)
                workers += forked
                self.forked = self.forked or bool(forked)
            else:
                workers.append(pid)
        for pid in workers:
            value = cpu_s(pid)
            if value is None:
                continue
            self.workers[pid] = value
            f = _stat_fields(pid)
            if f is not None:
                self.max_threads[pid] = max(self.max_threads.get(pid, 0), int(f[17]))
        if self.rank0 is None and self.workers:
            # Rank 0 is started first. A forked worker's /proc environ is the zygote's (the
            # worker's own is set after the fork); `forked` says so.
            info = describe_worker(min(self.workers))
            if info:
                self.rank0 = {**info, "forked_from_zygote": self.forked}
        row["ranks"] = sum(self.workers.values())
        row["bench"] = cpu_s(os.getpid(), children=False) or 0.0
        row["machine"], row["steal"] = machine_cpu()
        self.samples.append((now, row))

    def run(self) -> None:
        while not self._halt.is_set():
            self.sample()
            self._halt.wait(SAMPLE_S)

    def stop(self) -> None:
        self._halt.set()
        self.join()
        self.sample()

    def at(self, name: str, t: float) -> float:
        pts = [(ts, row[name]) for ts, row in self.samples if name in row]
        if not pts:
            return 0.0
        if t <= pts[0][0]:
            return pts[0][1]
        for (t0, v0), (t1, v1) in zip(pts, pts[1:], strict=False):
            if t0 <= t <= t1:
                return v0 + (v1 - v0) * (t - t0) / max(1e-9, t1 - t0)
        return pts[-1][1]

    def window(self, t0: float, t1: float) -> dict[str, float]:
        """CPU seconds each name used between wall-clock times t0 and t1."""
        names = sorted({n for _, row in self.samples for n in row})
        used = {n: max(0.0, self.at(n, t1) - self.at(n, t0)) for n in names}
        ours = sum(v for n, v in used.items() if n not in ("machine", "steal"))
        used["others"] = max(0.0, used["machine"] - ours)
        return used


# -- runs --------------------------------------------------------------------------------------


def read_jsonl(paths) -> list[dict]:
    out = []
    for p in paths:
        for line in Path(p).read_text(errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and "kind" in rec:
                out.append(rec)
    return out


def measure(records: list[dict], sampler: Sampler) -> dict:
    steps = sorted(
        (r for r in records if r.get("kind") == "step" and r.get("rank", 0) == 0),
        key=lambda r: r["step"],
    )
    used = [r for r in steps if r["step"] > WARMUP]
    t0 = next(r["time"] for r in steps if r["step"] == WARMUP)
    t1 = used[-1]["time"]
    cpu = sampler.window(t0, t1)
    return {
        "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in used),
        "median_step_time_s": statistics.median(r["step_time_s"] for r in used),
        "median_compute_s": statistics.median(r["compute_s"] for r in used),
        "steps_used": len(used),
        "window_s": t1 - t0,
        "cpu_s_in_window": {k: round(v, 3) for k, v in cpu.items()},
        "max_threads_per_rank": sorted(sampler.max_threads.values()),
    }


def run_torchrun(work: Path, tag: str, cfg: dict, named: dict[str, int]) -> dict:
    metrics = work / f"torchrun-{tag}.jsonl"
    env = dict(
        os.environ,
        LOCKSTEP_METRICS_PATH=str(metrics),
        LOCKSTEP_CHECKPOINT_DIR=str(work / f"ckpt-torchrun-{tag}"),
        PYTHONUNBUFFERED="1",
        **cfg["env"],
    )
    t_start = time.monotonic()
    with open(work / f"torchrun-{tag}.log", "wb") as log:
        proc = subprocess.Popen(
            [
                str(Path(sys.executable).parent / "torchrun"),
                "--standalone",
                "--nproc-per-node",
                str(cfg["ranks"]),
                *TRAIN,
            ],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        sampler = Sampler({**named, "launcher": proc.pid}, proc.pid)
        sampler.start()
        try:
            code = proc.wait(timeout=300)
        finally:
            sampler.stop()
    if code != 0:
        text = (work / f"torchrun-{tag}.log").read_text(errors="replace")
        raise SystemExit(f"torchrun failed:\n{text[-3000:]}")
    return {
        "launcher": "torchrun",
        "wall_s": time.monotonic() - t_start,
        "rank0": sampler.rank0,
        **measure(read_jsonl([metrics]), sampler),
    }


def run_lockstep(live: LiveCluster, api: Api, tag: str, cfg: dict, named: dict[str, int]) -> dict:
    t_start = time.monotonic()
    sampler = Sampler(named, named["agent"])
    sampler.start()
    try:
        r = api.post(
            "/api/v1/jobs/",
            {
                "name": f"overhead-{tag}",
                "team": "bench",
                "image": "lockstep/trainer:latest",
                "command": ["python", *TRAIN],
                "dataset": "synthetic://addition",
                "gpus": cfg["ranks"],
                "max_restarts": 0,
                "env": cfg["env"],
            },
        )
        assert r.status_code == 201, r.text
        job = r.json()["id"]

        def finished():
            live.check_alive()
            state = api.get(f"/api/v1/jobs/{job}/").json()["state"]
            return state if state in ("SUCCEEDED", "FAILED", "CANCELLED") else None

        # Sparse polling: the client's own requests are not platform overhead.
        state = wait_for(finished, 300, f"job {job} to finish", interval=3)
    finally:
        sampler.stop()
    assert state == "SUCCEEDED", state
    # The newest attempt directory on the agent is this job's (jobs run one at a time here).
    attempt = max(
        (live.work / "agents").rglob("attempt-*"), key=lambda d: int(d.name.split("-")[1])
    )
    files = sorted(attempt.glob("rank-*.metrics.jsonl"))
    return {
        "launcher": "lockstep",
        "job": job,
        "wall_s_incl_scheduling": time.monotonic() - t_start,
        "metric_files": [str(p.relative_to(live.work)) for p in files][:10],
        "rank0": sampler.rank0,
        **measure(read_jsonl(files), sampler),
    }


def env_diff(a: dict | None, b: dict | None) -> dict:
    """What differs between the rank-0 worker under torchrun (a) and under Lockstep (b)."""
    if not a or not b:
        return {"error": "a rank-0 worker was not captured"}
    ea, eb = a["env"], b["env"]
    return {
        "only_torchrun": {k: ea[k] for k in sorted(ea.keys() - eb.keys())},
        "only_lockstep": {k: eb[k] for k in sorted(eb.keys() - ea.keys())},
        "different": {k: [ea[k], eb[k]] for k in sorted(ea.keys() & eb.keys()) if ea[k] != eb[k]},
        "nice": [a["nice"], b["nice"]],
        "cpu_affinity": [a["cpu_affinity"], b["cpu_affinity"]],
        "sched_policy": [a["sched_policy"], b["sched_policy"]],
    }


def run_phase(setting: str, work: Path) -> list[dict]:
    overrides, heartbeat = VARIANTS[setting]
    (work / "cluster").mkdir()
    live = LiveCluster(
        work / "cluster", agents=1, gpus_per_agent=2, env=overrides, agent_heartbeat_s=heartbeat
    )
    runs = []
    try:
        live.start()
        api = Api(live.url, live.token("bench", "--team", "bench", "--quota", "2"))
        wait_for(
            lambda: sum(n["gpus"] for n in api.get("/api/v1/nodes/").json()["results"]) == 2,
            60,
            "the agent to register",
        )
        named = {name: p.pid for name, p in live.procs.items()}
        named = {("agent" if n.startswith("agent-") else n): pid for n, pid in named.items()}
        if getattr(embedded, "_redis", None) is not None:
            named["redis"] = embedded._redis.pid
        for i in range(ROUNDS):
            for name in CONFIG_NAMES:
                cfg = CONFIGS[name]
                tag = f"{setting}-{name}-{i}"
                order = ["torchrun", "lockstep"] + (["torchrun-control"] if CONTROL else [])
                if i % 2:
                    order.reverse()
                for launcher in order:
                    if launcher == "lockstep":
                        run = run_lockstep(live, api, tag, cfg, named)
                    else:
                        run = run_torchrun(work, f"{tag}-{launcher}", cfg, named)
                        run["launcher"] = launcher
                    run.update(setting=setting, config=name, round=i + 1)
                    runs.append(run)
                    brief = {k: v for k, v in run.items() if k not in ("rank0", "metric_files")}
                    print(json.dumps(brief), flush=True)
        settings_used = {k: live.env.get(k) for k in sorted({*PRODUCTION_ENV, *overrides})}
        for run in runs:
            run["cluster_settings"] = settings_used
    finally:
        live.stop()
    return runs


PLATFORM = ["portal", "scheduler", "rqworker", "agent", "zygote", "redis"]
COLUMNS = [*PLATFORM, "launcher", "ranks", "bench", "others", "machine"]


def summarize(runs: list[dict]) -> dict:
    out = {}
    for setting in SETTINGS:
        for name in CONFIG_NAMES:
            sel = [r for r in runs if r["setting"] == setting and r["config"] == name]
            by = {
                launcher: [r for r in sel if r["launcher"] == launcher]
                for launcher in ("torchrun", "lockstep", "torchrun-control")
            }
            t = [r["median_tokens_per_s"] for r in by["torchrun"]]
            lk = [r["median_tokens_per_s"] for r in by["lockstep"]]
            per_round = [b / a for a, b in zip(t, lk, strict=True)]
            control = by["torchrun-control"]
            cores = {}
            for launcher, rs in by.items():
                if not rs:
                    continue
                cores[launcher] = {
                    col: round(
                        statistics.median(
                            r["cpu_s_in_window"].get(col, 0.0) / r["window_s"] for r in rs
                        ),
                        3,
                    )
                    for col in COLUMNS
                }
                cores[launcher]["platform_total"] = round(
                    statistics.median(
                        sum(r["cpu_s_in_window"].get(c, 0.0) for c in PLATFORM) / r["window_s"]
                        for r in rs
                    ),
                    3,
                )
            ratio = statistics.median(lk) / statistics.median(t)
            out[f"{setting}/{name}"] = {
                "ranks": CONFIGS[name]["ranks"],
                "ratio_lockstep_over_torchrun": ratio,
                "per_round_ratios": per_round,
                "median_per_round_ratio": statistics.median(per_round),
                # What the platform burns while a Lockstep job trains, beyond its idle cost
                # (which the torchrun runs pay too).
                "platform_extra_cores": round(
                    cores["lockstep"]["platform_total"] - cores["torchrun"]["platform_total"], 3
                ),
                "goal_met": ratio >= 0.98,
                "median_tokens_per_s": {
                    "torchrun": statistics.median(t),
                    "lockstep": statistics.median(lk),
                },
                "median_cores_used_in_window": cores,
                **(control_summary(t, lk, control) if control else {}),
                "rank0_env_diff": env_diff(by["torchrun"][0]["rank0"], by["lockstep"][0]["rank0"]),
            }
    return out


def control_summary(t: list[float], lk: list[float], control_runs: list[dict]) -> dict:
    """With a second torchrun run in every round: the torchrun/torchrun ratio (what the same
    launcher reads against itself on this host, the noise floor) and Lockstep against both
    torchrun runs pooled (twice the baseline samples)."""
    c = [r["median_tokens_per_s"] for r in control_runs]
    pooled = statistics.median(t + c)
    return {
        "control_ratio_torchrun_over_torchrun": statistics.median(c) / statistics.median(t),
        "control_per_round_ratios": [b / a for a, b in zip(t, c, strict=True)],
        "ratio_lockstep_over_pooled_torchrun": statistics.median(lk) / pooled,
        "ratio_of_means_lockstep_over_pooled_torchrun": statistics.mean(lk)
        / statistics.mean(t + c),
    }


LABELS = {"torchrun": "torch", "torchrun-control": "ctl", "lockstep": "lockst"}


def plot(runs: list[dict], summary: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        len(CONFIG_NAMES),
        len(SETTINGS),
        figsize=(max(6.5, 4.2 * len(SETTINGS)), 3.8 * len(CONFIG_NAMES)),
        squeeze=False,
    )
    for (row, name), (col, setting) in itertools.product(
        enumerate(CONFIG_NAMES), enumerate(SETTINGS)
    ):
        ax, key = axes[row][col], f"{setting}/{name}"
        sel = [r for r in runs if r["setting"] == setting and r["config"] == name]
        xs = range(len(sel))
        ax.bar(
            xs,
            [r["median_tokens_per_s"] for r in sel],
            color=["tab:green" if r["launcher"] == "lockstep" else "tab:gray" for r in sel],
        )
        ticks = [f"{LABELS[r['launcher']]}\nr{r['round']}" for r in sel]
        ax.set_xticks(list(xs), ticks, fontsize=7)
        ratio = summary[key]["ratio_lockstep_over_torchrun"]
        noise = summary[key].get("control_ratio_torchrun_over_torchrun")
        also = f", torchrun/torchrun {noise:.3f}" if noise else ""
        ax.set_title(f"{setting}, {name} ({CONFIGS[name]['ranks']} rank)\nratio {ratio:.3f}{also}")
        ax.set_ylabel("median tokens/s, rank 0")
    fig.suptitle("Lockstep (green) vs torchrun (gray), goal ratio >= 0.98")
    fig.tight_layout()
    fig.savefig(ROOT / "docs/figures/overhead.png", dpi=100)


def main() -> None:
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="overhead-") as tmp:
        for setting in SETTINGS:
            work = Path(tmp) / setting
            work.mkdir()
            runs += run_phase(setting, work)
    summary = summarize(runs)
    for run in runs:
        # The summary keeps what differs between the launchers; the host's whole environment
        # does not belong in the results file.
        if run.get("rank0"):
            run["rank0"] = {k: v for k, v in run["rank0"].items() if k != "env"}
    out = {
        "benchmark": "platform overhead, Lockstep vs torchrun (issue 5)",
        "trainer_argv": TRAIN,
        "backend": "gloo (CPU)",
        "warmup_steps_excluded": WARMUP,
        "rounds": ROUNDS,
        "cpu_count": os.cpu_count(),
        "loadavg_at_end": os.getloadavg(),
        "configs": CONFIGS,
        "production_settings": PRODUCTION_ENV,
        "goal_ratio_min": 0.98,
        "summary": summary,
        "runs": runs,
    }
    (ROOT / OUT).write_text(json.dumps(out, indent=1))
    for key, s in summary.items():
        print(
            key,
            json.dumps({k: v for k, v in s.items() if k != "rank0_env_diff"}),
            "\n  env diff:",
            json.dumps(s["rank0_env_diff"]),
        )
    plot(runs, summary)


if __name__ == "__main__":
    main()
