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

Needs matplotlib for the figure (the `bench` extra).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import FSDPModule

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from trainer.config import JobConfig, ModelArgs, ParallelArgs, TrainArgs  # noqa: E402
from trainer.distributed import close_distributed, init_distributed  # noqa: E402
from trainer.parallel import Parallelized  # noqa: E402
from trainer.train import build_model  # noqa: E402

RESULTS = REPO / "bench" / "results" / "overlap.json"
FIGURE = REPO / "docs" / "figures" / "overlap.png"
MIB = 1 << 20
WORLD = 2
VOCAB = 256  # a byte-level vocabulary, as a text file dataset has
# The record_function marks the benchmark puts around each step and its phases.
MARK = "overlap::"
STEP, PHASES = MARK + "step", ("forward", "backward", "optimizer")
# Events that are communication: ProcessGroupGloo names each collective's work "gloo:<op>".
COMM_PREFIXES = ("gloo:",)
# Operators on the main thread that launch or wait for communication: never compute.
COMM_OP_PREFIXES = ("c10d::", "_c10d_functional::", "c10d_functional::", "gloo:")
# Frames whose self time can be a Python-level wait for a collective (FSDP2's synchronous
# all-gather waits in Python, between its operators, inside these record_functions).
WAIT_FRAMES = ("FSDP::",)


# --- the settings swept ----------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """One configuration of the sweep."""

    name: str
    mode: str  # ParallelArgs.mode: ddp, fsdp or fsdp-noreshard
    bucket_cap_mb: float = 25.0
    sync: bool = True  # False: DDP no_sync on every step, the compute-only baseline
    prefetch: int = 0  # explicit FSDP2 forward/backward prefetch depth; 0: FSDP2's implicit
    async_unshard: bool = False  # FSDPModule._set_unshard_async_op(True)

    @property
    def label(self) -> str:
        if self.mode == "ddp":
            return "ddp no sync" if not self.sync else f"ddp {self.bucket_cap_mb:g} MiB"
        how = "implicit" if self.prefetch == 0 else f"explicit {self.prefetch}"
        return f"{self.mode} {how}" + (" async" if self.async_unshard else "")


DDP_BUCKETS_MB = (0.05, 0.25, 1.0, 3.0, 6.0, 25.0)


def full_settings() -> list[Setting]:
    out = [Setting("ddp-nosync", "ddp", sync=False)]
    out += [Setting(f"ddp-{b:g}", "ddp", bucket_cap_mb=b) for b in DDP_BUCKETS_MB]
    for mode in ("fsdp", "fsdp-noreshard"):
        out.append(Setting(f"{mode}-implicit", mode))
        if mode == "fsdp":
            # Explicit prefetch alone: on CPU the prefetched all-gather still blocks.
            out.append(Setting(f"{mode}-explicit1", mode, prefetch=1))
        out.append(Setting(f"{mode}-implicit-async", mode, async_unshard=True))
        out.append(Setting(f"{mode}-explicit1-async", mode, prefetch=1, async_unshard=True))
        out.append(Setting(f"{mode}-explicit2-async", mode, prefetch=2, async_unshard=True))
    return out


def quick_settings() -> list[Setting]:
    keep = {"ddp-nosync", "ddp-1", "ddp-25", "fsdp-implicit", "fsdp-explicit1-async"}
    return [s for s in full_settings() if s.name in keep]


@dataclass(frozen=True)
class Plan:
    """Sizes and lengths of a run."""

    n_layer: int = 4
    n_embd: int = 256
    n_head: int = 4
    block_size: int = 32
    batch_size: int = 16  # sequences per rank per step
    warmup: int = 3
    timed: int = 6  # unprofiled steps: the step time
    profiled: int = 3  # steps under the profiler: the overlap accounting
    rounds: int = 5  # every setting once per round, rounds interleaved against drift
    gap_us: float = 100.0
    trace_dir: str = ""  # keep each rank's Chrome trace here (empty: delete them)
    retry_s: float = 150.0  # at most this long for extra rounds of settings short of clean ones


# --- trace analysis --------------------------------------------------------------------------


class Ev(NamedTuple):
    """One complete event of a trace, times in microseconds."""

    name: str
    tid: int | str
    start: float
    end: float


Intervals = list[tuple[float, float]]


def union(iv: Iterable[tuple[float, float]]) -> Intervals:
    out: Intervals = []
    for a, b in sorted(iv):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def intersect(x: Intervals, y: Intervals) -> Intervals:
    """Of two unions (sorted, disjoint)."""
    out: Intervals = []
    i = j = 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if a < b:
            out.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(x: Intervals, y: Intervals) -> Intervals:
    """x minus y, both unions."""
    out: Intervals = []
    j = 0
    for a, b in x:
        while j < len(y) and y[j][1] <= a:
            j += 1
        k, cur = j, a
        while k < len(y) and y[k][0] < b:
            if y[k][0] > cur:
                out.append((cur, y[k][0]))
            cur = max(cur, y[k][1])
            k += 1
        if cur < b:
            out.append((cur, b))
    return out


def length(iv: Intervals) -> float:
    return sum(b - a for a, b in iv)


def clip(iv: Intervals, lo: float, hi: float) -> Intervals:
    return [(max(a, lo), min(b, hi)) for a, b in iv if b > lo and a < hi]


def self_intervals(events: Sequence[Ev]) -> list[tuple[Ev, Intervals]]:
    """Each event of one thread with its self time: its interval less its children's (the
    events nested in it). An operator's self time is the work it did itself: aten::addmm's
    matmul, not the aten::expand and aten::copy_ it calls."""
    ordered = sorted(events, key=lambda e: (e.start, -e.end))
    children: list[list[tuple[float, float]]] = [[] for _ in ordered]
    stack: list[int] = []
    for i, e in enumerate(ordered):
        while stack and ordered[stack[-1]].end <= e.start:
            stack.pop()
        # Events of one thread nest; one that crosses the end of the open one is not its child.
        if stack and e.end <= ordered[stack[-1]].end:
            children[stack[-1]].append((e.start, e.end))
        stack.append(i)
    return [
        (e, subtract([(e.start, e.end)], union(kids)))
        for e, kids in zip(ordered, children, strict=True)
    ]


def is_comm_op(name: str) -> bool:
    return name.startswith(COMM_OP_PREFIXES) or "wait" in name.lower()


def is_compute(name: str) -> bool:
    """Whether an event's self time on the main thread is compute."""
    return not (is_comm_op(name) or name.startswith(WAIT_FRAMES) or name.startswith(MARK))


def events_from_chrome_trace(path: Path | str) -> list[Ev]:
    """The complete ("X") events of a torch.profiler Chrome trace."""
    trace = json.loads(Path(path).read_text())
    out = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or "dur" not in e:
            continue
        start = float(e["ts"])
        out.append(Ev(e["name"], e.get("tid", 0), start, start + float(e["dur"])))
    return out


def _account(comm: Intervals, busy: Intervals, lo: float, hi: float) -> dict:
    c = clip(comm, lo, hi)
    hidden = length(intersect(c, clip(busy, lo, hi)))
    total = length(c)
    return {
        "comm_us": total,
        "hidden_us": hidden,
        "exposed_us": total - hidden,
        "share": hidden / total if total > 0 else None,
    }


def step_marks(events: Sequence[Ev]) -> list[Ev]:
    return sorted((e for e in events if e.name == STEP), key=lambda e: e.start)


def collectives_by_step(events: Sequence[Ev]) -> list[list[tuple[float, float]]]:
    """Per step, this rank's collectives (start, end) in the order they started."""
    comm = sorted((e.start, e.end) for e in events if e.name.startswith(COMM_PREFIXES))
    return [[c for c in comm if s.start <= c[0] < s.end] for s in step_marks(events)]


def closed_by_phase(comm: Sequence[Ev], windows: Sequence[Ev]) -> tuple[list[Ev], list]:
    """The collectives, each ended no later than the end of the innermost window (phase, else
    step) in which it started; and (collective, microseconds cut) for those shortened.

    Every mode here waits for a collective in the phase that started it (DDP's end-of-backward
    wait for all buckets, FSDP2's unit hooks and synchronous reduce-scatter, the clip's
    wait_tensor), so by the phase's end it is complete. Its trace event can close later: gloo
    completes the collective's future (which wakes the waiting main thread) before the worker
    thread ends the event, and on busy cores that worker may get a core again only
    milliseconds later. Without the cut such a tail would count as communication hidden behind
    the next phase's compute."""
    out, cut = [], []
    for e in comm:
        inside = [w for w in windows if w.start <= e.start < w.end]
        if inside:
            end = min(w.end for w in inside)
            if e.end > end:
                cut.append((e, e.end - end))
                e = e._replace(end=end)
        out.append(e)
    return out, cut


def peer_waits(own: list[tuple[float, float]], peers: list[list[tuple[float, float]]]) -> Intervals:
    """The part of each of this rank's collectives spent before the last rank joined it.

    Every rank runs the same collectives in the same order, so the i-th to start here is the
    i-th to start on each peer (the ranks share the host's clock). A collective cannot move
    data before every rank has entered it: from its start here to the latest start among the
    peers, this rank only waits for a slower rank (load imbalance, not the network)."""
    out = []
    for i, (a, b) in enumerate(own):
        last = max([a] + [p[i][0] for p in peers if i < len(p)])
        out.append((a, min(b, last)))
    return union(out)


def analyze(
    events: Sequence[Ev],
    gap_us: float = 100.0,
    peers: Sequence[Sequence[list[tuple[float, float]]]] = (),
) -> list[dict]:
    """Per profiled step (an `overlap::step` event): step length, communication time, and the
    parts of it hidden behind the main thread's compute and exposed, also per phase.

    The main thread is the one with the step marks; communication is every COMM_PREFIXES event
    on any thread. `peers`: each other rank's `collectives_by_step`, to split off the time a
    collective waited for a slower rank (`peer_wait_us`, and the exposed part of it). All times
    in microseconds."""
    steps = step_marks(events)
    if not steps:
        raise ValueError(f"no {STEP} events in the trace")
    tids = {e.tid for e in steps}
    if len(tids) != 1:
        raise ValueError(f"{STEP} events on several threads: {tids}")
    main = tids.pop()
    on_main = [e for e in events if e.tid == main]
    phase_marks = {p: [e for e in events if e.name == MARK + p] for p in PHASES}
    comm_events, cut = closed_by_phase(
        [e for e in events if e.name.startswith(COMM_PREFIXES)],
        [m for marks in phase_marks.values() for m in marks] + steps,
    )
    comm = union((e.start, e.end) for e in comm_events)
    comm_ops = union((e.start, e.end) for e in on_main if is_comm_op(e.name))
    work = union(iv for e, own in self_intervals(on_main) if is_compute(e.name) for iv in own)
    # Short gaps between two compute operators are the interpreter between ops: busy, unless
    # a communication operator is running there (a short synchronous collective is a wait).
    gaps = [(a[1], b[0]) for a, b in zip(work, work[1:], strict=False) if b[0] - a[1] < gap_us]
    busy = union(work + subtract(union(gaps), comm_ops))
    ordered = sorted(comm_events, key=lambda e: e.start)
    own = [[(e.start, e.end) for e in ordered if s.start <= e.start < s.end] for s in steps]
    out = []
    for k, s in enumerate(steps):
        row = {
            "step_us": s.end - s.start,
            "busy_us": length(clip(busy, s.start, s.end)),
            "collectives": sum(1 for e in comm_events if s.start <= e.start < s.end),
            "tail_cut_us": sum(c for e, c in cut if s.start <= e.start < s.end),
            "comm_sum_us": sum(
                min(e.end, s.end) - max(e.start, s.start)
                for e in comm_events
                if e.end > s.start and e.start < s.end
            ),
            **_account(comm, busy, s.start, s.end),
            "peer_wait_us": None,
            "exposed_peer_wait_us": None,
            "phases": {},
        }
        theirs = [p[k] for p in peers if k < len(p)]
        if theirs and all(len(t) == len(own[k]) for t in theirs):
            wait = clip(peer_waits(own[k], theirs), s.start, s.end)
            row["peer_wait_us"] = length(wait)
            row["exposed_peer_wait_us"] = length(subtract(wait, busy))
        for p, marks in phase_marks.items():
            inside = [m for m in marks if m.start >= s.start and m.end <= s.end]
            if inside:
                m = inside[0]
                row["phases"][p] = _account(comm, busy, m.start, m.end)
                row["phases"][p]["collectives"] = sum(
                    1 for e in comm_events if m.start <= e.start < m.end
                )
        out.append(row)
    return out


# --- the ranks ---------------------------------------------------------------------------------


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


# --- summary, table, figure ------------------------------------------------------------------


FOREIGN_MAX = 0.10  # a round run while other processes used more of the CPUs is left out


MIN_CLEAN = 2  # rounds per setting to run again for, on a host shared with other work


def n_clean(rows: list[dict], name: str) -> int:
    return sum(
        1 for r in rows if r["setting"] == name and r.get("foreign_cpu_share", 0) <= FOREIGN_MAX
    )


def clean_rows(raw: dict, name: str) -> tuple[list[dict], str]:
    """The setting's rounds run with the host to the ranks alone (all of them if none was),
    and "kept/run" (with "none clean" when it had to use them all)."""
    rows = [r for r in raw["rows"] if r["setting"] == name]
    clean = [r for r in rows if r.get("foreign_cpu_share", 0.0) <= FOREIGN_MAX]
    kept = f"{len(clean)}/{len(rows)}" if clean else f"0/{len(rows)}, used all"
    return clean or rows, kept


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
