"""Run configuration: dataclasses with documented fields, filled from the command line and env.

The defaults are a debug config: `python -m trainer` alone trains 3-digit addition on one CPU
process in well under a minute, with the loss falling from about 2.5 to below 0.1.
"""

from __future__ import annotations

import argparse
import os
import sys
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


PARALLEL_MODES = ("ddp", "zero1", "fsdp", "fsdp-noreshard")
PP_SCHEDULES = ("1f1b", "gpipe", "interleaved")
LAYOUTS = ("auto", "flags")
PRECISIONS = ("auto", "fp32", "bf16")


@dataclass
class ParallelArgs:
    """How the model and optimizer are spread over the ranks (docs/training.md)."""

    mode: str = "ddp"
    """ddp (replicated), zero1 (DDP + optimizer state sharded), fsdp (FSDP2, parameters,
    gradients and optimizer state sharded, ZeRO-3), fsdp-noreshard (FSDP2 keeping parameters
    gathered between forward and backward, ZeRO-2-like)."""
    bucket_cap_mb: float = 25.0
    """DDP gradient bucket size: each bucket's all-reduce starts as soon as its gradients are
    ready, overlapping the rest of the backward pass."""
    activation_checkpointing: bool = False
    """Recompute each transformer block's activations in the backward pass."""
    tp: int = 1
    """Tensor-parallel degree (ranks that split every block's matmuls); needs fsdp modes when
    the data-parallel degree world_size / tp is above 1."""
    precision: str = "auto"
    """auto (bf16 on CUDA, fp32 on CPU), fp32, or bf16 (autocast, or FSDP's mixed precision)."""
    pp: int = 1
    """Pipeline stages: the layers cut into pp contiguous stages (must divide --n-layer); the
    data-parallel degree is world_size / (pp x tp)."""
    pp_schedule: str = "1f1b"
    """1f1b (one forward, one backward: at most pp micro-batches of activations in flight on
    the first stage), gpipe (all forwards, then all backwards: every micro-batch's), or
    interleaved (1F1B over --pp-stages-per-rank stages per rank: the bubble that many times
    smaller, as many times the point-to-point messages)."""
    pp_stages_per_rank: int = 0
    """Stages each pipeline rank holds under the interleaved schedule (0 = 2); the others
    take one. pp x this must divide --n-layer."""
    layout: str = "flags"
    """auto: the planner's choice for this model, memory and world size (trainer/layout.py)
    replaces mode, tp and pp; flags: as given."""
    pp_microbatches: int = 0
    """Micro-batches per step on each data-parallel replica when pp > 1; 0 = 2 x pp. With the
    default global batch each is --batch-size sequences; the bubble is (pp-1)/(m+pp-1)."""

    @property
    def stages_per_rank(self) -> int:
        return self.pp_stages_per_rank or (2 if self.pp_schedule == "interleaved" else 1)


@dataclass
class TrainArgs:
    """Loop length, data, logging and checkpointing."""

    steps: int = 1000
    """Total optimizer steps of the job (a resumed run continues up to this count)."""
    batch_size: int = 32
    """Sequences per rank per forward pass (the micro-batch; the most a rank's memory takes)."""
    global_batch_size: int = 0
    """Sequences per optimizer step over all ranks; 0 = the resumed checkpoint's, or
    batch_size * data-parallel ranks at a fresh start. Kept across world-size changes by
    gradient accumulation."""
    allow_batch_change: bool = False
    """On a resume at another world size keep batch_size per rank instead (no accumulation):
    the global batch changes and the learning rate follows it linearly (with a warm-up)."""
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
    async_checkpoint: bool = False
    """Save with DCP async_save: the loop blocks only to stage the state; the commit marker is
    written at a later step boundary, once every rank's background write has finished."""
    async_checkpoint_type: str = "process"
    """process (a background process per rank, no GIL contention) or thread."""
    async_checkpoint_staging: str = "reuse"
    """How an async save copies the state to host memory: fresh (new buffers every save),
    reuse (one set of buffers for the run, copied into at the save) or overlap (the same copy
    in a background thread during the next forward/backward; optimizer.step() waits for it)."""
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
    fault_save_delay_ms: int = 0
    """Fault injection: a checkpoint's storage writer sleeps this long before writing."""
    record_samples: str = ""
    """Debug/test: append every consumed sample (step, epoch, id) as JSON lines to this path
    ({rank} is replaced by the rank)."""
    deterministic: bool = False
    """torch.use_deterministic_algorithms(True): bit-exact reruns, possibly slower."""


@dataclass
class JobConfig:
    """Everything a run needs."""

    model: ModelArgs = field(default_factory=ModelArgs)
    optim: OptimArgs = field(default_factory=OptimArgs)
    train: TrainArgs = field(default_factory=TrainArgs)
    parallel: ParallelArgs = field(default_factory=ParallelArgs)

    @property
    def microbatches_per_replica(self) -> int:
        """Micro-batches per step a fresh default global batch holds on each replica."""
        p = self.parallel
        if p.pp == 1:
            return 1
        return p.pp_microbatches or 2 * p.pp

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
        if self.train.global_batch_size < 0:
            raise ValueError("--global-batch-size must be >= 0")
        if self.train.async_checkpoint_type not in ("process", "thread"):
            raise ValueError("--async-checkpoint-type must be process or thread")
        if self.train.async_checkpoint_staging not in ("fresh", "reuse", "overlap"):
            raise ValueError("--async-checkpoint-staging must be fresh, reuse or overlap")
        if self.parallel.mode not in PARALLEL_MODES:
            raise ValueError(f"--parallel must be one of {', '.join(PARALLEL_MODES)}")
        if self.parallel.precision not in PRECISIONS:
            raise ValueError(f"--precision must be one of {', '.join(PRECISIONS)}")
        if self.parallel.bucket_cap_mb <= 0:
            raise ValueError("--bucket-cap-mb must be > 0")
        if self.parallel.tp < 1:
            raise ValueError("--tp must be >= 1")
        if self.model.n_head % self.parallel.tp:
            raise ValueError("--n-head must be divisible by --tp")
        if self.parallel.pp < 1:
            raise ValueError("--pp must be >= 1")
        if self.model.n_layer % self.parallel.pp:
            raise ValueError(f"--pp {self.parallel.pp} must divide --n-layer {self.model.n_layer}")
        if self.parallel.pp_schedule not in PP_SCHEDULES:
            raise ValueError(f"--pp-schedule must be one of {', '.join(PP_SCHEDULES)}")
        if self.parallel.layout not in LAYOUTS:
            raise ValueError(f"--layout must be one of {', '.join(LAYOUTS)}")
        if self.parallel.pp_microbatches < 0:
            raise ValueError("--pp-microbatches must be >= 0")
        p = self.parallel
        if p.pp_stages_per_rank < 0:
            raise ValueError("--pp-stages-per-rank must be >= 0")
        if p.pp_schedule == "interleaved" and p.pp < 2:
            raise ValueError("--pp-schedule interleaved needs --pp 2 or more")
        if p.pp_schedule != "interleaved" and p.stages_per_rank > 1:
            raise ValueError("--pp-stages-per-rank above 1 needs --pp-schedule interleaved")
        if self.model.n_layer % (p.pp * p.stages_per_rank):
            raise ValueError(
                f"--pp {p.pp} x {p.stages_per_rank} stages per rank must divide "
                f"--n-layer {self.model.n_layer}"
            )
        if p.pp_schedule == "interleaved" and p.pp_microbatches % p.pp:
            # torch's interleaved 1F1B runs the micro-batches in rounds of pp.
            raise ValueError("--pp-microbatches must be a multiple of --pp when interleaved")
        if self.parallel.pp > 1 and self.parallel.mode == "zero1":
            raise ValueError("--pp does not combine with --parallel zero1; use ddp or fsdp")


def _env(name: str, default: str) -> str:
    # The agent sets contract variables to "" when it has no value; treat that as unset.
    return os.environ.get(name) or default


def _sets_layout(argv: list[str]) -> bool:
    flags = ("--parallel", "--tp", "--pp")
    return any(a == f or a.startswith(f + "=") for a in argv for f in flags)


def parse_args(argv: list[str] | None = None) -> JobConfig:
    """Build the JobConfig from flags; paths and the dataset default to the LOCKSTEP_* env.

    Long because it is the flag table itself: one add_argument per config field, in the order
    of the dataclasses, so `--help` and the config read the same; splitting it would only
    scatter the table."""
    m, o, t = ModelArgs(), OptimArgs(), TrainArgs()
    p = argparse.ArgumentParser(
        prog="python -m trainer",
        description="Train a small GPT under the Lockstep launch contract (or torchrun, or alone).",
    )
    p.add_argument("--steps", type=int, default=t.steps, help="total optimizer steps")
    p.add_argument(
        "--batch-size", type=int, default=t.batch_size, help="sequences per rank per micro-batch"
    )
    p.add_argument(
        "--global-batch-size",
        type=int,
        default=t.global_batch_size,
        help="sequences per step over all ranks (0: the checkpoint's, or batch size x ranks)",
    )
    p.add_argument(
        "--allow-batch-change",
        action="store_true",
        help="on a world-size change keep --batch-size per rank and scale the lr linearly",
    )
    par = p.add_argument_group("parallelism", "docs/training.md")
    pa = ParallelArgs()
    par.add_argument("--parallel", choices=PARALLEL_MODES, default=pa.mode)
    par.add_argument("--bucket-cap-mb", type=float, default=pa.bucket_cap_mb, help="DDP buckets")
    par.add_argument("--activation-checkpointing", action="store_true")
    par.add_argument("--tp", type=int, default=pa.tp, help="tensor-parallel degree")
    par.add_argument("--precision", choices=PRECISIONS, default=pa.precision)
    par.add_argument(
        "--layout",
        choices=LAYOUTS,
        default=None,
        help="auto: the planner picks --parallel/--tp/--pp for the GPUs this launch got; "
        "flags: as given (default: $LOCKSTEP_LAYOUT, else flags; a command that passes "
        "--parallel, --tp or --pp keeps them)",
    )
    par.add_argument("--pp", type=int, default=pa.pp, help="pipeline stages")
    par.add_argument("--pp-schedule", choices=PP_SCHEDULES, default=pa.pp_schedule)
    par.add_argument(
        "--pp-microbatches",
        type=int,
        default=pa.pp_microbatches,
        help="micro-batches per step per replica under --pp (0: 2 x pp)",
    )
    par.add_argument(
        "--pp-stages-per-rank",
        type=int,
        default=pa.pp_stages_per_rank,
        help="stages per pipeline rank under --pp-schedule interleaved (0: 2)",
    )
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
    p.add_argument(
        "--async-checkpoint",
        action="store_true",
        help="DCP async_save: block only to stage; commit once every rank's write is done",
    )
    p.add_argument(
        "--async-checkpoint-type", choices=("process", "thread"), default=t.async_checkpoint_type
    )
    p.add_argument(
        "--async-checkpoint-staging",
        choices=("fresh", "reuse", "overlap"),
        default=t.async_checkpoint_staging,
        help="async saves: copy into fresh or reused host buffers, or overlap the copy with "
        "the next forward/backward (default: %(default)s)",
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
    faults.add_argument(
        "--fault-save-delay-ms",
        type=int,
        default=0,
        help="a checkpoint's storage writer sleeps this long before writing",
    )
    p.add_argument(
        "--record-samples",
        default="",
        help="debug: append each consumed sample (step, epoch, id) to this path ({rank} = rank)",
    )
    p.add_argument("--log-every", type=int, default=t.log_every, help="steps between prints")
    p.add_argument("--deterministic", action="store_true", help="deterministic torch kernels")
    a = p.parse_args(argv)
    layout = a.layout or _env("LOCKSTEP_LAYOUT", pa.layout)
    by_hand = _sets_layout(sys.argv[1:] if argv is None else argv)
    if by_hand and a.layout == "auto":
        raise ValueError("--layout auto chooses --parallel, --tp and --pp: drop them, or use "
                         "--layout flags")  # fmt: skip
    if by_hand:
        layout = "flags"  # the platform's default (LOCKSTEP_LAYOUT=auto) yields to the command
    return JobConfig(
        model=ModelArgs(
            n_layer=a.n_layer, n_head=a.n_head, n_embd=a.n_embd, block_size=a.block_size
        ),
        optim=OptimArgs(lr=a.lr, warmup_steps=a.warmup_steps),
        train=TrainArgs(
            steps=a.steps,
            batch_size=a.batch_size,
            global_batch_size=a.global_batch_size,
            allow_batch_change=a.allow_batch_change,
            async_checkpoint=a.async_checkpoint,
            async_checkpoint_type=a.async_checkpoint_type,
            async_checkpoint_staging=a.async_checkpoint_staging,
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
            fault_save_delay_ms=a.fault_save_delay_ms,
            record_samples=a.record_samples,
        ),
        parallel=ParallelArgs(
            mode=a.parallel,
            bucket_cap_mb=a.bucket_cap_mb,
            activation_checkpointing=a.activation_checkpointing,
            tp=a.tp,
            precision=a.precision,
            pp=a.pp,
            pp_schedule=a.pp_schedule,
            layout=layout,
            pp_microbatches=a.pp_microbatches,
            pp_stages_per_rank=a.pp_stages_per_rank,
        ),
    )
