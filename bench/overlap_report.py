"""The overlap bench's results (bench/overlap.py): the per-setting summary over the clean
rounds, the table (terminal, markdown, CSV) and the figure."""

from __future__ import annotations

import csv
import statistics
import sys
from dataclasses import asdict
from pathlib import Path

from bench.overlap_sweep import Setting, clean_rows
from bench.overlap_trace import PHASES

MIB = 1 << 20


def summarize(raw: dict, settings: list[Setting]) -> list[dict]:
    """Per setting, over the rounds `clean_rows` keeps: per-step means over ranks, profiled
    steps and rounds (ms), the overlap share of the summed times, and the median unprofiled
    step time."""
    base, _ = clean_rows(raw, "ddp-nosync")
    base_s = statistics.median(v for r in base for v in r["step_s"]) if base else None
    out = []
    for s in settings:
        rows, kept = clean_rows(raw, s.name)
        if not rows:
            continue
        steps = [st for r in rows for rk in r["ranks"] for st in rk["profiled"]]
        n = len(steps)

        def mean(key: str, phase: str | None = None, steps=steps, n=n) -> float:
            if phase is None:
                return sum(st[key] for st in steps) / n
            return sum(st["phases"].get(phase, {}).get(key, 0.0) for st in steps) / n

        def mean_ms(key: str, phase: str | None = None) -> float:
            return mean(key, phase) / 1e3

        def mean_known_ms(key: str, steps=steps) -> float | None:
            known = [st[key] for st in steps if st[key] is not None]
            return sum(known) / len(known) / 1e3 if known else None

        comm, hidden = mean_ms("comm_us"), mean_ms("hidden_us")
        bwd_comm, bwd_hidden = mean_ms("comm_us", "backward"), mean_ms("hidden_us", "backward")
        step_s = statistics.median(v for r in rows for v in r["step_s"])
        out.append(
            {
                "setting": s.name,
                "label": s.label,
                **{k: v for k, v in asdict(s).items() if k != "name"},
                # Under no_sync DDP never rebuilds its buckets: none were used.
                "buckets": len(rows[0]["buckets"]) if rows[0]["buckets"] and s.sync else None,
                "step_ms": step_s * 1e3,
                "step_ms_rounds": [r["step_s_median"] * 1e3 for r in rows],
                "rounds_kept": kept,
                "foreign_cpu_share_max": max(r["foreign_cpu_share"] for r in rows),
                "comm_cost_ms": (step_s - base_s) * 1e3 if base_s is not None else None,
                "profiled_step_ms": mean_ms("step_us"),
                "busy_ms": mean_ms("busy_us"),
                "collectives": mean("collectives"),
                "comm_ms": comm,
                "hidden_ms": hidden,
                "exposed_ms": mean_ms("exposed_us"),
                "tail_cut_ms": mean_ms("tail_cut_us"),
                "peer_wait_ms": mean_known_ms("peer_wait_us"),
                "exposed_peer_wait_ms": mean_known_ms("exposed_peer_wait_us"),
                "share": hidden / comm if comm > 0 else None,
                **{f"{p}_comm_ms": mean_ms("comm_us", p) for p in PHASES},
                **{f"{p}_exposed_ms": mean_ms("exposed_us", p) for p in PHASES},
                "backward_share": bwd_hidden / bwd_comm if bwd_comm > 0 else None,
                "profiled_steps": n,
            }
        )
    return out


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


TABLE_COLS = (
    ("setting", "setting"),
    ("buckets", "buckets"),
    ("step ms", "step_ms"),
    ("rounds' range", "step_range"),
    ("rounds kept", "rounds_kept"),
    ("cost ms", "comm_cost_ms"),
    ("comm ms", "comm_ms"),
    ("hidden ms", "hidden_ms"),
    ("exposed ms", "exposed_ms"),
    ("of it peer wait", "exposed_peer_wait_ms"),
    ("share", "share"),
    ("bwd share", "backward_share"),
    ("fwd/bwd/opt comm ms", None),
)


def table_rows(summary: list[dict]) -> list[list[str]]:
    rows = []
    for r in summary:
        cells = []
        for _, key in TABLE_COLS:
            if key is None:
                cells.append("/".join(f"{r[f'{p}_comm_ms']:.1f}" for p in PHASES))
            elif key in ("share", "backward_share"):
                cells.append(_pct(r[key]))
            elif key == "setting":
                cells.append(r["label"])
            elif key == "step_range":
                cells.append(f"{min(r['step_ms_rounds']):.0f}-{max(r['step_ms_rounds']):.0f}")
            elif r[key] is None:
                cells.append("-")
            elif isinstance(r[key], float):
                cells.append(f"{r[key]:.1f}")
            else:
                cells.append(str(r[key]))
        rows.append(cells)
    return rows


def print_table(summary: list[dict]) -> None:
    heads = [h for h, _ in TABLE_COLS]
    rows = table_rows(summary)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(heads)]
    print("  ".join(h.rjust(w) for h, w in zip(heads, widths, strict=True)))
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))


def markdown_table(summary: list[dict]) -> str:
    heads = [h for h, _ in TABLE_COLS]
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    lines += ["| " + " | ".join(r) + " |" for r in table_rows(summary)]
    return "\n".join(lines)


def write_csv(summary: list[dict], path: Path) -> None:
    keys = [k for k in summary[0] if k != "step_ms_rounds"]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        for r in summary:
            w.writerow({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in r.items()})


def short_label(r: dict) -> str:
    """Three short lines for an axis tick: mode, bucket or prefetch, async."""
    if r["mode"] == "ddp":
        return "ddp\nno sync" if not r["sync"] else f"ddp\n{r['bucket_cap_mb']:g} MiB"
    mode = "fsdp" if r["mode"] == "fsdp" else "noreshard"
    how = "implicit" if r["prefetch"] == 0 else f"explicit {r['prefetch']}"
    return f"{mode}\n{how}" + ("\nasync" if r["async_unshard"] else "")


def plot(result: dict, path: Path) -> bool:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no figure", file=sys.stderr)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["summary"]
    labels = [short_label(r) for r in rows]
    xs = range(len(rows))
    mode_color = {"ddp": "#1f77b4", "fsdp": "#2ca02c", "fsdp-noreshard": "#9467bd"}
    colors = [mode_color[r["mode"]] if r["sync"] else "#7f7f7f" for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(13, 8.5), sharex=True)
    hidden = [r["hidden_ms"] for r in rows]
    exposed = [r["exposed_ms"] for r in rows]
    top.bar(xs, hidden, color="#2ca02c", label="hidden behind compute")
    top.bar(xs, exposed, bottom=hidden, color="#d62728", label="exposed (main thread waits)")
    for x, r in zip(xs, rows, strict=True):
        top.text(x, r["comm_ms"], _pct(r["share"]), ha="center", va="bottom", fontsize=9)
    top.set_ylabel("communication per step (ms)")
    top.set_title("Communication in flight per step: hidden behind compute, exposed; label: share")
    top.set_ylim(0, 1.18 * max(r["comm_ms"] for r in rows))
    top.legend(loc="upper right")
    step = [r["step_ms"] for r in rows]
    # The whiskers: the lowest and highest of the rounds' medians (run-to-run spread).
    spread = [
        [s - min(r["step_ms_rounds"]) for s, r in zip(step, rows, strict=True)],
        [max(r["step_ms_rounds"]) - s for s, r in zip(step, rows, strict=True)],
    ]
    bottom.bar(xs, step, color=colors, yerr=spread, capsize=3, ecolor="#444444")
    base = [r["step_ms"] for r in rows if not r["sync"]]
    if base:
        bottom.axhline(base[0], color="k", ls="--", lw=1, label="no gradient sync (compute only)")
        bottom.legend(loc="upper left")
    bottom.set_ylabel("step time (ms, slowest rank;\nmedian, whiskers: rounds' range)")
    bottom.set_xticks(list(xs), labels, fontsize=8)
    c = result["config"]
    fig.suptitle(
        f"{c['world']} gloo ranks on {c['cpu_count']} CPU cores, GPT {c['n_layer']}x{c['n_embd']} "
        f"({c['grad_bytes'] / MIB:.1f} MiB of fp32 gradients), torch {c['torch']}",
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
