"""The planner against measurement, per layout: the reference trainer run for real (gloo on
CPU; NCCL with --gpu) in each layout, its ranks' weights, gradients and optimizer state after
a step and its median step time, beside the planner's memory and the step-time model's
prediction (trainer/step_time.py) for the same layout.

The CPU's figures are calibrated in the same run: AdamW's pass over the model's state timed
by itself, achieved FLOP/s from a 1-rank run of the same model less that pass (one thread per
rank, as every run here), gloo's bandwidth and per-hop latency from all-reduces of two sizes
at the layouts' world size, and three fixed costs from three layouts, CALIBRATION
(`fit_fixed_costs`): per collective a rank waits on (`Hardware.call_s`), per peer it waits
for in one (`Hardware.peer_s`), and per FSDP2 unit gather or reduce-scatter
(`Hardware.fsdp_unit_s`), solved from what tp4, tp2 x dp2 and ZeRO-3's measured steps have
beyond the rest of the model. The other eight layouts are predicted with those figures. Ranks
share the machine's cores, so a rank gets cores / ranks of the 1-rank FLOP/s, and a fixed cost
is ranks / cores times the CPU it takes.

Each layout is also run for 2 and for 4 steps under torch.profiler, and its collectives per
step (the difference, by kind) are compared with the count the model uses
(trainer/step_time.collective_calls).

    python bench/layouts.py            # ~8 min on 2 cores; bench/results/layouts.json + figure
    python bench/layouts.py --quick    # three layouts, fewer steps
    python bench/layouts.py --plot-only
    python bench/layouts.py --repredict [--results PATH]   # stored measurements, model now

Results and what they mean: docs/planner.md ("Per layout").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from trainer.config import parse_args  # noqa: E402
from trainer.layout import (  # noqa: E402
    MODE_ZERO,
    _params,
    cpu_hardware,
    model_shape,
    resident_bytes,
)
from trainer.planner import ClusterShape, evaluate  # noqa: E402
from trainer.step_time import (  # noqa: E402
    Hardware,
    collective_calls,
    flops_per_gpu,
    fsdp_unit_calls,
    step_time,
    waited_calls,
    waited_peers,
)

RESULTS = REPO / "bench" / "results" / "layouts.json"
FIGURE = REPO / "docs" / "figures" / "layouts.png"

MODEL = ["--n-layer", "4", "--n-embd", "128", "--n-head", "4", "--block-size", "32",
         "--batch-size", "8", "--global-batch-size", "64", "--log-every", "1000",
         "--checkpoint-every", "0", "--warmup-steps", "2"]  # fmt: skip
VOCAB = 13  # synthetic://addition

# (label, world, flags)
LAYOUTS = [
    ("ddp", 4, ["--parallel", "ddp"]),
    ("zero1", 4, ["--parallel", "zero1"]),
    ("fsdp-noreshard (ZeRO-2)", 4, ["--parallel", "fsdp-noreshard"]),
    ("fsdp (ZeRO-3)", 4, ["--parallel", "fsdp"]),
    ("tp2 x dp2 fsdp", 4, ["--parallel", "fsdp", "--tp", "2"]),
    ("tp4", 4, ["--parallel", "ddp", "--tp", "4"]),
    ("pp2 x dp2 1f1b", 4, ["--parallel", "ddp", "--pp", "2"]),
    ("pp2 x dp2 gpipe", 4, ["--parallel", "ddp", "--pp", "2", "--pp-schedule", "gpipe"]),
    ("pp4 1f1b", 4, ["--parallel", "ddp", "--pp", "4"]),
    (
        "pp2x2 x dp2 interleaved",
        4,
        ["--parallel", "ddp", "--pp", "2", "--pp-schedule", "interleaved"],
    ),  # fmt: skip
    ("pp2 x dp2 x tp2 fsdp", 8, ["--parallel", "fsdp", "--pp", "2", "--tp", "2"]),
]
QUICK = {"ddp", "pp2 x dp2 1f1b", "tp2 x dp2 fsdp", "tp4", "fsdp (ZeRO-3)"}
# The three fixed costs' layouts: all-reduces over 4 ranks (tp4), over 2 (tp2 x dp2, which
# tells a cost per call from one per peer), and the most FSDP unit calls (ZeRO-3).
CALIBRATION = ("tp4", "tp2 x dp2 fsdp", "fsdp (ZeRO-3)")
# Each fixed cost (cpu_hardware's argument) and what predict() counts for it.
FIXED_COSTS = {"call_cpu_s": "waited_calls", "peer_cpu_s": "waited_peers",
               "fsdp_unit_cpu_s": "fsdp_unit_calls"}  # fmt: skip
# Profiler event names of gloo's collectives -> collective_calls' kinds.
GLOO_KINDS = {"gloo:all_reduce": "all_reduce", "gloo:all_gather": "all_gather",
              "gloo:reduce_scatter": "reduce_scatter", "gloo:broadcast": "broadcast",
              "gloo:send": "p2p", "gloo:recv": "p2p"}  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_gang(
    work: Path, world: int, flags: list[str], steps: int, count: bool = False
) -> list[dict]:
    """Every rank of one run, to the end; returns every metrics record of every rank (with
    `count`, under torch.profiler, rank 0's gloo collectives by kind instead)."""
    work.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = []
    for rank in range(world):
        env = {k: v for k, v in os.environ.items() if not k.startswith("LOCKSTEP_")}
        env.update(
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
            OMP_NUM_THREADS="1", LOCKSTEP_CHECKPOINT_DIR=str(work / "ckpt"),
            LOCKSTEP_METRICS_PATH=str(work / f"rank-{rank}.jsonl"), PYTHONPATH=str(REPO),
        )  # fmt: skip
        log = open(work / f"rank{rank}.log", "w")  # noqa: SIM115
        entry = (
            ["-c", COUNTING, str(work / "collectives-RANK.json")] if count else ["-m", "trainer"]
        )
        argv = [sys.executable, *entry, *MODEL, *flags, "--steps", str(steps)]
        procs.append(subprocess.Popen(argv, env=env, cwd=work, stdout=log, stderr=log))
    for rank, p in enumerate(procs):
        if p.wait(timeout=900) != 0:
            tail = (work / f"rank{rank}.log").read_text()[-2000:]
            raise RuntimeError(f"{work.name}: rank {rank} failed:\n{tail}")
    if count:
        return [json.loads((work / f"collectives-{r}.json").read_text()) for r in range(world)]
    rows = []
    for rank in range(world):
        rows += [json.loads(x) for x in (work / f"rank-{rank}.jsonl").read_text().splitlines()]
    return rows


# The trainer under torch.profiler (CPU events): each rank writes its gloo collectives by name.
COUNTING = """
import collections, json, os, sys
from torch.profiler import ProfilerActivity, profile
from trainer.train import main
out, sys.argv = sys.argv[1], ["trainer", *sys.argv[2:]]
with profile(activities=[ProfilerActivity.CPU]) as prof:
    main()
names = collections.Counter(e.name for e in prof.events() if e.name.startswith("gloo:"))
open(out.replace("RANK", os.environ["RANK"]), "w").write(json.dumps(names))
sys.stdout.flush()
os._exit(0)
"""


def as_gloo_runs(calls: dict[str, int]) -> dict[str, int]:
    """collective_calls' kinds as gloo runs them: it has no reduce-scatter, and FSDP2 falls
    back to an all-reduce."""
    out = dict(calls)
    if "reduce_scatter" in out:
        out["all_reduce"] = out.get("all_reduce", 0) + out.pop("reduce_scatter")
    return out


def count_collectives(work: Path, world: int, flags: list[str]) -> dict[str, float]:
    """The busiest rank's collectives per step by kind (the most of each kind over the
    ranks): runs of 4 and of 2 steps, the difference / 2 (what a run does once, setup and the
    final checkpoint, cancels)."""
    runs = [run_gang(work / f"count-{n}", world, flags, n, count=True) for n in (2, 4)]
    kinds: dict[str, float] = {}
    for rank in range(world):
        mine: dict[str, float] = {}
        for name, kind in GLOO_KINDS.items():
            per_step = (runs[1][rank].get(name, 0) - runs[0][rank].get(name, 0)) / 2
            mine[kind] = mine.get(kind, 0) + per_step
        for kind, n in mine.items():
            if n:
                kinds[kind] = max(kinds.get(kind, 0), n)
    return kinds


def median_step_s(rows: list[dict], skip: int) -> float:
    """Rank 0's median step time, the first `skip` steps (warm-up) left out."""
    times = [r["step_time_s"] for r in rows if r["kind"] == "step" and r["rank"] == 0]
    return statistics.median(times[skip:])


def _allreduce_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))  # fmt: skip
    result = {}
    for nbytes in (16 << 10, 16 << 20):
        buf = torch.ones(nbytes // 4)
        for _ in range(3):
            dist.all_reduce(buf)
        times = []
        for _ in range(15):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            times.append(time.perf_counter() - t0)
        result[nbytes] = statistics.median(times)
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def optimizer_step_s() -> float:
    """AdamW's step (the trainer's settings) over the reference GPT of MODEL, on one thread,
    gradients in place: the median of 20 after 3 to warm up."""
    import torch

    from trainer.model import GPT, GPTConfig

    cfg = parse_args(MODEL)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = GPT(GPTConfig(vocab_size=VOCAB, block_size=cfg.model.block_size,
                              n_layer=cfg.model.n_layer, n_head=cfg.model.n_head,
                              n_embd=cfg.model.n_embd))  # fmt: skip
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=(0.9, 0.99),
                                weight_decay=cfg.optim.weight_decay)  # fmt: skip
        times = []
        for i in range(23):
            t0 = time.perf_counter()
            opt.step()
            if i >= 3:
                times.append(time.perf_counter() - t0)
        return statistics.median(times)
    finally:
        torch.set_num_threads(threads)


def calibrate_network(world: int, work: Path) -> tuple[float, float]:
    """(bus bandwidth bytes/s, latency per ring hop s) from gloo all-reduces of two sizes:
    t = 2(n-1)/n x bytes / bw + 2(n-1) x hop."""
    import torch.multiprocessing as mp

    work.mkdir(parents=True, exist_ok=True)
    out = work / "allreduce.json"
    mp.spawn(_allreduce_worker, args=(world, free_port(), str(out)), nprocs=world, join=True)
    t = {int(k): v for k, v in json.loads(out.read_text()).items()}
    small, large = sorted(t)
    bus = lambda n: 2 * (world - 1) / world * n  # noqa: E731
    bw = (bus(large) - bus(small)) / max(t[large] - t[small], 1e-9)
    hop = max(t[small] - bus(small) / bw, 0.0) / (2 * (world - 1))
    return bw, hop


def predict(label: str, world: int, flags: list[str], hw_for) -> dict:
    cfg = parse_args([*MODEL, *flags])
    params = _params(cfg, VOCAB)
    model = model_shape(cfg, VOCAB, params, cfg.train.global_batch_size)
    cluster = ClusterShape(gpus=world, gpus_per_node=world, gpu_mem_gb=64.0, overhead_bytes=0)
    p = cfg.parallel
    dp = world // (p.tp * p.pp)
    zero = MODE_ZERO[p.mode] if dp > 1 else 0
    layout = evaluate(model, cluster, dp=dp, tp=p.tp, pp=p.pp, zero=zero,
                      stages_per_rank=p.stages_per_rank)  # fmt: skip
    t = step_time(model, cluster, layout, hw_for(world))
    model_calls: dict[str, int] = {}
    for kinds in collective_calls(model, layout).values():
        for kind, n in kinds.items():
            model_calls[kind] = model_calls.get(kind, 0) + n
    return {"resident": resident_bytes(layout), "time": t.to_dict(), "model": model,
            "cluster": cluster, "layout": layout, "calls": model_calls,
            "waited_calls": waited_calls(model, layout),
            "waited_peers": waited_peers(model, layout),
            "fsdp_unit_calls": fsdp_unit_calls(model, layout)}  # fmt: skip


def hardware(
    calibration: dict,
    world: int,
    cores: int,
    call_cpu_s: float = 0.0,
    peer_cpu_s: float = 0.0,
    unit_cpu_s: float = 0.0,
) -> Hardware:
    """The calibrated CPU as the model's hardware for `world` ranks on `cores` cores."""
    nets = calibration["gloo"]
    net = nets.get(str(world), nets["4"])
    return cpu_hardware(
        cores, world, flops_per_core=calibration["flops_per_rank_alone"],
        mem_bw=calibration["optimizer_mem_bw_alone"], bus_bw=net["bus_bw"],
        hop_latency_s=net["hop_latency_s"], call_cpu_s=call_cpu_s, peer_cpu_s=peer_cpu_s,
        fsdp_unit_cpu_s=unit_cpu_s,
        name=f"CPU {cores} cores, {world} ranks, gloo (calibrated)",
    )  # fmt: skip


def fit_fixed_costs(calibration: dict, runs: list[dict], cores: int) -> dict[str, float]:
    """The three fixed costs in CPU seconds (x cores / ranks: a rank pays its share of the
    cores) from CALIBRATION's layouts: each one's measured step less the model without fixed
    costs = a x calls waited on + b x peers waited for + c x FSDP unit calls, solved for a, b
    and c. A cost the noise drives below zero is dropped and the others fitted without it."""
    import numpy as np

    rows, left = [], []
    for label in CALIBRATION:
        run = next((r for r in runs if r["layout"] == label), None)
        if run is None:
            raise SystemExit(f"bench/layouts.py: the run has no {label!r} layout to calibrate on")
        bare = predict(label, run["world"], run["flags"],
                       lambda w: hardware(calibration, w, cores))  # fmt: skip
        per_core = 1 / min(1.0, cores / run["world"])
        rows.append([bare[k] * per_core for k in FIXED_COSTS.values()])
        left.append(run["measured_step_s"] - bare["time"]["total_s"])
    keep = list(range(len(FIXED_COSTS)))
    while True:
        a = np.array(rows)[:, keep]
        coef = np.linalg.lstsq(a, np.array(left), rcond=None)[0]
        if (coef >= 0).all() or len(keep) == 1:
            break
        keep.pop(int(np.argmin(coef)))
    fitted = dict.fromkeys(FIXED_COSTS, 0.0)
    for i, c in zip(keep, coef, strict=True):
        fitted[list(FIXED_COSTS)[i]] = max(0.0, float(c))
    return fitted


def evaluate_rows(calibration: dict, runs: list[dict], cores: int) -> tuple[dict, list[dict]]:
    """Each measured run (layout, world, flags, measured_bytes, measured_step_s,
    collectives_measured) beside the model's prediction, with the fixed costs fitted on
    CALIBRATION's three layouts (`fit_fixed_costs`)."""
    fitted = fit_fixed_costs(calibration, runs, cores)
    # A stored run re-predicted keeps only this model's fixed costs (older runs had others).
    stale = ("call_calibrated_on", "fsdp_unit_calibrated_on", "fsdp_unit_cpu_s")
    calibration = {k: v for k, v in calibration.items() if k not in stale}
    calibration = {**calibration, **fitted, "fixed_costs_calibrated_on": list(CALIBRATION)}
    call_cpu_s, peer_cpu_s, unit_cpu_s = fitted.values()
    rows = []
    for run in runs:
        label, world, flags, measured = (
            run["layout"],
            run["world"],
            run["flags"],
            run["measured_bytes"],
        )
        step_s, counted = run["measured_step_s"], run["collectives_measured"]
        pred = predict(
            label,
            world,
            flags,
            lambda w: hardware(calibration, w, cores, call_cpu_s, peer_cpu_s, unit_cpu_s),
        )
        bare = predict(label, world, flags, lambda w: hardware(calibration, w, cores))
        row = {
            "layout": label, "world": world, "flags": flags,
            "measured_bytes": measured, "predicted_bytes": pred["resident"],
            "memory_error": {k: measured[k] / pred["resident"][k] - 1 for k in measured},
            "measured_step_s": step_s, "predicted": pred["time"],
            "step_error": step_s / pred["time"]["total_s"] - 1,
            "step_error_without_call_cost": step_s / bare["time"]["total_s"] - 1,
            "calibration": label in CALIBRATION,
            "collectives_measured": counted, "collectives_model": as_gloo_runs(pred["calls"]),
            "waited_calls": pred["waited_calls"], "waited_peers": pred["waited_peers"],
            "fsdp_unit_calls": pred["fsdp_unit_calls"],
        }  # fmt: skip
        rows.append(row)
        print(
            f"{label:28} world {world}: state {sum(measured.values()) / 1e6:7.2f} MB measured, "
            f"{sum(pred['resident'].values()) / 1e6:7.2f} predicted; step "
            f"{step_s * 1e3:7.1f} ms measured, {pred['time']['total_s'] * 1e3:7.1f} predicted "
            f"({row['step_error']:+.0%}; {row['step_error_without_call_cost']:+.0%} without "
            f"the fixed costs); collectives {counted} measured, {as_gloo_runs(pred['calls'])} "
            "model",
            flush=True,
        )
    return calibration, rows


def repredict(report: dict) -> dict:
    calibration, rows = evaluate_rows(
        report["calibration"], report["rows"], report["machine"]["cores"]
    )
    return {**report, "calibration": calibration, "rows": rows,
            "repredicted_at": datetime.now(UTC).isoformat(timespec="seconds")}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--plot-only", action="store_true")
    ap.add_argument(
        "--repredict",
        action="store_true",
        help="the stored run's measurements and calibration against the model as it is now",
    )
    ap.add_argument("--work", default="/tmp/lockstep-bench-layouts")
    ap.add_argument("--results", type=Path, help="with --repredict: another stored run")
    args = ap.parse_args(argv)
    results = RESULTS.with_name("layouts-quick.json") if args.quick else RESULTS

    figure = FIGURE.with_name("layouts-quick.png") if args.quick else FIGURE
    if args.results:
        results = args.results
    if args.plot_only:
        if args.results:
            raise SystemExit("--plot-only draws the published run; --results is for --repredict")
        plot(json.loads(results.read_text()), figure)
        return 0
    if args.repredict:
        report = repredict(json.loads(results.read_text()))
        results.write_text(json.dumps(report, indent=1))
        if not args.results:  # the figure is of the published run
            plot(report, figure)
        return 0
    steps, skip = (12, 4) if args.quick else (30, 6)
    work = Path(args.work) / datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
    cores = len(os.sched_getaffinity(0))

    # Calibration: AdamW's pass over the model's state timed by itself, the same model's
    # step on one rank (its FLOPs at one rate plus that pass), and gloo at the worlds the
    # layouts use. (Two 1-rank runs at two batch sizes solved for both rates once; on
    # 2026-12-05 the small batch ran faster per FLOP than the large one and the fit gave the
    # optimizer 22 TB/s.)
    started = time.monotonic()
    unit = Hardware("unit", flops=1.0, intra_node_bw=1.0, inter_node_bw=1.0, mem_bw=1.0)
    flags = ["--parallel", "ddp", "--global-batch-size", "64"]
    rows = run_gang(work / "calibrate-1rank", 1, flags, steps)
    t1, one = median_step_s(rows, skip), predict("1 rank", 1, flags, lambda w: unit)
    t_opt = optimizer_step_s()
    matmuls = flops_per_gpu(one["model"], one["cluster"], one["layout"])
    mem_bw = (one["time"]["compute_s"] - matmuls) / t_opt  # AdamW's bytes (unit bw) / s
    flops = matmuls / max(t1 - t_opt, 1e-6)
    nets = {w: calibrate_network(w, work / f"net-{w}") for w in sorted({w for _, w, _ in LAYOUTS})}

    measured_runs = []
    for label, world, flags in LAYOUTS:
        if args.quick and label not in QUICK:
            continue
        name = label.replace(" ", "_")
        records = run_gang(work / name, world, flags, steps)
        measured = {
            part: max(r["measured_bytes"][part] for r in records if r["kind"] == "layout")
            for part in ("weights", "grads", "optimizer")
        }
        counted = count_collectives(work / f"{name}-count", world, flags)
        measured_runs.append((label, world, flags, measured, median_step_s(records, skip), counted))
        print(f"{label:28} world {world}: measured", flush=True)

    calibration = {
        "one_rank_step_s": t1,
        "optimizer_step_s": t_opt,
        "flops_per_rank_alone": flops,
        "optimizer_mem_bw_alone": mem_bw,
        "gloo": {str(w): {"bus_bw": bw, "hop_latency_s": hop} for w, (bw, hop) in nets.items()},
    }
    rows = [
        {"layout": label, "world": world, "flags": flags, "measured_bytes": measured,
         "measured_step_s": step_s, "collectives_measured": counted}
        for label, world, flags, measured, step_s, counted in measured_runs
    ]  # fmt: skip
    calibration, rows = evaluate_rows(calibration, rows, cores)
    report = {
        "generated_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"cores": cores, "platform": platform.platform()},
        "model_flags": MODEL,
        "steps": steps,
        "warmup_steps_skipped": skip,
        "calibration": calibration,
        "rows": rows,
        "elapsed_s": round(time.monotonic() - started, 1),
    }
    results.write_text(json.dumps(report, indent=1))
    plot(report, figure)
    print(f"wrote {results} and {figure} in {report['elapsed_s']:.0f} s")
    return 0


def plot(report: dict, figure: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    labels = [r["layout"] + (" (fit)" if r.get("calibration") else "") for r in rows]
    y = range(len(rows))
    fig, (mem, step) = plt.subplots(1, 2, figsize=(12, 0.5 * len(rows) + 2), sharey=True)
    measured = [sum(r["measured_bytes"].values()) / 1e6 for r in rows]
    predicted = [sum(r["predicted_bytes"].values()) / 1e6 for r in rows]
    mem.barh([i + 0.2 for i in y], predicted, 0.4, label="predicted", color="#9ecae1")
    mem.barh([i - 0.2 for i in y], measured, 0.4, label="measured", color="#3182bd")
    mem.set_xlabel("weights + grads + optimizer state, largest rank (MB)")
    mem.set_yticks(list(y), labels)
    mem.invert_yaxis()
    mem.legend(loc="lower right")
    parts = [("compute_s", "compute", "#fdae6b"), ("exposed_comm_s", "exposed comm", "#e6550d"),
             ("bubble_s", "bubble", "#a63603")]  # fmt: skip
    left = [0.0] * len(rows)
    for key, name, colour in parts:
        values = [r["predicted"][key] * 1e3 for r in rows]
        step.barh([i + 0.2 for i in y], values, 0.4, left=left, label=f"predicted {name}",
                  color=colour)  # fmt: skip
        left = [a + b for a, b in zip(left, values, strict=True)]
    step.barh([i - 0.2 for i in y], [r["measured_step_s"] * 1e3 for r in rows], 0.4,
              label="measured", color="#31a354")  # fmt: skip
    step.set_xlabel("step time (ms, median)")
    step.legend(loc="lower right", fontsize=8)
    cores = report["machine"]["cores"]
    fig.suptitle(f"Planner vs measurement per layout (reference GPT, gloo on {cores} CPU cores)")
    fig.tight_layout()
    figure.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(figure, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
