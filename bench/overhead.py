"""Platform overhead benchmark (issue 5): the same training run launched by plain `torchrun` and
by Lockstep (a real LiveCluster: portal, scheduler, rq worker, one node agent with 2 CPU slots)
on the same machine, interleaved A/B/A/B so load drift hits both.

Throughput per run = median rank-0 tokens_per_s over the step records after WARMUP steps.

    .venv/bin/python bench/overhead.py
    # writes bench/results/overhead.json and docs/figures/overhead.png
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
import django  # noqa: E402

import tests.embedded_services  # noqa: E402,F401  (REDIS_URL: the embedded redis when unset)

django.setup()
from tests.live import Api, LiveCluster, wait_for  # noqa: E402

STEPS, EVERY, WARMUP, ROUNDS = int(os.environ.get("BENCH_STEPS", "160")), 20, 10, 3
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


def throughput(records: list[dict]) -> dict:
    steps = [
        r
        for r in records
        if r.get("kind") == "step" and r.get("rank", 0) == 0 and r["step"] > WARMUP
    ]
    return {
        "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in steps),
        "median_step_time_s": statistics.median(r["step_time_s"] for r in steps),
        "steps_used": len(steps),
    }


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


def run_torchrun(work: Path, i: int) -> dict:
    metrics = work / f"torchrun-{i}.jsonl"
    env = dict(
        os.environ,
        LOCKSTEP_METRICS_PATH=str(metrics),
        LOCKSTEP_CHECKPOINT_DIR=str(work / f"ckpt-torchrun-{i}"),
        PYTHONUNBUFFERED="1",
    )
    t0 = time.monotonic()
    done = subprocess.run(
        [
            str(Path(sys.executable).parent / "torchrun"),
            "--standalone",
            "--nproc-per-node",
            "2",
            *TRAIN,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode != 0:
        raise SystemExit(f"torchrun failed:\n{done.stderr[-3000:]}")
    return {
        "launcher": "torchrun",
        "wall_s": time.monotonic() - t0,
        **throughput(read_jsonl([metrics])),
    }


def run_lockstep(live: LiveCluster, api: Api, i: int) -> dict:
    t0 = time.monotonic()
    r = api.post(
        "/api/v1/jobs/",
        {
            "name": f"overhead-{i}",
            "team": "bench",
            "image": "lockstep/trainer:latest",
            "command": ["python", *TRAIN],
            "dataset": "synthetic://addition",
            "gpus": 2,
            "max_restarts": 0,
        },
    )
    assert r.status_code == 201, r.text
    job = r.json()["id"]

    def finished():
        live.check_alive()
        state = api.get(f"/api/v1/jobs/{job}/").json()["state"]
        return state if state in ("SUCCEEDED", "FAILED", "CANCELLED") else None

    state = wait_for(finished, 300, f"job {job} to finish", interval=1)
    assert state == "SUCCEEDED", state
    wall = time.monotonic() - t0
    # The newest attempt directory on the agent is this job's (jobs run one at a time here).
    attempt = max(
        (live.work / "agents").rglob("attempt-*"), key=lambda d: int(d.name.split("-")[1])
    )
    files = sorted(attempt.glob("rank-*.metrics.jsonl"))
    recs = [r for r in read_jsonl(files) if r.get("kind") == "step"]
    return {
        "launcher": "lockstep",
        "job": job,
        "wall_s_incl_scheduling": wall,
        "metric_files": [str(p.relative_to(live.work)) for p in files][:10],
        **throughput(recs),
    }


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="overhead-") as tmp:
        work = Path(tmp)
        live = LiveCluster(work / "cluster", agents=1, gpus_per_agent=2)
        (work / "cluster").mkdir()
        runs = []
        try:
            live.start()
            api = Api(live.url, live.token("bench", "--team", "bench", "--quota", "2"))
            wait_for(
                lambda: sum(n["gpus"] for n in api.get("/api/v1/nodes/").json()["results"]) == 2,
                60,
                "the agent to register",
            )
            for i in range(ROUNDS):
                runs.append(run_torchrun(work, i))
                print(runs[-1], flush=True)
                runs.append(run_lockstep(live, api, i))
                print(runs[-1], flush=True)
        finally:
            live.stop()
    t = [r["median_tokens_per_s"] for r in runs if r["launcher"] == "torchrun"]
    lk = [r["median_tokens_per_s"] for r in runs if r["launcher"] == "lockstep"]
    per_round = [b / a for a, b in zip(t, lk, strict=True)]
    ratio = statistics.median(lk) / statistics.median(t)
    out = {
        "benchmark": "platform overhead, Lockstep vs torchrun (issue 5)",
        "trainer_argv": TRAIN,
        "ranks": 2,
        "backend": "gloo (CPU)",
        "warmup_steps_excluded": WARMUP,
        "cpu_count": os.cpu_count(),
        "loadavg_at_end": os.getloadavg(),
        "ratio_lockstep_over_torchrun": ratio,
        "per_round_ratios": per_round,
        "ratio_min": min(per_round),
        "ratio_max": max(per_round),
        "goal_ratio_min": 0.98,
        "goal_met": ratio >= 0.98,
        "runs": runs,
    }
    (ROOT / "bench/results/overhead.json").write_text(json.dumps(out, indent=1))
    print(json.dumps({k: v for k, v in out.items() if k != "runs"}, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    xs = range(len(runs))
    ax.bar(
        xs,
        [r["median_tokens_per_s"] for r in runs],
        color=["tab:gray" if r["launcher"] == "torchrun" else "tab:green" for r in runs],
    )
    ax.set_xticks(list(xs), [f"{r['launcher']}\nround {i // 2 + 1}" for i, r in enumerate(runs)])
    ax.set_ylabel("median tokens/s (rank 0, after warm-up)")
    ax.set_title(f"Lockstep / torchrun = {ratio:.3f} (goal >= 0.98)")
    fig.tight_layout()
    fig.savefig(ROOT / "docs/figures/overhead.png", dpi=100)


if __name__ == "__main__":
    main()
