"""How much gradient communication hides behind compute: DDP bucket sizes and FSDP2 prefetching,
measured from the profiler's own traces (issue 21 item 4). Results: docs/overlap.md.

Each configuration trains the reference GPT (trainer/model.py) built and wrapped exactly as the
trainer does (`build_model`, then `Parallelized`) on 2 gloo ranks on this machine's CPUs. A step
mirrors trainer/train.py `train_step` for one micro-batch (forward, backward, gradient clip,
AdamW), with `record_function` marks around the step and its three phases so the trace says
which part of the step each interval belongs to. After a warm-up (DDP rebuilds its buckets after
the first step) some unprofiled steps give the step time (per step the slowest rank's, median
over steps) and a few more steps run under torch.profiler (CPU activity); each rank exports its
Chrome trace and `analyze` reads it:

* communication: every `gloo:*` event (gloo:all_reduce, gloo:all_gather, ...). ProcessGroupGloo
  opens that event on its worker thread when the collective starts to run there and closes it
  when the collective completes, so it is the collective's own run time, including any wait for
  the peer rank to arrive; not its time queued behind another collective. Several can run at
  once (gloo has 2 worker threads), so communication time is the *union* of these intervals
  within the step: wall time during which at least one collective was in flight.
* compute: the main thread's operators' *self* time (an event's interval less the events
  nested in it: aten::addmm's matmul, not the aten::expand it calls), except communication
  operators (`c10d::*`, `_c10d_functional::*`, anything named `*wait*`) and FSDP2's own
  `FSDP::*` frames (its synchronous all-gather waits in Python inside them), plus the gaps shorter
  than --gap-us between two compute intervals (the interpreter running model code between
  operators, not a wait) unless a communication operator covers the gap. The rest of the main
  thread's time is waiting: inside a synchronous collective, in DDP's end-of-backward wait for
  its buckets (which has no event of its own: it is a gap), or descheduled.
* hidden = |communication AND compute|, exposed = |communication| - hidden, so hidden + exposed
  is the communication time exactly; overlap share = hidden / communication, per step and per
  phase (forward, backward including DDP's final bucket wait and FSDP's post-backward callback,
  optimizer including the gradient-norm clip). The ranks share the host's clock, so the traces
  of both are lined up too: the part of a collective before the other rank entered it is
  `peer_wait` (load imbalance between the ranks, not data moving).

What gloo on CPU can and cannot show: DDP's bucket all-reduces are asynchronous (the reducer
launches each on gloo's threads as soon as the bucket is full), so they can overlap the rest of
the backward pass as on GPUs. FSDP2 on CPU has no streams: its reduce-scatter is always a
blocking call on the main thread (on a GPU it only blocks a side stream), and its all-gathers
block too unless the unshard is made asynchronous (FSDPModule._set_unshard_async_op, a private
torch API) *and* something prefetches, which is what the `-async` settings measure. And on a
machine with 2 cores, 2 ranks each running one compute thread leave no idle core for gloo's
threads: a collective "hidden" behind compute still takes CPU from it. The overlap share says
how much communication ran concurrently with compute; the step time, against the same model
with no gradient sync at all (`ddp-nosync`), says what the communication cost.

The host must be otherwise idle for the step times to mean anything. Each setting's run
measures the CPU time the host spent on other processes meanwhile (/proc/stat less the ranks'
own); a round in which they took over 10% of the CPUs is left out of the summary (kept in the
JSON's rows), settings left with fewer than 2 clean rounds get more rounds (for at most
--retry-s), and the table says how many rounds each line kept.

    python bench/overlap.py            # 16 settings x 5 rounds, into overlap.json/csv/png (~6 min)
    python bench/overlap.py --quick    # 5 settings, 1 round, into *-quick.* (~30 s)
    python bench/overlap.py --plot-only

Needs matplotlib for the figure (the `bench` extra). Beside this entry point (options, the
run, the output files): bench/overlap_sweep.py has the settings and the plan,
bench/overlap_ranks.py what each rank runs, bench/overlap_trace.py the accounting
(`analyze`), bench/overlap_report.py the summary, table and figure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import asdict, replace
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.multiprocessing as mp
from torch.distributed.fsdp import FSDPModule

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.overlap_ranks import free_port, worker  # noqa: E402
from bench.overlap_report import MIB, plot, print_table, summarize, write_csv  # noqa: E402
from bench.overlap_sweep import (  # noqa: E402
    VOCAB,
    WORLD,
    Plan,
    Setting,
    full_settings,
    quick_settings,
)
from bench.overlap_trace import COMM_PREFIXES  # noqa: E402

RESULTS = REPO / "bench" / "results" / "overlap.json"
FIGURE = REPO / "docs" / "figures" / "overlap.png"


def run(settings: list[Setting], plan: Plan, deadline_s: float) -> dict:
    """Both ranks in child processes; killed past deadline_s so the benchmark always ends."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        ctx = mp.spawn(
            worker, args=(free_port(), settings, plan, str(out)), nprocs=WORLD, join=False
        )
        t0 = time.monotonic()
        while not ctx.join(timeout=2):
            if time.monotonic() - t0 > deadline_s:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"the sweep took over {deadline_s:.0f} s; killed")
        return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="5 settings, 1 round, fewer steps")
    ap.add_argument("--settings", default="", help="comma-separated setting names (default all)")
    ap.add_argument("--n-layer", type=int, default=Plan.n_layer)
    ap.add_argument("--n-embd", type=int, default=Plan.n_embd)
    ap.add_argument("--batch-size", type=int, default=Plan.batch_size)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--profiled", type=int, default=None, help="profiled steps per setting")
    ap.add_argument("--gap-us", type=float, default=Plan.gap_us)
    ap.add_argument("--retry-s", type=float, default=None, help="time for extra rounds")
    ap.add_argument("--deadline-s", type=float, default=900.0, help="kill the sweep after this")
    ap.add_argument("--out", type=Path, default=None, help="JSON path (csv beside it)")
    ap.add_argument("--figure", type=Path, default=None)
    ap.add_argument("--no-figure", action="store_true")
    ap.add_argument("--keep-traces", default="", help="keep the Chrome traces in this folder")
    ap.add_argument("--plot-only", action="store_true", help="redraw the figure from the JSON")
    a = ap.parse_args(argv)

    suffix = "-quick" if a.quick else ""
    out = a.out or RESULTS.with_name(f"overlap{suffix}.json")
    figure = a.figure or FIGURE.with_name(f"overlap{suffix}.png")
    if a.plot_only:
        plot(json.loads(out.read_text()), figure)
        print(f"wrote {figure}")
        return 0

    every = full_settings()
    settings = quick_settings() if a.quick else every
    if a.settings:
        names = a.settings.split(",")
        unknown = set(names) - {s.name for s in every}
        if unknown:
            ap.error(f"unknown settings {sorted(unknown)}; known: {[s.name for s in every]}")
        settings = [s for s in every if s.name in names]
    if any(s.async_unshard for s in settings) and not hasattr(FSDPModule, "_set_unshard_async_op"):
        print("this torch has no FSDPModule._set_unshard_async_op: -async settings skipped")
        settings = [s for s in settings if not s.async_unshard]
    if a.keep_traces:
        Path(a.keep_traces).mkdir(parents=True, exist_ok=True)
    plan = Plan(
        n_layer=a.n_layer,
        n_embd=a.n_embd,
        batch_size=a.batch_size,
        gap_us=a.gap_us,
        trace_dir=str(Path(a.keep_traces).resolve()) if a.keep_traces else "",
    )
    if a.quick:
        plan = replace(plan, warmup=2, timed=3, profiled=2, rounds=1, retry_s=0.0)
    plan = replace(
        plan,
        rounds=a.rounds if a.rounds is not None else plan.rounds,
        profiled=a.profiled if a.profiled is not None else plan.profiled,
        retry_s=a.retry_s if a.retry_s is not None else plan.retry_s,
    )
    cpus = os.cpu_count()
    print(
        f"{len(settings)} settings x {plan.rounds} round(s), {WORLD} gloo ranks on {cpus} CPU "
        f"cores, GPT {plan.n_layer} layers x {plan.n_embd}, batch {plan.batch_size}x"
        f"{plan.block_size} per rank",
        flush=True,
    )
    t0 = time.monotonic()
    load_before = os.getloadavg()[0]
    raw = run(settings, plan, a.deadline_s)
    meta = raw["meta"]
    print(
        f"model: {meta['params']:,} parameters, {meta['grad_bytes']:,} gradient bytes "
        f"({meta['grad_bytes'] / MIB:.2f} MiB fp32); its all-reduce alone (no compute running): "
        f"{meta['isolated_all_reduce_s'] * 1e3:.1f} ms"
    )
    summary = summarize(raw, settings)
    result = {
        "config": {
            **asdict(plan),
            "world": WORLD,
            "vocab": VOCAB,
            "settings": [asdict(s) for s in settings],
            "cpu_count": cpus,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "comm_events": [p + "*" for p in COMM_PREFIXES],
            "started_utc": datetime.now(UTC).isoformat(timespec="seconds"),
            "wall_s": round(time.monotonic() - t0, 1),
            # Anything else running on the host shows in the step times: its load, before/after.
            "loadavg_1m": [load_before, os.getloadavg()[0]],
            **meta,
        },
        "summary": summary,
        "rows": raw["rows"],
    }
    print_table(summary)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    write_csv(summary, out.with_suffix(".csv"))
    print(f"wrote {out} and {out.with_suffix('.csv')}")
    if not a.no_figure and plot(result, figure):
        print(f"wrote {figure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
