"""Warm start benchmark: how long a restarted 4-rank job takes from launch to its first step,
with workers forked from the agent's zygote (nodeagent/zygote.py) against fresh interpreters,
and (with --container) in the trainer's image under podman, both ways: a fresh container per
attempt with fresh interpreters inside (nodeagent/container.py), and the job's warm container
from its previous attempt forking the ranks (nodeagent/warm_container.py), in the same run.

Two WorkerSupervisors play two agents with 2 ranks each (the chaos benchmark's shape). A short
run first leaves a committed checkpoint; every timed launch then resumes from it, as a restart
does. Rounds alternate cold, warm, cold, warm, ... so load drift hits both. For each launch:
seconds from launch to every rank's `start` record (the trainer is up: imports done, process
group joined, checkpoint loaded) and to the last rank's first `step` record.

    .venv/bin/python bench/warm_start.py [--rounds 4] [--container]
    # writes bench/results/warm_start.json and docs/figures/warm_start.png
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nodeagent.container import Engine  # noqa: E402
from nodeagent.supervisor import WorkerSupervisor  # noqa: E402

IMAGE = "localhost/lockstep/trainer:latest"
COLOURS = {
    "cold": "#b45309",
    "warm": "#15803d",
    "container": "#1d4ed8",
    "container-warm": "#7c3aed",
}

COMMAND = ["python", "-m", "trainer", "--log-every", "1", "--checkpoint-every", "0"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(ckpt: Path, steps: int, resume: str, node: int, port: int) -> dict:
    ranks = [{"rank": node * 2 + i, "local_rank": i, "gpu_index": i} for i in range(2)]
    return {
        "job_id": 1,
        "team_id": 1,
        "image": IMAGE,
        "attempt": 1,
        "command": [*COMMAND, "--steps", str(steps)],
        "env": {},
        "world_size": 4,
        "job_gpus": 4,
        "local_world_size": 2,
        "group_rank": node,
        "group_world_size": 2,
        "master_addr": "127.0.0.1",
        "master_port": port,
        "run_id": "bench",
        "restart_count": 1,
        "max_restarts": 3,
        "checkpoint_dir": str(ckpt),
        "resume_from": resume,
        "dataset": "synthetic://addition",
        "ranks": ranks,
    }


def records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_gang(agents, attempt_id: int, ckpt: Path, steps: int, resume: str) -> dict:
    port = free_port()
    t0 = time.time()
    attempts = [
        agent.launch(attempt_id, launch(ckpt, steps, resume, node, port))
        for node, agent in enumerate(agents)
    ]
    for agent in agents:
        assert agent.wait(attempt_id, 300), "the gang did not finish"
    workers = [w for a in attempts for w in a.workers]
    codes = [w.exit_code for w in workers]
    if codes != [0] * len(workers):
        logs = {w.rank: w.log_path.read_text()[-1500:] for w in workers}
        raise SystemExit(f"a rank failed: {codes}\n{logs}")
    up, first = [], []
    for worker in workers:
        rows = records(worker.metrics_path)
        up.append(next(r["time"] for r in rows if r["kind"] == "start") - t0)
        first.append(next(r["time"] for r in rows if r["kind"] == "step") - t0)
    return {"up_s": max(up), "first_step_s": max(first), "per_rank_up_s": up}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument(
        "--container", action="store_true", help="also in the trainer's image (make image)"
    )
    args = parser.parse_args()
    engine = Engine.detect("podman") if args.container else None
    if args.container and (engine is None or not engine.image_present(IMAGE)):
        raise SystemExit(f"--container needs podman and {IMAGE} (make image)")
    base = {k: v for k, v in os.environ.items() if not k.startswith(("LOCKSTEP_", "OMP_"))}
    base["PYTHONPATH"] = str(ROOT)
    with tempfile.TemporaryDirectory(prefix="warm-start-") as tmp:
        tmp = Path(tmp)
        cold = [WorkerSupervisor(tmp / f"cold{i}", gpu_kind="cpu", base_env=base) for i in (0, 1)]
        warm = [
            WorkerSupervisor(tmp / f"warm{i}", gpu_kind="cpu", base_env=base, warm_start=True)
            for i in (0, 1)
        ]
        modes = [("cold", cold), ("warm", warm)]
        if engine is not None:
            boxed = [
                WorkerSupervisor(tmp / f"box{i}", gpu_kind="cpu", engine=engine, node=f"bench{i}")
                for i in (0, 1)
            ]
            warm_boxed = [
                WorkerSupervisor(
                    tmp / f"wbox{i}",
                    gpu_kind="cpu",
                    engine=engine,
                    node=f"wbench{i}",
                    warm_start=True,
                )  # fmt: skip
                for i in (0, 1)
            ]
            modes += [("container", boxed), ("container-warm", warm_boxed)]
        for agent in warm:
            assert agent._zygote.wait_ready(120), agent._zygote.failed
        # One job directory, an attempt directory each (as the portal lays them out): a
        # container mounts the job's directory, so every attempt can resume from the first.
        ckpt = tmp / "job-1"
        run_gang(cold, 1, ckpt / "attempt-1", 3, "")  # leaves step-000003 to resume from
        resume = str(ckpt / "attempt-1" / "step-000003")
        attempt = 2
        if engine is not None:
            # A restart follows a first attempt, which left the job's warm container behind.
            run_gang(warm_boxed, attempt, ckpt / f"attempt-{attempt}", 5, resume)
            attempt += 1
        rounds = []
        for number in range(args.rounds):
            for mode, agents in modes:
                result = run_gang(agents, attempt, ckpt / f"attempt-{attempt}", 5, resume)
                attempt += 1
                rounds.append({"round": number + 1, "mode": mode, **result})
                print(f"round {number + 1} {mode}: up {result['up_s']:.2f} s, first step "
                      f"{result['first_step_s']:.2f} s", flush=True)  # fmt: skip
        for agent in [a for _, agents in modes for a in agents]:
            agent.close()
    summary = {}
    for mode in [m for m, _ in modes]:
        rows = [r for r in rounds if r["mode"] == mode]
        summary[mode] = {
            "up_s_median": statistics.median(r["up_s"] for r in rows),
            "first_step_s_median": statistics.median(r["first_step_s"] for r in rows),
        }
    summary["first_step_saved_s"] = (
        summary["cold"]["first_step_s_median"] - summary["warm"]["first_step_s_median"]
    )
    if "container" in summary:
        for mode in ("container", "container-warm"):
            summary[f"{mode}_over_warm_s"] = (
                summary[mode]["first_step_s_median"] - summary["warm"]["first_step_s_median"]
            )
    result = {
        "config": {
            "command": COMMAND,
            "ranks": "4 (2 supervisors x 2), resuming from a committed step-3 checkpoint",
            "rounds": args.rounds,
            "cpus": os.cpu_count(),
            "load_avg_at_start": os.getloadavg(),
            "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
        "rounds": rounds,
        "summary": summary,
    }
    out = ROOT / "bench" / "results" / "warm_start.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    plot(rounds, ROOT / "docs" / "figures" / "warm_start.png")


def plot(rounds: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no figure", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(7, 3.6))
    modes = list(dict.fromkeys(r["mode"] for r in rounds))
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        offset, colour = (i - (len(modes) - 1) / 2) * width, COLOURS[mode]
        rows = [r for r in rounds if r["mode"] == mode]
        xs = [r["round"] + offset for r in rows]
        ax.bar(xs, [r["first_step_s"] for r in rows], width=width * 0.95, color=colour,
               alpha=0.5, label=f"{mode}: launch to first step")  # fmt: skip
        ax.bar(xs, [r["up_s"] for r in rows], width=width * 0.95, color=colour,
               label=f"{mode}: launch to trainer up")  # fmt: skip
    ax.set_xticks(sorted({r["round"] for r in rounds}))
    ax.set_xlabel("round")
    ax.set_ylabel("seconds (4 ranks, resuming)")
    ax.set_title("Restart start-up: fresh, forked from the zygote, in a container, warm container")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
