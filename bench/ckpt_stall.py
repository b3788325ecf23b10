"""Checkpoint stall benchmark (issue 5): blocking time of an async save against a synchronous
save of the same >= 500 MB state, all in one benchmark run.

Runs `python -m trainer` (1 process, CPU) with the same model and save interval in four modes:
synchronous saves, and --async-checkpoint with each --async-checkpoint-staging mode: `fresh`
(a new host copy every save: the behaviour before staging buffers were reused), `reuse` (one
set of host buffers for the run) and `overlap` (the copy runs during the next step's forward and
backward; optimizer.step() waits for it). The modes are run in interleaved rounds (sync, fresh,
reuse, overlap, sync, ...) so that a change of load on the shared host hits all of them.

What the loop was blocked for by the save at step s, from the trainer's own step records:
every gap between consecutive step records minus the later step's step_time_s is time the loop
spent outside a step; its median over the run is the loop's own bookkeeping, and the excess over
that, summed over the gaps from step s to the next save (staging, the wait for the write and
the commit), is the save's blocking. An overlapped copy's remainder is waited for inside the
next optimizer.step(), i.e. inside step_time_s, where no gap shows it: that part is taken from
the trainer's checkpoint record (save_staging_wait_s) and added. The trainer's own save_stall_s
(all of it measured in the trainer) is reported next to it. The final save (step STEPS, no step
after it) is left out.

Not blocking, but reported: the step right after a save against the run's other steps (the
background copy or write competing for the cores slows it).

    .venv/bin/python bench/ckpt_stall.py [rounds]
    # writes bench/results/ckpt_stall.json and docs/figures/ckpt_stall.png
    .venv/bin/python bench/ckpt_stall.py --replot   # the figure again from the results file
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

from standalone import trainer_env  # bench/, the script's own folder

ROOT = Path(__file__).resolve().parent.parent
MODEL = ["--n-layer", "6", "--n-head", "12", "--n-embd", "768", "--block-size", "32"]
STEPS, EVERY = 30, 5
MODES = ("sync", "fresh", "reuse", "overlap")
COLORS = {"sync": "tab:red", "fresh": "tab:orange", "reuse": "tab:blue", "overlap": "tab:green"}


def run(mode: str, work: Path) -> dict:
    env, metrics = trainer_env(work, mode)
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
    if mode != "sync":
        argv += ["--async-checkpoint", "--async-checkpoint-staging", mode]
    t0 = time.monotonic()
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    wall = time.monotonic() - t0
    if done.returncode != 0:
        raise SystemExit(f"{mode} run failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    recs = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = {r["step"]: r for r in recs if r["kind"] == "step"}
    ckpts = {r["step"]: r for r in recs if r["kind"] == "checkpoint"}
    # Time outside a step before step k: the gap since step k-1's record minus step k's time.
    outside = {
        k: steps[k]["time"] - steps[k - 1]["time"] - steps[k]["step_time_s"]
        for k in steps
        if k - 1 in steps
    }
    bookkeeping = statistics.median(outside.values())
    saves = []
    for s in range(EVERY, STEPS, EVERY):
        window = [k for k in range(s + 1, s + EVERY + 1) if k in outside]
        rec = ckpts[s]
        in_step = rec.get("save_staging_wait_s", 0.0)
        gaps = sum(outside[k] - bookkeeping for k in window)
        saves.append(
            {
                "after_step": s,
                "blocked_s": gaps + in_step,
                "blocked_gaps_s": gaps,
                "blocked_in_step_s": in_step,
                "trainer_save_stall_s": rec["save_stall_s"],
                "trainer_save_staging_s": rec.get("save_staging_s"),
                "trainer_save_write_wait_s": rec.get("save_write_wait_s"),
                "save_background_s": rec.get("save_background_s"),
                "step_after_save_s": steps[s + 1]["step_time_s"],
            }
        )
    after = {s + 1 for s in range(EVERY, STEPS, EVERY)}
    return {
        "mode": mode,
        "wall_s": wall,
        "train_s": steps[STEPS]["time"] - steps[1]["time"],
        "bookkeeping_s": bookkeeping,
        "saves": saves,
        "checkpoint_records": list(ckpts.values()),
        "step_times_s": {s: steps[s]["step_time_s"] for s in sorted(steps)},
        "other_step_times_s": [steps[k]["step_time_s"] for k in steps if k > 2 and k not in after],
        "save_bytes": max(c.get("save_bytes") or c.get("bytes") or 0 for c in ckpts.values()),
        "stderr_tail": done.stderr[-500:],
    }


def summary(runs: list[dict]) -> dict:
    saves = [x for r in runs for x in r["saves"]]

    def med(key: str) -> float:
        return statistics.median(x[key] for x in saves)

    return {
        "saves": len(saves),
        "median_blocked_s": med("blocked_s"),
        "median_blocked_gaps_s": med("blocked_gaps_s"),
        "median_blocked_in_step_s": med("blocked_in_step_s"),
        "median_trainer_save_stall_s": med("trainer_save_stall_s"),
        "median_save_background_s": med("save_background_s"),
        "median_step_after_save_s": med("step_after_save_s"),
        "median_other_step_s": statistics.median(t for r in runs for t in r["other_step_times_s"]),
        "median_train_s": statistics.median(r["train_s"] for r in runs),
    }


def main() -> None:
    if sys.argv[1:] == ["--replot"]:
        plot(json.loads((ROOT / "bench/results/ckpt_stall.json").read_text()))
        return
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    load_start = os.getloadavg()
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory(prefix="ckpt-stall-") as tmp:
        for i in range(rounds):
            for m in MODES:
                work = Path(tmp) / f"round{i}"
                work.mkdir(exist_ok=True)
                runs[m].append(run(m, work))
                print(f"round {i} {m}: {summary(runs[m][-1:])['median_blocked_s']:.3f} s blocked")
    modes = {m: summary(runs[m]) for m in MODES}
    sync = modes["sync"]["median_blocked_s"]
    for m in MODES:
        modes[m]["ratio_over_sync"] = modes[m]["median_blocked_s"] / sync
        modes[m]["ratio_trainer_stall_over_sync"] = (
            modes[m]["median_trainer_save_stall_s"] / modes["sync"]["median_trainer_save_stall_s"]
        )
    default = "reuse"  # trainer/config.py: --async-checkpoint-staging default
    out = {
        "benchmark": "checkpoint stall, async vs sync (issue 5)",
        "model_flags": MODEL,
        "steps": STEPS,
        "checkpoint_every": EVERY,
        "rounds": rounds,
        "cpu_count": os.cpu_count(),
        "loadavg_at_start": load_start,
        "loadavg_at_end": os.getloadavg(),
        "state_bytes": runs["sync"][0]["save_bytes"],
        "modes": modes,
        "goal_ratio_max": 0.10,
        "default_staging": default,
        "goal_met": {m: modes[m]["ratio_over_sync"] <= 0.10 for m in MODES if m != "sync"},
        "runs": runs,
    }
    (ROOT / "bench/results/ckpt_stall.json").write_text(json.dumps(out, indent=1, default=str))
    print(json.dumps({k: v for k, v in out.items() if k != "runs"}, indent=1, default=str))
    plot(out)


def plot(out: dict) -> None:
    runs, modes, rounds = out["runs"], out["modes"], out["rounds"]
    sync = modes["sync"]["median_blocked_s"]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
    for i, m in enumerate(MODES):
        ys = [x["blocked_s"] for r in runs[m] for x in r["saves"]]
        xs = [i + (j - (len(ys) - 1) / 2) * 0.06 for j in range(len(ys))]
        a.scatter(xs, ys, color=COLORS[m], s=14)
        med = modes[m]["median_blocked_s"]
        a.hlines(med, i - 0.35, i + 0.35, color=COLORS[m])
        label = f"{med:.3f} s" + ("" if m == "sync" else f"\n{modes[m]['ratio_over_sync']:.1%}")
        a.annotate(label, (i + 0.38, med), va="center", fontsize=8)
        st = {int(k): v for k, v in runs[m][0]["step_times_s"].items()}  # str keys from JSON
        b.plot(list(st), list(st.values()), marker=".", color=COLORS[m], label=m)
    a.axhline(0.10 * sync, color="grey", ls="--", lw=0.8)
    a.annotate("goal: 10 % of sync", (-0.4, 0.10 * sync), va="bottom", fontsize=8, color="grey")
    names = ["sync", "async fresh\n(before)", "async reuse", "async overlap"]
    a.set_xticks(range(len(MODES)), names)
    a.set_xlim(-0.5, len(MODES) - 0.2)
    a.set_yscale("symlog", linthresh=0.01)
    a.set_ylim(bottom=0)
    a.set_ylabel("training loop blocked per save (s)")
    a.set_title(f"save stall, {out['state_bytes'] / 1e6:.0f} MB state ({rounds} rounds)")
    for s in range(EVERY, STEPS, EVERY):
        b.axvline(s + 0.5, color="grey", lw=0.5)
    b.set_xlabel("step (grey: a save after this step)")
    b.set_ylabel("step_time_s (s)")
    b.legend()
    b.set_title("step time, round 1")
    fig.tight_layout()
    fig.savefig(ROOT / "docs/figures/ckpt_stall.png", dpi=100)


if __name__ == "__main__":
    main()
