"""Checkpoint stall benchmark (issue 5): blocking time of an async save against a synchronous
save of the same >= 500 MB state, both in one benchmark run.

Runs `python -m trainer` (1 process, CPU) twice with the same model and save interval: once with
synchronous saves, once with --async-checkpoint. The blocking time of each save is measured from
the trainer's own step records: the wall-clock gap between the step records either side of a
save minus the next step's step_time_s (what the training loop lost to the save). Checkpoint
records give the bytes written and save_s; save_stall_s / save_background_s are taken too when
the trainer emits them.

    .venv/bin/python bench/ckpt_stall.py
    # writes bench/results/ckpt_stall.json and docs/figures/ckpt_stall.png
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
MODEL = ["--n-layer", "6", "--n-head", "12", "--n-embd", "768", "--block-size", "32"]
STEPS, EVERY = 25, 5


def run(mode: str, work: Path) -> dict:
    metrics = work / f"{mode}.jsonl"
    env = dict(
        os.environ,
        LOCKSTEP_METRICS_PATH=str(metrics),
        LOCKSTEP_CHECKPOINT_DIR=str(work / f"ckpt-{mode}"),
        LOCKSTEP_JOB_ID=f"bench-{mode}",
        PYTHONUNBUFFERED="1",
    )
    argv = [
        sys.executable,
        "-m",
        "trainer",
        "--steps",
        str(STEPS),
        "--checkpoint-every",
        str(EVERY),
        "--batch-size",
        "2",
        "--log-every",
        "5",
        *MODEL,
    ]
    if mode == "async":
        argv.append("--async-checkpoint")
    t0 = time.monotonic()
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    wall = time.monotonic() - t0
    if done.returncode != 0:
        raise SystemExit(f"{mode} run failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    recs = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = {r["step"]: r for r in recs if r["kind"] == "step"}
    ckpts = [r for r in recs if r["kind"] == "checkpoint"]
    saves = []
    for s in range(EVERY, STEPS, EVERY):  # the final save (step STEPS) has no step after it
        if s in steps and s + 1 in steps:
            gap = steps[s + 1]["time"] - steps[s]["time"]
            saves.append(
                {"after_step": s, "blocked_s": gap - steps[s + 1]["step_time_s"], "gap_s": gap}
            )
    plain = [steps[s]["step_time_s"] for s in steps if s > 2]
    return {
        "mode": mode,
        "wall_s": wall,
        "saves": saves,
        "checkpoint_records": ckpts,
        "median_blocked_s": statistics.median(x["blocked_s"] for x in saves),
        "median_step_time_s": statistics.median(plain),
        "step_times_s": {s: steps[s]["step_time_s"] for s in sorted(steps)},
        "save_bytes": max((c.get("save_bytes") or c.get("bytes") or 0) for c in ckpts),
        "stderr_tail": done.stderr[-500:],
    }


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="ckpt-stall-") as tmp:
        runs = {m: run(m, Path(tmp)) for m in ("sync", "async")}
    sync, asy = runs["sync"]["median_blocked_s"], runs["async"]["median_blocked_s"]
    ratio = asy / sync if sync > 0 else float("nan")
    out = {
        "benchmark": "checkpoint stall, async vs sync (issue 5)",
        "model_flags": MODEL,
        "steps": STEPS,
        "checkpoint_every": EVERY,
        "cpu_count": os.cpu_count(),
        "loadavg_at_end": os.getloadavg(),
        "state_bytes": runs["sync"]["save_bytes"],
        "median_blocked_sync_s": sync,
        "median_blocked_async_s": asy,
        "ratio_async_over_sync": ratio,
        "goal_ratio_max": 0.10,
        "goal_met": ratio <= 0.10,
        "runs": runs,
    }
    (ROOT / "bench/results/ckpt_stall.json").write_text(json.dumps(out, indent=1, default=str))
    print(json.dumps({k: v for k, v in out.items() if k != "runs"}, indent=1, default=str))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for m, c in (("sync", "tab:red"), ("async", "tab:blue")):
        st = runs[m]["step_times_s"]
        b.plot(list(st), list(st.values()), marker=".", color=c, label=f"{m} step_time_s")
        xs = [x["after_step"] for x in runs[m]["saves"]]
        a.bar(
            [x + (-0.8 if m == "sync" else 0.8) for x in xs],
            [x["blocked_s"] for x in runs[m]["saves"]],
            width=1.5,
            color=c,
            label=m,
        )
    a.set_xlabel("save after step")
    a.set_ylabel("training loop blocked (s)")
    a.set_title(f"save stall, {out['state_bytes'] / 1e6:.0f} MB state: async/sync = {ratio:.1%}")
    a.legend()
    b.set_xlabel("step")
    b.set_ylabel("s")
    b.legend()
    b.set_title("step time")
    fig.tight_layout()
    fig.savefig(ROOT / "docs/figures/ckpt_stall.png", dpi=100)


if __name__ == "__main__":
    main()
