"""What each of the overlap bench's gloo ranks runs (bench/overlap.py spawns `worker`): the
reference GPT built and wrapped as the trainer does, its steps with the phases marked for the
profiler, the timed and profiled rounds of every setting, and the host's CPU use meanwhile."""

from __future__ import annotations

import json
import os
import socket
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from bench.overlap_sweep import MIN_CLEAN, VOCAB, WORLD, Plan, Setting, n_clean
from bench.overlap_trace import MARK, STEP, analyze, collectives_by_step, events_from_chrome_trace
from trainer.config import JobConfig, ModelArgs, ParallelArgs, TrainArgs
from trainer.distributed import close_distributed, init_distributed
from trainer.parallel import Parallelized
from trainer.train import build_model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_config(setting: Setting, plan: Plan) -> JobConfig:
    return JobConfig(
        model=ModelArgs(
            n_layer=plan.n_layer,
            n_head=plan.n_head,
            n_embd=plan.n_embd,
            block_size=plan.block_size,
        ),
        train=TrainArgs(batch_size=plan.batch_size),
        parallel=ParallelArgs(mode=setting.mode, bucket_cap_mb=setting.bucket_cap_mb),
    )


def apply_prefetch(par: Parallelized, setting: Setting) -> None:
    """FSDP2's prefetch knobs on the trainer's FSDP layout (each block a unit, the root the
    rest); nothing for DDP or the implicit default."""
    if not setting.mode.startswith("fsdp"):
        return
    root = par.base
    units = [b for _, b in root.blocks.named_children()]
    d = setting.prefetch
    if d > 0:
        # Forward: each unit gathers the next d while it computes (the root, first to run,
        # starts the first blocks). Backward runs the blocks in reverse: each unit gathers the
        # d before it; the root (the head, first in backward) starts the last blocks.
        root.set_modules_to_forward_prefetch(units[:d])
        root.set_modules_to_backward_prefetch(units[::-1][:d])
        for i, u in enumerate(units):
            nxt = units[i + 1 : i + 1 + d]
            if nxt:
                u.set_modules_to_forward_prefetch(nxt)
            prev = units[max(0, i - d) : i][::-1]
            if prev:
                u.set_modules_to_backward_prefetch(prev)
    if setting.async_unshard:
        # On CPU the only way an all-gather leaves the main thread: issue it with async_op=True
        # and wait for it at the unit's copy-out. Private in torch 2.13 (no public setter).
        root._set_unshard_async_op(True)


def one_step(par: Parallelized, optimizer, cfg: JobConfig, x, y, sync: bool) -> float:
    """trainer/train.py train_step for one micro-batch, with the phases marked for the trace."""
    rf = torch.profiler.record_function
    with rf(STEP):
        optimizer.zero_grad(set_to_none=True)
        # no_sync must cover the forward too (DDP decides at forward whether to reduce).
        with par.grad_sync(sync):
            with rf(MARK + "forward"), par.autocast():
                _, loss = par.module(x, y)
            with rf(MARK + "backward"):
                loss.backward()  # DDP waits for its last buckets inside this call
        with rf(MARK + "optimizer"):
            if cfg.optim.grad_clip > 0:
                par.clip_grads(cfg.optim.grad_clip)
            optimizer.step()
        return loss.item()


def gather(value: object) -> list:
    box: list = [None] * dist.get_world_size()
    dist.all_gather_object(box, value)
    return box


def ddp_buckets(par: Parallelized) -> list[int] | None:
    get = getattr(par.module, "_get_ddp_logging_data", None)
    if get is None:
        return None
    data = get()
    # The buckets DDP rebuilt after the first step (in gradient-ready order), which it uses.
    sizes = str(data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or "")
    return [int(v) for v in sizes.split(",") if v.strip()]


def host_busy_s() -> float:
    """CPU seconds the whole host has spent busy (all cores, every process), from /proc/stat."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = ticks
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    t = os.times()  # this process, all its threads (gloo's included)
    return t.user + t.system


def run_setting(setting: Setting, plan: Plan, info, tmp: Path, rnd: int) -> dict:
    """One setting on this rank; the returned row is whole on every rank (gathered)."""
    cfg = job_config(setting, plan)
    model = build_model(cfg, VOCAB, info)
    par = Parallelized(model, cfg.parallel, info)
    apply_prefetch(par, setting)
    optimizer = par.build_optimizer(cfg.optim)
    # Each rank its own batch (as data parallelism gives it); random tokens: the time of a
    # dense GPT does not depend on what the tokens say.
    g = torch.Generator().manual_seed(1000 * (rnd + 1) + info.rank)
    x = torch.randint(0, VOCAB, (plan.batch_size, plan.block_size), generator=g)
    y = torch.randint(0, VOCAB, (plan.batch_size, plan.block_size), generator=g)
    for _ in range(plan.warmup):
        one_step(par, optimizer, cfg, x, y, setting.sync)
    # Whatever else runs on the host takes cores from the ranks: measure how much did.
    dist.barrier()
    wall0, host0, own0 = time.monotonic(), host_busy_s(), own_cpu_s()
    times = []
    for _ in range(plan.timed):
        dist.barrier()  # every rank starts the step together: the slowest one sets its time
        t0 = time.perf_counter()
        one_step(par, optimizer, cfg, x, y, setting.sync)
        times.append(time.perf_counter() - t0)
    dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(plan.profiled):
            one_step(par, optimizer, cfg, x, y, setting.sync)
    dist.barrier()
    wall = time.monotonic() - wall0
    # Rank 0's view of the host, so that every rank gets the same number (and makes the same
    # decision on a retry).
    cpu = gather((host_busy_s() - host0, own_cpu_s() - own0))
    foreign = max(0.0, cpu[0][0] - sum(c[1] for c in cpu)) / (wall * (os.cpu_count() or 1))
    trace = Path(plan.trace_dir or tmp) / f"{setting.name}-r{rnd}-rank{info.rank}.json"
    prof.export_chrome_trace(str(trace))
    events = events_from_chrome_trace(trace)
    every = gather(collectives_by_step(events))
    peers = [c for r, c in enumerate(every) if r != info.rank]
    steps = analyze(events, plan.gap_us, peers)
    if not plan.trace_dir:
        trace.unlink()
    mine = {"rank": info.rank, "step_s": times, "profiled": steps}
    ranks = gather(mine)
    step_s = [max(r["step_s"][i] for r in ranks) for i in range(plan.timed)]
    return {
        "setting": setting.name,
        "round": rnd,
        "step_s": step_s,
        "step_s_median": statistics.median(step_s),
        # Share of the host's CPU capacity other processes used meanwhile (0: the ranks alone).
        "foreign_cpu_share": foreign,
        "buckets": ddp_buckets(par),
        "ranks": sorted(ranks, key=lambda r: r["rank"]),
    }


def isolated_all_reduce_s(numel: int, reps: int = 5) -> float:
    """The whole gradient's all-reduce with nothing else running (slowest rank, median)."""
    buf = torch.randn(numel)
    dist.all_reduce(buf)
    out = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out.append(float(t))
    return statistics.median(out)


def worker(rank: int, port: int, settings: list[Setting], plan: Plan, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(WORLD),
        LOCKSTEP_DEVICE="cpu",
    )
    # One compute thread per rank, as the trainer's configure_threads picks for 2 ranks on 2
    # cores; gloo adds its own threads on top.
    torch.set_num_threads(1)
    info = init_distributed()
    probe = build_model(job_config(settings[0], plan), VOCAB, info)
    numel = sum(p.numel() for p in probe.parameters())
    meta = {"params": numel, "grad_bytes": 4 * numel}
    meta["isolated_all_reduce_s"] = isolated_all_reduce_s(numel)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        # A setting run and thrown away: the first one after start-up pays for first touches
        # (allocator, gloo connections, lazy imports) that would count against it.
        run_setting(settings[0], replace(plan, timed=1, profiled=1), info, Path(tmp), -1)
        for rnd in range(plan.rounds):
            # Each round starts one setting later, so no setting is always the first after
            # start-up or always follows the same one.
            k = rnd % len(settings)
            for s in settings[k:] + settings[:k]:
                rows.append(run_setting(s, plan, info, Path(tmp), rnd))
                report(rows[-1], rank)
        # On a shared host: more rounds for the settings with fewer than MIN_CLEAN rounds run
        # while the ranks had the CPUs to themselves, for at most plan.retry_s.
        t0, rnd = time.monotonic(), plan.rounds

        def in_time() -> bool:  # rank 0's clock decides, so every rank stops at the same point
            return gather(time.monotonic() - t0 < plan.retry_s)[0]

        while in_time():
            short = [s for s in settings if n_clean(rows, s.name) < MIN_CLEAN]
            if not short:
                break
            for s in short:
                if not in_time():
                    break
                rows.append(run_setting(s, plan, info, Path(tmp), rnd))
                report(rows[-1], rank)
            rnd += 1
    if rank == 0:
        Path(out).write_text(json.dumps({"meta": meta, "rows": rows}))
    close_distributed(info, destroy=False)


def report(row: dict, rank: int) -> None:
    if rank == 0:
        print(
            f"  round {row['round']} {row['setting']:<32} step {row['step_s_median'] * 1e3:7.1f} ms"
            f"  (other processes: {100 * row['foreign_cpu_share']:.0f}% of the CPUs)",
            flush=True,
        )
