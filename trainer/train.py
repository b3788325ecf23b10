"""The training loop: build everything, resume if asked, train, checkpoint, stop cleanly.

Preemption (DESIGN.md section 7): SIGTERM (or SIGINT) asks for a stop. At each step boundary
the ranks all-reduce their stop flags, so all of them stop after the same step; they save and
commit a checkpoint for that step, write an `end` record with reason "preempted" and exit 0.
A second signal stops the process at once. A finished run also ends with a committed checkpoint
of its last step and an `end` record with reason "finished".
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import asdict
from types import FrameType

import numpy as np
import torch

from trainer.checkpoint import CheckpointManager
from trainer.config import JobConfig, OptimArgs, parse_args
from trainer.data import AdditionDataset, Dataset, build_dataset
from trainer.distributed import DistInfo, apply_ddp, close_distributed, init_distributed
from trainer.metrics import MetricsWriter
from trainer.model import GPT, GPTConfig


class StopFlag:
    """Set by the first SIGTERM/SIGINT; a second one gets the default action (terminate)."""

    def __init__(self) -> None:
        self.requested = False

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.requested = True


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


def build_optimizer(model: torch.nn.Module, optim: OptimArgs) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        model.parameters(), lr=optim.lr, betas=(0.9, 0.99), weight_decay=optim.weight_decay
    )


def train(cfg: JobConfig) -> int:
    """Run the job described by cfg; returns the process exit code."""
    if cfg.train.deterministic:
        # cuBLAS is only deterministic with a fixed workspace, which must be chosen before
        # its first use; torch raises without it once deterministic algorithms are on.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    info = init_distributed()
    # After the rendezvous: a stop requested while ranks are still gathering has nothing to
    # checkpoint, so the default action (terminate) is right until then.
    stop = StopFlag()
    stop.install()
    configure_threads(info)
    tag = f"[rank {info.rank}] " if info.distributed else ""

    dataset = build_dataset(cfg.train.dataset)
    model = build_model(cfg, dataset.vocab_size, info)
    optimizer = build_optimizer(model, cfg.optim)
    train_model = apply_ddp(model, info)
    metrics_path = cfg.train.metrics_path or f"metrics-rank{info.rank}.jsonl"
    metrics = MetricsWriter(metrics_path, info.rank)
    ckpt = CheckpointManager(
        cfg.train.checkpoint_dir,
        every=cfg.train.checkpoint_every,
        model=train_model,
        optimizer=optimizer,
        dist_info=info,
        metrics=metrics,
        marker_extra={"dataset": dataset.uri, "config": asdict(cfg)},
    )

    resume_dir = ckpt.resolve_resume(cfg.train.resume_from)
    start_step = ckpt.load(resume_dir) if resume_dir else 0
    # The newest step known to be committed in our own checkpoint dir, tracked in memory so
    # every rank makes the same save decision without re-reading the filesystem.
    saved_step = start_step if resume_dir == ckpt.step_dir(start_step) else -1
    metrics.start(world_size=info.world_size, resumed_from_step=start_step)
    print(
        f"{tag}trainer: {model.num_params():,} params, dataset {dataset.uri}, "
        f"world size {info.world_size}, device {info.device}, "
        + (f"resumed from {resume_dir} (step {start_step})" if resume_dir else "fresh start"),
        flush=True,
    )

    B, T = cfg.train.batch_size, cfg.model.block_size
    step = start_step
    preempted = False
    interval = cfg.train.checkpoint_interval_s
    last_save = time.monotonic()
    time_due = False
    while step < cfg.train.steps:
        # Cheap collective every step: all ranks stop (or save on rank 0's clock) after the same
        # step or none does.
        stop_now, time_due = info.any_rank_each(
            stop.requested,
            info.is_main and interval > 0 and time.monotonic() - last_save >= interval,
        )
        if stop_now:
            preempted = True
            break
        started = time.perf_counter()
        step += 1
        lr = cfg.optim.lr_at(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss = train_step(train_model, optimizer, dataset, cfg, info, step)
        step_time = time.perf_counter() - started
        metrics.step(step=step, loss=loss, tokens_per_s=B * T / step_time, step_time_s=step_time)
        if step % cfg.train.log_every == 0 or step == start_step + 1:
            print(
                f"{tag}step {step}/{cfg.train.steps} loss {loss:.4f} lr {lr:.2e} "
                f"{step_time * 1000:.1f} ms/step {B * T / step_time:,.0f} tok/s",
                flush=True,
            )
        if ckpt.due(step) or time_due:
            path = ckpt.save(step)
            saved_step = step
            last_save = time.monotonic()
            if info.is_main:
                print(f"{tag}checkpoint committed: {path}", flush=True)

    if step > 0 and saved_step != step:
        path = ckpt.save(step)
        if info.is_main:
            print(f"{tag}checkpoint committed: {path}", flush=True)
    reason = "preempted" if preempted else "finished"
    metrics.end(step=step, reason=reason)
    if info.is_main and not preempted and isinstance(dataset, AdditionDataset):
        print(f"{tag}addition accuracy: {addition_accuracy(model, dataset, info):.1%}", flush=True)
    print(f"{tag}trainer: {reason} at step {step}", flush=True)
    metrics.close()
    close_distributed(info)
    return 0


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    dataset: Dataset,
    cfg: JobConfig,
    info: DistInfo,
    step: int,
) -> float:
    """One optimizer step on this rank's batch for `step`; returns this rank's loss."""
    x, y = dataset.batch(
        seed=cfg.train.seed,
        step=step,
        rank=info.rank,
        world_size=info.world_size,
        batch_size=cfg.train.batch_size,
        block_size=cfg.model.block_size,
    )
    x, y = x.to(info.device, non_blocking=True), y.to(info.device, non_blocking=True)
    _, loss = model(x, y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()  # DDP all-reduces the gradients here
    if cfg.optim.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
    optimizer.step()
    return loss.item()  # also waits for the device, so the measured step time is real


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
