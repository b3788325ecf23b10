"""Run configuration: dataclasses with documented fields, filled from the command line and env.

The defaults are a debug config: `python -m trainer` alone trains 3-digit addition on one CPU
process in well under a minute, with the loss falling from about 2.5 to below 0.1.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from trainer.data import DEFAULT_DATASET


@dataclass
class ModelArgs:
    """Model shape (the vocabulary size comes from the dataset)."""

    n_layer: int = 2
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads per block."""
    n_embd: int = 128
    """Residual stream width."""
    block_size: int = 32
    """Tokens per training sequence."""


@dataclass
class OptimArgs:
    """AdamW with a linear warm-up, then a constant learning rate.

    The learning rate is a function of the step alone, so it needs no saved scheduler state
    and a resumed run follows exactly the same schedule.
    """

    lr: float = 1e-3
    """Peak learning rate."""
    warmup_steps: int = 50
    """Steps of linear warm-up from lr / warmup_steps to lr."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 = off)."""

    def lr_at(self, step: int) -> float:
        """Learning rate for the optimizer step that completes `step` (steps count from 1)."""
        if self.warmup_steps > 0 and step < self.warmup_steps:
            return self.lr * step / self.warmup_steps
        return self.lr


@dataclass
class TrainArgs:
    """Loop length, data, logging and checkpointing."""

    steps: int = 1000
    """Total optimizer steps of the job (a resumed run continues up to this count)."""
    batch_size: int = 32
    """Sequences per step per rank (the global batch is batch_size * world_size)."""
    seed: int = 0
    """Seed for the initial weights and every batch."""
    dataset: str = DEFAULT_DATASET
    """Dataset URI: synthetic://addition[?digits=N], file:///abs/path, or a plain path."""
    log_every: int = 50
    """Print a progress line to stdout every this many steps (metric records go every step)."""
    checkpoint_every: int = 50
    """Save a checkpoint every this many steps (0 = only at the end or on preemption)."""
    checkpoint_interval_s: float = 0.0
    """Also save when this many seconds passed since the last save (0 = off); rank 0's clock
    decides so every rank saves at the same step."""
    checkpoint_dir: str = "checkpoints"
    """Where step-NNNNNN/ checkpoint directories are written."""
    resume_from: str = ""
    """A committed step directory to resume from; empty = fresh start."""
    metrics_path: str = ""
    """JSON-lines metric file; empty = ./metrics-rank{rank}.jsonl."""
    fault_stall_at_step: int = 0
    """Fault injection (tests, benchmarks): rank fault_stall_rank hangs before this step."""
    fault_stall_rank: int = 0
    fault_slow_rank: int = -1
    """Fault injection: this rank sleeps fault_slow_ms before every forward pass (a straggler)."""
    fault_slow_ms: int = 0
    fault_commit_delay_ms: int = 0
    """Fault injection: pause between writing a checkpoint's data and committing it."""
    deterministic: bool = False
    """torch.use_deterministic_algorithms(True): bit-exact reruns, possibly slower."""


@dataclass
class JobConfig:
    """Everything a run needs."""

    model: ModelArgs = field(default_factory=ModelArgs)
    optim: OptimArgs = field(default_factory=OptimArgs)
    train: TrainArgs = field(default_factory=TrainArgs)

    def __post_init__(self) -> None:
        positive = {
            "--steps": self.train.steps,
            "--batch-size": self.train.batch_size,
            "--log-every": self.train.log_every,
            "--n-layer": self.model.n_layer,
            "--n-head": self.model.n_head,
            "--n-embd": self.model.n_embd,
            "--block-size": self.model.block_size,
        }
        for flag, value in positive.items():
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if self.train.checkpoint_every < 0:
            raise ValueError("--checkpoint-every must be >= 0")
        if self.train.checkpoint_interval_s < 0:
            raise ValueError("--checkpoint-interval-s must be >= 0")
        if self.optim.lr <= 0:
            raise ValueError("--lr must be > 0")
        if self.model.n_embd % self.model.n_head:
            raise ValueError("--n-embd must be divisible by --n-head")


def _env(name: str, default: str) -> str:
    # The agent sets contract variables to "" when it has no value; treat that as unset.
    return os.environ.get(name) or default


def parse_args(argv: list[str] | None = None) -> JobConfig:
    """Build the JobConfig from flags; paths and the dataset default to the LOCKSTEP_* env."""
    m, o, t = ModelArgs(), OptimArgs(), TrainArgs()
    p = argparse.ArgumentParser(
        prog="python -m trainer",
        description="Train a small GPT under the Lockstep launch contract (or torchrun, or alone).",
    )
    p.add_argument("--steps", type=int, default=t.steps, help="total optimizer steps")
    p.add_argument("--batch-size", type=int, default=t.batch_size, help="sequences per rank")
    p.add_argument("--lr", type=float, default=o.lr, help="peak learning rate")
    p.add_argument("--warmup-steps", type=int, default=o.warmup_steps)
    p.add_argument("--n-layer", type=int, default=m.n_layer)
    p.add_argument("--n-head", type=int, default=m.n_head)
    p.add_argument("--n-embd", type=int, default=m.n_embd)
    p.add_argument("--block-size", type=int, default=m.block_size)
    p.add_argument("--checkpoint-every", type=int, default=t.checkpoint_every, help="steps")
    p.add_argument(
        "--checkpoint-interval-s",
        type=float,
        default=float(_env("LOCKSTEP_CHECKPOINT_INTERVAL_S", "0")),
        help="also save every this many seconds (default: $LOCKSTEP_CHECKPOINT_INTERVAL_S or off)",
    )
    p.add_argument("--seed", type=int, default=t.seed)
    p.add_argument(
        "--dataset",
        default=_env("LOCKSTEP_DATASET", t.dataset),
        help="synthetic://addition[?digits=N], file:///abs/path or a path (env LOCKSTEP_DATASET)",
    )
    faults = p.add_argument_group(
        "fault injection", "for tests and benchmarks; defaults from LOCKSTEP_TEST_* variables"
    )
    faults.add_argument(
        "--fault-stall-at-step",
        type=int,
        default=int(_env("LOCKSTEP_TEST_STALL_AT_STEP", "0")),
        help="rank --fault-stall-rank hangs (alive, no progress) before this step",
    )
    faults.add_argument(
        "--fault-stall-rank", type=int, default=int(_env("LOCKSTEP_TEST_STALL_RANK", "0"))
    )
    faults.add_argument(
        "--fault-slow-rank",
        type=int,
        default=int(_env("LOCKSTEP_TEST_SLOW_RANK", "-1")),
        help="this rank sleeps --fault-slow-ms before every forward pass",
    )
    faults.add_argument(
        "--fault-slow-ms", type=int, default=int(_env("LOCKSTEP_TEST_SLOW_MS", "0"))
    )
    faults.add_argument(
        "--fault-commit-delay-ms",
        type=int,
        default=0,
        help="pause between a checkpoint's data being written and its commit",
    )
    p.add_argument("--log-every", type=int, default=t.log_every, help="steps between prints")
    p.add_argument("--deterministic", action="store_true", help="deterministic torch kernels")
    a = p.parse_args(argv)
    return JobConfig(
        model=ModelArgs(
            n_layer=a.n_layer, n_head=a.n_head, n_embd=a.n_embd, block_size=a.block_size
        ),
        optim=OptimArgs(lr=a.lr, warmup_steps=a.warmup_steps),
        train=TrainArgs(
            steps=a.steps,
            batch_size=a.batch_size,
            seed=a.seed,
            dataset=a.dataset,
            log_every=a.log_every,
            checkpoint_every=a.checkpoint_every,
            checkpoint_interval_s=a.checkpoint_interval_s,
            checkpoint_dir=_env("LOCKSTEP_CHECKPOINT_DIR", t.checkpoint_dir),
            resume_from=os.environ.get("LOCKSTEP_RESUME_FROM", ""),
            metrics_path=os.environ.get("LOCKSTEP_METRICS_PATH", ""),
            deterministic=a.deterministic,
            fault_stall_at_step=a.fault_stall_at_step,
            fault_stall_rank=a.fault_stall_rank,
            fault_slow_rank=a.fault_slow_rank,
            fault_slow_ms=a.fault_slow_ms,
            fault_commit_delay_ms=a.fault_commit_delay_ms,
        ),
    )
