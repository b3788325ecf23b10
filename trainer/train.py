"""The training loop: build everything, resume if asked, train, checkpoint, stop cleanly.

Preemption (DESIGN.md section 7): SIGTERM (or SIGINT) asks for a stop. At each step boundary
the ranks all-reduce their stop flags, so all of them stop after the same step; they save and
commit a checkpoint for that step, write an `end` record with reason "preempted" and exit 0.
A second signal stops the process at once. A finished run also ends with a committed checkpoint
of its last step and an `end` record with reason "finished".

Each step trains on the next global batch of the data stream (trainer/data.py): this rank's
slice of it, in micro-batches when the global batch is larger than batch_size x data-parallel
ranks (gradient accumulation, the gradient sync only on the last one). The model is spread over
the ranks as --parallel and --tp say (trainer/parallel.py). docs/training.md has the whole story.

Hang diagnosis: SIGUSR1 writes every thread's Python stack to stderr (the rank's log under the
node agent) and the process keeps running; see `install_stack_dump_handler`.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TextIO

import numpy as np
import torch

from trainer.checkpoint import CheckpointManager, TrainState
from trainer.config import JobConfig, TrainArgs, parse_args
from trainer.data import AdditionDataset, BatchPlan, Dataset, GlobalSampler, build_dataset
from trainer.distributed import DistInfo, close_distributed, init_distributed
from trainer.flight_recorder import serve_dump_pipe
from trainer.layout import for_launch, measured_bytes
from trainer.metrics import MetricsWriter
from trainer.model import GPT, GPTConfig
from trainer.parallel import Parallelized
from trainer.stop import StopFlag


def install_stack_dump_handler() -> None:
    """SIGUSR1 dumps the Python stack of every thread to stderr; the process carries on.

    The portal asks for this (through the node agent) when a job hangs: workers alive, no
    progress. A hung rank is usually blocked inside a collective, i.e. in a C++ call (gloo, NCCL)
    that never returns to the interpreter, so a Python-level `signal.signal` handler would never
    get to run: those only run in the main thread between bytecodes. faulthandler's handler is
    async-signal-safe C that walks the thread states without taking the GIL, so it works while
    Python code is blocked in a C call. Honest limits: it shows Python frames only (the frame
    that called into gloo/NCCL, not the C++ frames below it); a process that cannot run signal
    handlers at all (stopped, or stuck in uninterruptible kernel sleep) dumps nothing; and the
    dump is best-effort if a thread's frames change while it is being written.

    Cost: nothing until the signal arrives. chain=False because the previous disposition is the
    default one, which would terminate the process.
    """
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True, chain=False)


def _test_faults(rank: int, train: TrainArgs) -> Callable[[int], None] | None:
    """Fault injection for tests and benchmarks only; None (no per-step cost) unless asked for.

    --fault-stall-at-step N (or LOCKSTEP_TEST_STALL_AT_STEP): rank --fault-stall-rank sleeps
        forever right before step N's work, so the other ranks block in that step's gradient
        all-reduce: a realistic hang (workers alive, no progress). First launch only
        (TORCHELASTIC_RESTART_COUNT=0).
    --fault-slow-rank R --fault-slow-ms M (or LOCKSTEP_TEST_SLOW_RANK/_MS): rank R sleeps M ms
        before its forward pass every step: a straggler.
    The returned hook is called with the step number at the start of each step's work.
    """
    stall_at = train.fault_stall_at_step
    # Only the first launch stalls, so a test or benchmark can watch the platform recover.
    first_launch = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0) == 0
    stalls = stall_at > 0 and rank == train.fault_stall_rank and first_launch
    slow_s = train.fault_slow_ms / 1000
    slow = slow_s > 0 and rank == train.fault_slow_rank
    if not (stalls or slow):
        return None

    def fault(step: int) -> None:
        if stalls and step == stall_at:
            print(f"[rank {rank}] fault injection: stalling before step {step}")
            sys.stdout.flush()
            while True:
                time.sleep(3600)
        if slow:
            time.sleep(slow_s)

    return fault


class ComputeClock:
    """Times each step from its start until the forward pass and loss are computed.

    On CUDA the work is asynchronous, so wall time to the end of `model(x, y)` only measures
    kernel launches; CUDA events time it on the device's own timeline instead, with no extra
    synchronisation (the step's `loss.item()` already waits for the device before it is read).
    """

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        if self._cuda:
            self._start_event = torch.cuda.Event(enable_timing=True)
            self._forward_event = torch.cuda.Event(enable_timing=True)
        self._start = self._forward = 0.0

    def start(self) -> None:
        if self._cuda:
            self._start_event.record()
        else:
            self._start = time.perf_counter()

    def forward_done(self) -> None:
        if self._cuda:
            self._forward_event.record()
        else:
            self._forward = time.perf_counter()

    def seconds(self) -> float:
        """Only once the step has synchronised with the device."""
        if self._cuda:
            return self._start_event.elapsed_time(self._forward_event) / 1000
        return self._forward - self._start


def configure_threads(info: DistInfo) -> None:
    # Tiny matmuls gain nothing from many threads and several ranks per host would fight for
    # cores: honour OMP_NUM_THREADS, else a few cores per local rank.
    if os.environ.get("OMP_NUM_THREADS"):
        threads = int(os.environ["OMP_NUM_THREADS"])
    else:
        threads = min(4, len(os.sched_getaffinity(0)) // max(1, info.local_world_size))
    torch.set_num_threads(max(1, threads))


def build_model(cfg: JobConfig, vocab_size: int, info: DistInfo) -> GPT:
    model_cfg = GPTConfig(
        vocab_size=vocab_size,
        block_size=cfg.model.block_size,
        n_layer=cfg.model.n_layer,
        n_head=cfg.model.n_head,
        n_embd=cfg.model.n_embd,
    )
    # The same seed on every rank gives the same initial weights (DDP broadcasts rank 0's
    # anyway; this keeps 1-rank and N-rank runs identical at step 0).
    torch.manual_seed(cfg.train.seed)
    return GPT(model_cfg).to(info.device)


class DataFeed:
    """This rank's micro-batches of each step's global batch (the global sample order of
    trainer/data.py), and the optional record of every sample consumed (tests, debugging)."""

    def __init__(
        self, dataset: Dataset, cfg: JobConfig, plan: BatchPlan, dp_rank: int, rank: int
    ) -> None:
        self.dataset = dataset
        self.block_size = cfg.model.block_size
        self.sampler = GlobalSampler(dataset.num_samples(self.block_size), cfg.train.seed)
        self.plan = plan
        self.dp_rank = dp_rank
        self.ranges = plan.micro_ranges(dp_rank)
        self.rows = sum(stop - start for start, stop in self.ranges)
        self.rank = rank
        path = cfg.train.record_samples
        self._record: TextIO | None = None
        if path:
            target = Path(path.replace("{rank}", str(rank)))
            target.parent.mkdir(parents=True, exist_ok=True)
            self._record = open(target, "a", encoding="utf-8")  # noqa: SIM115

    def epoch_of(self, position: int) -> int:
        return position // self.sampler.num_samples

    def micro_batches(
        self, step: int, position: int
    ) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        """[(x, y, rows)] for the global batch that starts at sample `position`."""
        out = []
        for start, stop in self.ranges:
            epochs, ids = self.sampler.lookup(position + start, position + stop)
            x, y = self.dataset.samples(ids, block_size=self.block_size)
            out.append((x, y, stop - start))
            if self._record is not None:
                self._record.write(
                    json.dumps(
                        {
                            "step": step,
                            "rank": self.rank,
                            "dp_rank": self.dp_rank,
                            "positions": [position + start, position + stop],
                            "epochs": epochs.tolist(),
                            "ids": ids.tolist(),
                        }
                    )
                    + "\n"
                )
        if self._record is not None:
            self._record.flush()
        return out

    def close(self) -> None:
        if self._record is not None:
            self._record.close()


def check_pipeline_plan(plan: BatchPlan) -> None:
    """A pipeline schedule splits a replica's rows into equal micro-batches and averages their
    losses: unequal ones would weight some samples more than others."""
    sizes = {stop - start for r in range(plan.dp_size) for start, stop in plan.micro_ranges(r)}
    if len(sizes) > 1:
        raise ValueError(
            f"pipeline parallelism needs equal micro-batches: global batch {plan.global_batch} "
            f"over {plan.dp_size} replicas in micro-batches of at most {plan.micro_batch} gives "
            f"sizes {sorted(sizes)}; choose --global-batch-size as a multiple of "
            f"replicas x --batch-size"
        )


def lr_scale_at(state: TrainState, step: int, warmup_steps: int) -> float:
    """The linear-scaling multiplier for `step`: a ramp after a batch change, then constant."""
    if warmup_steps <= 0 or step >= state.lr_ramp_start + warmup_steps:
        return state.lr_scale_to
    frac = max(0, step - state.lr_ramp_start) / warmup_steps
    return state.lr_scale_from + (state.lr_scale_to - state.lr_scale_from) * frac


def batch_dp(dp: int, world_size: int, tag: str = "") -> int:
    """Data-parallel ranks the default global batch (batch size x ranks) is sized for: the job's
    full size. An elastic attempt on fewer GPUs than the job asked for ($LOCKSTEP_JOB_GPUS, set
    by the node agent) keeps the full-size global batch and accumulates gradients over more
    micro-batches, so a shrunk run trains the same model as a full one."""
    asked = int(os.environ.get("LOCKSTEP_JOB_GPUS") or 0)
    if asked <= world_size or asked % world_size:
        return dp
    print(
        f"{tag}trainer: elastic attempt on {world_size} of the job's {asked} GPUs; "
        f"global batch sized for {dp * asked // world_size} data-parallel ranks",
        flush=True,
    )
    return dp * asked // world_size


def resolve_batch(cfg: JobConfig, dp: int, resumed: TrainState | None, tag: str = "") -> TrainState:
    """The train state to continue with: the global batch, its reference, the lr ramp and the
    data position, reconciled with this launch's world size and flags."""
    t = cfg.train
    if resumed is None:
        g = t.global_batch_size or t.batch_size * dp
        return TrainState(global_batch=g, reference_global_batch=g)
    state = dataclasses.replace(resumed)
    if state.global_batch < 1:
        # A checkpoint from before the data position was saved: its steps used this batch.
        state.global_batch = t.global_batch_size or t.batch_size * dp
        state.reference_global_batch = state.global_batch
        state.sample_position = state.step * state.global_batch
        state.lr_scale_from = state.lr_scale_to = 1.0
        state.lr_ramp_start = 0
    if t.allow_batch_change:
        wanted = t.global_batch_size or t.batch_size * dp
        if wanted != state.global_batch:
            # Linear scaling rule (Goyal et al. 2017) with a warm-up from the current scale.
            now = lr_scale_at(state, state.step, cfg.optim.warmup_steps)
            state.lr_scale_from = now
            state.lr_scale_to = wanted / state.reference_global_batch
            state.lr_ramp_start = state.step
            print(
                f"{tag}trainer: global batch {state.global_batch} -> {wanted}; lr scale "
                f"{now:.3g} -> {state.lr_scale_to:.3g} over {cfg.optim.warmup_steps} steps",
                flush=True,
            )
            state.global_batch = wanted
    elif t.global_batch_size:
        state.global_batch = t.global_batch_size
    return state


def train(cfg: JobConfig) -> int:
    """Run the job described by cfg; returns the process exit code.

    Long on purpose, as torchtitan's train(): the whole life of a run (build, resume, the
    step loop with its checkpoint, stop and metric boundaries, the final save) reads top to
    bottom in the order it happens; each step's work is in train_step and the apply_* steps."""
    if cfg.train.deterministic:
        # cuBLAS is only deterministic with a fixed workspace, which must be chosen before
        # its first use; torch raises without it once deterministic algorithms are on.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    # Before the rendezvous, which can hang too (a peer that never arrives).
    install_stack_dump_handler()
    info = init_distributed()
    # What NCCL's watchdog does for NCCL, for gloo: the agent can ask for the recorder's ring.
    serve_dump_pipe(info.rank)
    # After the rendezvous: a stop requested while ranks are still gathering has nothing to
    # checkpoint, so the default action (terminate) is right until then.
    stop = StopFlag((signal.SIGTERM, signal.SIGINT))
    stop.install()
    configure_threads(info)
    tag = f"[rank {info.rank}] " if info.distributed else ""
    fault = _test_faults(info.rank, cfg.train)

    dataset = build_dataset(cfg.train.dataset)
    cfg, layout = for_launch(cfg, dataset.vocab_size, info)
    if layout is not None and info.is_main:
        print(f"{tag}trainer: layout ({layout.how}): {layout.describe()}", flush=True)
        for reason in layout.reasons:
            print(f"{tag}trainer:   - {reason}", flush=True)
    model = build_model(cfg, dataset.vocab_size, info)
    par = Parallelized(model, cfg.parallel, info)
    optimizer = par.build_optimizer(cfg.optim)
    metrics_path = cfg.train.metrics_path or f"metrics-rank{info.rank}.jsonl"
    metrics = MetricsWriter(metrics_path, info.rank)
    ckpt = CheckpointManager(
        cfg.train.checkpoint_dir,
        every=cfg.train.checkpoint_every,
        model=par.module,
        optimizer=optimizer,
        dist_info=info,
        metrics=metrics,
        marker_extra={"dataset": dataset.uri, "config": asdict(cfg)},
        commit_delay_s=cfg.train.fault_commit_delay_ms / 1000,
        async_save=cfg.train.async_checkpoint,
        async_type=cfg.train.async_checkpoint_type,
        async_staging=cfg.train.async_checkpoint_staging,
        save_delay_s=cfg.train.fault_save_delay_ms / 1000,
    )

    resume_dir = ckpt.resolve_resume(cfg.train.resume_from)
    resumed = ckpt.load(resume_dir) if resume_dir else None
    # Under pipeline parallelism a replica's default share of the batch is several
    # micro-batches (the schedule needs them to keep its stages busy).
    replicas = par.dims.dp * cfg.microbatches_per_replica
    state = resolve_batch(cfg, batch_dp(replicas, info.world_size, tag), resumed, tag)
    start_step = state.step
    plan = BatchPlan(state.global_batch, par.dims.dp, cfg.train.batch_size)
    if par.pipeline is not None:
        check_pipeline_plan(plan)
    feed = DataFeed(dataset, cfg, plan, par.dims.dp_rank, info.rank)
    # The newest step known to be saved in our own checkpoint dir, tracked in memory so
    # every rank makes the same save decision without re-reading the filesystem.
    saved_step = start_step if resume_dir == ckpt.step_dir(start_step) else -1
    metrics.start(
        world_size=info.world_size,
        resumed_from_step=start_step,
        device=str(info.device),
        total_steps=cfg.train.steps,
    )
    print(
        f"{tag}trainer: {model.num_params():,} params, dataset {dataset.uri}, "
        f"world size {info.world_size}, device {info.device}, "
        f"parallel {cfg.parallel.mode} ({par.dims.describe()}, {par.dtype}"
        + (f", {cfg.parallel.pp_schedule} schedule" if par.pipeline else "")
        + "), "
        f"global batch {plan.global_batch} = {plan.dp_size} x {plan.accum_steps} micro-batches "
        f"of <= {plan.micro_batch}, sample {state.sample_position} "
        f"(epoch {feed.epoch_of(state.sample_position)}), "
        + (f"resumed from {resume_dir} (step {start_step})" if resume_dir else "fresh start"),
        flush=True,
    )

    T = cfg.model.block_size
    step = start_step
    preempted = False
    interval = cfg.train.checkpoint_interval_s
    last_save = time.monotonic()
    time_due = False
    clock = ComputeClock(info.device)
    while step < cfg.train.steps:
        # Cheap collective every step: all ranks stop (or save on rank 0's clock, or commit an
        # async save everyone has finished writing) after the same step or none does.
        stop_now, time_due, writing = info.any_rank_each(
            stop.requested,
            info.is_main and interval > 0 and time.monotonic() - last_save >= interval,
            ckpt.writing(),
        )
        if ckpt.in_flight:
            committed = ckpt.poll(writing)
            if committed and info.is_main:
                print(f"{tag}checkpoint committed: {committed}", flush=True)
        if stop_now:
            preempted = True
            break
        started = time.perf_counter()
        clock.start()
        step += 1
        lr = cfg.optim.lr_at(step) * lr_scale_at(state, step, cfg.optim.warmup_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss = train_step(
            par, optimizer, feed, cfg, info, step, state.sample_position, clock, fault
        )
        state.step = step
        state.sample_position += plan.global_batch
        state.epoch = feed.epoch_of(state.sample_position)
        step_time = time.perf_counter() - started
        # Under DDP every rank's step_time is the same: fast ranks wait in the gradient
        # all-reduce for the slowest. A straggler shows in the time spent before that
        # collective (data + forward), so compute_s is what tells the ranks apart.
        tokens = feed.rows * T
        metrics.step(
            step=step,
            loss=loss,
            tokens_per_s=tokens / step_time,
            step_time_s=step_time,
            compute_s=clock.seconds(),
        )
        if layout is not None and step == start_step + 1:
            # The planner's prediction beside what this rank holds after a real step (and its
            # first step time, which includes warm-up; the portal compares later steps).
            metrics.write(
                "layout",
                step=step,
                layout=layout.record(),
                measured_bytes=measured_bytes(par.base, optimizer, info.device),
            )
        if step % cfg.train.log_every == 0 or step == start_step + 1:
            print(
                f"{tag}step {step}/{cfg.train.steps} loss {loss:.4f} lr {lr:.2e} "
                f"{step_time * 1000:.1f} ms/step {tokens / step_time:,.0f} tok/s",
                flush=True,
            )
        if ckpt.due(step) or time_due:
            path = ckpt.save(dataclasses.replace(state))
            saved_step = step
            last_save = time.monotonic()
            if info.is_main and not ckpt.in_flight:
                print(f"{tag}checkpoint committed: {path}", flush=True)

    if step > 0 and saved_step != step:
        ckpt.save(dataclasses.replace(state))
    # Finished or preempted: an async save still in flight is written and committed before
    # the process exits.
    path = ckpt.wait() or (ckpt.step_dir(step) if step > 0 and saved_step != step else None)
    ckpt.close()  # nothing in flight now: frees the reused staging buffers
    if path and info.is_main:
        print(f"{tag}checkpoint committed: {path}", flush=True)
    reason = "preempted" if preempted else "finished"
    metrics.end(step=step, reason=reason)
    if (
        info.is_main
        and not preempted
        and isinstance(dataset, AdditionDataset)
        and par.dims.tp == 1
        and par.pipeline is None
        and not cfg.parallel.mode.startswith("fsdp")
    ):
        print(f"{tag}addition accuracy: {addition_accuracy(model, dataset, info):.1%}", flush=True)
    print(f"{tag}trainer: {reason} at step {step}", flush=True)
    feed.close()
    metrics.close()
    # `python -m trainer` exits at once after this (trainer/__main__.py): no group teardown.
    close_distributed(info, destroy=False)
    return 0


def train_step(
    par: Parallelized,
    optimizer: torch.optim.Optimizer,
    feed: DataFeed,
    cfg: JobConfig,
    info: DistInfo,
    step: int,
    position: int,
    clock: ComputeClock | None = None,
    fault: Callable[[int], None] | None = None,
) -> float:
    """One optimizer step on this rank's share of the global batch that starts at sample
    `position`; returns this rank's mean loss.

    Each micro-batch's loss is weighted by its share of the global batch (rows * dp / global),
    so the data-parallel gradient average is the gradient of the global batch's mean loss
    whatever the split. Only the last micro-batch synchronises gradients. `clock` is told when
    the first forward pass and loss are done (before backward and its all-reduce); `fault` is
    the test-only hook of `_test_faults`."""
    if fault is not None:
        fault(step)
    plan = feed.plan
    micro = feed.micro_batches(step, position)
    optimizer.zero_grad(set_to_none=True)
    if par.pipeline is not None:
        # The schedule runs the micro-batches itself, interleaved over the stages.
        x = torch.cat([m[0] for m in micro]).to(info.device)
        y = torch.cat([m[1] for m in micro]).to(info.device)
        loss = par.pipeline.step(x, y, len(micro))
        if clock is not None:
            clock.forward_done()  # the whole schedule: its forwards and backwards interleave
        if cfg.optim.grad_clip > 0:
            par.clip_grads(cfg.optim.grad_clip)
        optimizer.step()
        return loss
    total = 0.0
    for i, (x, y, rows) in enumerate(micro):
        x, y = x.to(info.device, non_blocking=True), y.to(info.device, non_blocking=True)
        last = i == len(micro) - 1
        with par.grad_sync(last):
            with par.autocast():
                _, loss = par.module(x, y)
            if clock is not None and i == 0:
                clock.forward_done()
            weight = rows * plan.dp_size / plan.global_batch
            (loss * weight).backward()  # DDP/FSDP reduce the gradients here on the last one
        total += loss.detach().float() * rows
    if cfg.optim.grad_clip > 0:
        par.clip_grads(cfg.optim.grad_clip)
    optimizer.step()
    return total.item() / feed.rows  # also waits for the device: the step time is real


@torch.no_grad()
def addition_accuracy(model: GPT, data: AdditionDataset, info: DistInfo, n: int = 200) -> float:
    """Share of n fresh problems whose greedy answer is exactly right."""
    model.eval()
    rng = np.random.default_rng([2**31 - 1])  # a stream the training batches never use
    a = rng.integers(0, 10**data.digits, size=n)
    b = rng.integers(0, 10**data.digits, size=n)
    width = data.digits
    prompts = [f"{x:0{width}d}+{y:0{width}d}=" for x, y in zip(a, b, strict=True)]
    idx = torch.tensor([data.encode(p) for p in prompts], device=info.device)
    out = model.generate(idx, max_new_tokens=width + 1)[:, idx.shape[1] :].tolist()
    answers = [data.decode(row) for row in out]
    model.train()
    return sum(ans == f"{x + y:0{width + 1}d}" for ans, x, y in zip(answers, a, b, strict=True)) / n


def main(argv: list[str] | None = None) -> int:
    return train(parse_args(argv))
