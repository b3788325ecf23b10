"""The chaos benchmark's figures (bench/chaos.py): the step reached over time with the
injections and recoveries marked, and each incident's cost as stacked bars (docs/reliability.md).
matplotlib (the `bench` extra) is imported inside `plot`, so the rest of the bench runs without
it."""

from __future__ import annotations

from pathlib import Path

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
