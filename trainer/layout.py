"""The layout as a job setting: `auto` takes the planner's recommendation for this model, the
memory of the GPUs this attempt got and how many it got (again at every launch, so after an
elastic shrink or grow too); `flags` uses --parallel, --tp and --pp as given.

Only layouts the reference trainer can run are candidates (trainer/parallel.py):
ZeRO-0 is DDP, ZeRO-1 is zero1, ZeRO-2 is fsdp-noreshard (FSDP2 keeping the gathered weights
until backward; it shards gradients and optimizer state), ZeRO-3 is fsdp; tensor parallelism
beside data parallelism needs FSDP; pipelines do not combine with zero1; a pipeline's
micro-batches must be equal.

The choice, its predicted per-GPU memory and step time, and the reasons are what the trainer
prints at start and writes as the metrics `layout` record with what it measured (the job
page shows both). docs/training.md ("Layouts") has the story.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from trainer.planner import (
    ClusterShape,
    GiB,
    Layout,
    ModelShape,
    Plan,
    enumerate_layouts,
    evaluate,
    recommendation_key,
)
from trainer.step_time import H100_NODE, Hardware, StepTime, step_time

if TYPE_CHECKING:
    # Annotations only: trainer.config imports the datasets (torch), and the portal and the
    # CLI import this module for `timed_plan` without torch (tests/test_layers.py).
    from trainer.config import JobConfig, ParallelArgs

ZERO_MODES = {0: "ddp", 1: "zero1", 2: "fsdp-noreshard", 3: "fsdp"}
MODE_ZERO = {mode: zero for zero, mode in ZERO_MODES.items()}
# Predicted step times this close to the fastest count as a tie.
NEAR_TIE = 1.05
# Stages per rank of the interleaved candidates (the trainer's --pp-stages-per-rank default).
INTERLEAVED = 2


class LayoutError(ValueError):
    pass


def size(n: float) -> str:
    """Bytes in GiB, or MiB below one GiB (CPU tests plan in MiB)."""
    return f"{n / GiB:,.2f} GiB" if n >= GiB else f"{n / (1 << 20):,.2f} MiB"


def runnable(layout: Layout) -> bool:
    """Whether the reference trainer has this layout (see the module docstring)."""
    if layout.pp > 1 and layout.zero == 1:
        return False
    return not (layout.tp > 1 and layout.dp > 1 and layout.zero < 2)


def model_shape(
    cfg: JobConfig, vocab: int, params: int, batch: int, dtype: str = "fp32"
) -> ModelShape:
    """The reference GPT as the planner sees it: exact parameter count (learned positions
    included), tied head, SDPA attention (no score matrix kept), AdamW."""
    return ModelShape(
        layers=cfg.model.n_layer,
        hidden=cfg.model.n_embd,
        heads=cfg.model.n_head,
        vocab=vocab,
        seq=cfg.model.block_size,
        micro_batch=cfg.train.batch_size,
        params=params,
        dtype=dtype,
        optimizer="adam",
        activation_checkpointing=cfg.parallel.activation_checkpointing,
        flash_attention=True,
        tied_embeddings=True,
        vocab_parallel=False,  # trainer/parallel.py's apply_tp splits the blocks only
        global_batch=batch,
    )


@dataclass(frozen=True)
class Choice:
    layout: Layout
    parallel: ParallelArgs
    global_batch: int
    predicted: StepTime
    memory_limit_bytes: int
    hardware: Hardware
    how: str
    """auto or flags"""
    reasons: list[str] = field(default_factory=list)

    def describe(self) -> str:
        lay = self.layout
        return (
            f"pp {lay.pp} x dp {lay.dp} x tp {lay.tp}, {self.parallel.mode} (ZeRO-{lay.zero})"
            + (f", {self.parallel.pp_schedule}" if lay.pp > 1 else "")
        )

    def record(self) -> dict:
        """The metrics `layout` record's prediction part (JSON-ready)."""
        lay = self.layout
        return {
            "how": self.how,
            "pp": lay.pp,
            "dp": lay.dp,
            "tp": lay.tp,
            "zero": lay.zero,
            "mode": self.parallel.mode,
            "pp_schedule": self.parallel.pp_schedule if lay.pp > 1 else "",
            "stages_per_rank": lay.stages_per_rank,
            "micro_batches": lay.micro_batches,
            "global_batch": self.global_batch,
            "memory_limit_bytes": self.memory_limit_bytes,
            "predicted_bytes": dict(lay.per_gpu_bytes),
            "predicted_resident_bytes": resident_bytes(lay),
            "predicted_time": self.predicted.to_dict(),
            "pipeline_bubble": lay.pipeline_bubble,
            "hardware": self.hardware.name,
            "reasons": list(self.reasons),
        }


def resident_bytes(layout: Layout) -> dict[str, int]:
    """Weights, grads and optimizer state held between steps (ZeRO-2/3's gathered buffers
    are transient): what a rank's tensors measure after an optimizer step."""
    out = {k: layout.per_gpu_bytes[k] for k in ("weights", "grads", "optimizer")}
    for k, transient in layout.zero_buffer_bytes.items():
        out[k] -= transient
    if layout.zero == 2:
        # The trainer's ZeRO-2 is FSDP2 without resharding after forward: the weights stay
        # gathered from forward to backward (the planner's ZeRO-2 peak) but are sharded again
        # after the backward, so between steps they hold a 1/dp shard, as under ZeRO-3.
        out["weights"] = round(out["weights"] / layout.dp)
    return out


def candidates(model: ModelShape, cluster: ClusterShape, interleave: bool = True) -> list[Layout]:
    """Runnable layouts, the fitting ones first in the planner's order of preference. With
    `interleave`, each pipeline also as the interleaved schedule with INTERLEAVED stages per
    rank where the trainer can run it: the stages split the layers, and the micro-batches come
    in rounds of pp (torch's Interleaved1F1B)."""
    batch = model.global_batch or model.micro_batch * cluster.gpus
    out = []
    for lay in enumerate_layouts(model, cluster):
        if not runnable(lay):
            continue
        if lay.pp > 1 and batch % (lay.dp * model.micro_batch):
            continue  # unequal micro-batches (trainer.train.check_pipeline_plan)
        out.append(lay)
        v = INTERLEAVED
        if (
            interleave
            and lay.pp > 1
            and not model.layers % (lay.pp * v)
            and not lay.micro_batches % lay.pp
        ):
            out.append(evaluate(model, cluster, lay.dp, lay.tp, lay.pp, lay.zero, v))
    out.sort(key=lambda lay: (0, recommendation_key(lay)) if lay.fits else (1, 0))
    return out


def choose(
    model: ModelShape, cluster: ClusterShape, hw: Hardware = H100_NODE, interleave: bool = True
) -> tuple[Layout, list[str]]:
    """The recommended runnable layout and why; LayoutError when none fits. `interleave`:
    whether interleaved pipelines are candidates (`candidates`)."""
    layouts = candidates(model, cluster, interleave)
    fitting = [lay for lay in layouts if lay.fits]
    if not fitting:
        smallest = min(layouts, key=lambda lay: lay.per_gpu_bytes["total"], default=None)
        need = (
            f"; the smallest, {smallest.describe()}, needs {size(smallest.per_gpu_bytes['total'])}"
            if smallest
            else ""
        )
        raise LayoutError(
            f"no layout of {cluster.gpus} ranks fits in {size(cluster.gpu_mem_bytes)} per rank"
            f"{need}: use more GPUs, activation checkpointing or a smaller --batch-size"
        )
    # The fastest predicted on this hardware; within NEAR_TIE of it, the simplest: the
    # shallowest pipeline, the least tensor parallelism, the least sharding, not interleaved
    # (then the planner's order). Simpler layouts carry what the time model does not see:
    # stage imbalance, and collectives inside the forward pass, which make every rank wait
    # for a slow one, so that the straggler detector (which times each rank's data and
    # forward) can no longer tell which rank is slow; on a CPU the interleaved schedule
    # measured up to 16% slower than the model says (docs/planner.md).
    times = [step_time(model, cluster, lay, hw).total_s for lay in fitting]
    fastest = min(times)
    near = [
        (lay.pp, lay.tp, lay.zero, lay.stages_per_rank, i)
        for i, (lay, s) in enumerate(zip(fitting, times, strict=True))
        if s <= fastest * NEAR_TIE
    ]
    best = fitting[min(near)[-1]]
    t = step_time(model, cluster, best, hw)
    plain = next((lay for lay in layouts if (lay.pp, lay.tp, lay.zero) == (1, 1, 0)), None)
    reasons = [
        f"{best.describe()}: {size(best.per_gpu_bytes['total'])} of "
        f"{size(cluster.gpu_mem_bytes)} per rank; {len(fitting)} of {len(layouts)} "
        "runnable layouts fit"
    ]
    if plain is not None and not plain.fits:
        reasons.append(f"plain data parallelism would need {size(plain.per_gpu_bytes['total'])}")
    reasons.append(
        f"the fastest predicted step of the fitting layouts; within {NEAR_TIE - 1:.0%} of it, "
        "the simplest (the shallowest pipeline, the least tensor parallelism, the least "
        "sharding, not interleaved)"
    )
    reasons.append(
        f"predicted step {t.total_s * 1e3:.1f} ms on {hw.name}: compute "
        f"{t.compute_s * 1e3:.1f}, exposed communication {t.exposed_comm_s * 1e3:.1f}, "
        f"bubble {t.bubble_s * 1e3:.1f}"
    )
    return best, reasons


def timed_plan(plan: Plan, hw: Hardware = H100_NODE) -> dict:
    """The planner's answer (`Plan.to_dict`) with time added: each layout's predicted step
    on `hw` (compute, exposed communication, bubble), and `fastest`, the layout that
    `--layout auto` takes for this model and cluster (`choose`: the fastest runnable layout
    that fits, the simplest within NEAR_TIE), with its reasons; None when none fits. The
    planner's own `recommended` orders by traffic volume, which knows no link speeds."""
    out = plan.to_dict()
    for entry, layout in zip(out["layouts"], plan.layouts, strict=True):
        entry["predicted_step"] = step_time(plan.model, plan.cluster, layout, hw).to_dict()
        if layout is plan.recommended:
            out["recommended"] = entry
    try:
        best, reasons = choose(plan.model, plan.cluster, hw)
    except LayoutError as e:
        out["fastest"] = None
        out["fastest_reasons"] = [str(e)]
    else:
        out["fastest"] = {
            **best.to_dict(),
            "description": best.describe(),
            "predicted_step": step_time(plan.model, plan.cluster, best, hw).to_dict(),
        }
        out["fastest_reasons"] = reasons
    out["hardware"] = hw.to_dict()
    return out


def device_memory_bytes(device_type: str, local_world_size: int) -> int:
    """The memory one rank may plan for: LOCKSTEP_MEMORY_LIMIT_GB when set (a per-rank cap,
    as a test or an admin sets it), else the GPU's, else the host's available memory shared
    by the node's ranks."""
    limit = os.environ.get("LOCKSTEP_MEMORY_LIMIT_GB", "").strip()
    if limit:
        try:
            value = float(limit)
        except ValueError:
            raise LayoutError(f"LOCKSTEP_MEMORY_LIMIT_GB={limit!r} is not a number") from None
        if not 0 < value < 1 << 20:
            raise LayoutError(f"LOCKSTEP_MEMORY_LIMIT_GB={limit!r} must be above 0")
        return int(value * GiB)
    if device_type == "cuda":
        import torch

        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    available = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        available = 0
    return max(1, available // max(1, local_world_size))


def cpu_hardware(
    cores: int,
    ranks: int,
    *,
    flops_per_core: float = 58e9,
    mem_bw: float = 1.2e9,
    bus_bw: float = 0.7e9,
    hop_latency_s: float = 1.3e-3,
    call_cpu_s: float = 1.0e-3,
    peer_cpu_s: float = 0.2e-3,
    fsdp_unit_cpu_s: float = 0.9e-3,
    name: str = "",
) -> Hardware:
    """A CPU node as the step-time model's hardware: ranks share the cores (each gets
    cores / ranks of them when oversubscribed, and pays ranks / cores times a call's CPU),
    gloo over loopback, no overlap (the collective threads compete with compute for the same
    cores). The defaults are bench/layouts.py's calibration on this project's 2-core CI
    machine (2026-12-04 for the rates, one thread per rank): 58 GFLOP/s per core on the
    reference GPT's fp32 matmuls, 1.2 GB/s through AdamW's state, gloo all-reduce at 0.7 GB/s
    bus bandwidth and 1.3 ms per ring step; the fixed costs of its run of 2026-12-05 (fitted
    on tp4, tp2 x dp2 and ZeRO-3; docs/planner.md has how much they vary between runs): 1.0
    ms of CPU per collective a rank waits on, 0.2 ms per peer it waits for, 0.9 ms per FSDP2
    unit gather or reduce-scatter. The benchmark passes the figures it calibrates in its own
    run."""
    share = min(1.0, cores / max(1, ranks))
    return Hardware(
        name=name or f"CPU ({cores} cores, {ranks} ranks), gloo",
        flops=flops_per_core * share,
        intra_node_bw=bus_bw,
        inter_node_bw=bus_bw,
        overlap=0.0,
        mem_bw=mem_bw * share,
        hop_latency_s=hop_latency_s,
        call_s=call_cpu_s / share,
        peer_s=peer_cpu_s / share,
        fsdp_unit_s=fsdp_unit_cpu_s / share,
    )


def resolve(
    cfg: JobConfig,
    *,
    vocab: int,
    params: int,
    world_size: int,
    gpus_per_node: int,
    device_type: str,
    batch: int,
    memory_bytes: int,
    how: str,
    hw: Hardware | None = None,
) -> tuple[JobConfig, Choice]:
    """The config to train with and the Choice behind it. `how` = auto: the planner's pick
    replaces the parallel settings and pins the global batch; flags: the config's own layout,
    evaluated the same way (so the job page can show its prediction too)."""
    dtype = "bf16" if device_type == "cuda" and cfg.parallel.precision != "fp32" else "fp32"
    if cfg.parallel.precision == "bf16":
        dtype = "bf16"
    gpn = gpus_per_node if world_size % gpus_per_node == 0 else world_size
    model = model_shape(cfg, vocab, params, batch, dtype)
    cluster = ClusterShape(
        gpus=world_size,
        gpus_per_node=max(1, min(gpn, world_size)),
        gpu_mem_gb=memory_bytes / GiB,
        overhead_bytes=0 if device_type == "cpu" else ClusterShape.overhead_bytes,
    )
    if hw is None:
        hw = (
            H100_NODE
            if device_type == "cuda"
            else cpu_hardware(len(os.sched_getaffinity(0)), gpus_per_node)
        )
    if how == "auto":
        # Not interleaved on a CPU: there bench/layouts.py measured it up to 16% slower than the
        # model predicts, more than the tie margin that would keep it out.
        layout, reasons = choose(model, cluster, hw, interleave=device_type != "cpu")
        parallel = replace(cfg.parallel, mode=ZERO_MODES[layout.zero], tp=layout.tp, pp=layout.pp)
        if layout.pp > 1:
            v = layout.stages_per_rank
            schedule = "interleaved" if v > 1 else "1f1b"
            # The global batch is pinned and the layout sets the micro-batches: a count given
            # for another schedule (interleaved needs a multiple of pp) does not apply.
            parallel = replace(
                parallel,
                pp_schedule=schedule,
                pp_stages_per_rank=v if v > 1 else 0,
                pp_microbatches=0,
            )
    else:
        p = cfg.parallel
        dp = world_size // (p.tp * p.pp)
        zero = MODE_ZERO[p.mode] if dp > 1 else 0
        layout = evaluate(
            model, cluster, dp=dp, tp=p.tp, pp=p.pp, zero=zero, stages_per_rank=p.stages_per_rank
        )
        reasons = ["layout from the command line (--parallel, --tp, --pp)"]
        if not layout.fits:
            reasons.append(
                f"predicted {size(layout.per_gpu_bytes['total'])} per rank does not "
                f"fit in {size(cluster.gpu_mem_bytes)}"
            )
        parallel = p
    choice = Choice(
        layout=layout,
        parallel=parallel,
        global_batch=batch,
        predicted=step_time(model, cluster, layout, hw),
        memory_limit_bytes=memory_bytes,
        hardware=hw,
        how=how,
        reasons=reasons,
    )
    return (apply(cfg, choice) if how == "auto" else cfg), choice


def apply(cfg: JobConfig, choice: Choice) -> JobConfig:
    """cfg with the chosen layout and the global batch it was chosen for."""
    train = replace(cfg.train, global_batch_size=choice.global_batch)
    return replace(cfg, parallel=choice.parallel, train=train)


def default_batch(cfg: JobConfig, world_size: int, resumed_batch: int) -> int:
    """The global batch a layout is chosen for: the flag, else the checkpoint's, else one
    micro-batch per rank of the job's full size ($LOCKSTEP_JOB_GPUS, so a shrunk elastic
    attempt keeps the full job's batch, as trainer.train.batch_dp does)."""
    if cfg.train.global_batch_size:
        return cfg.train.global_batch_size
    if resumed_batch > 0:
        return resumed_batch
    asked = int(os.environ.get("LOCKSTEP_JOB_GPUS") or 0)
    ranks = asked if asked > world_size and asked % world_size == 0 else world_size
    return cfg.train.batch_size * ranks


def _params(cfg: JobConfig, vocab: int) -> int:
    """The reference GPT's exact parameter count, built on the meta device (no memory)."""
    import torch

    from trainer.model import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(
            GPTConfig(
                vocab_size=vocab,
                block_size=cfg.model.block_size,
                n_layer=cfg.model.n_layer,
                n_head=cfg.model.n_head,
                n_embd=cfg.model.n_embd,
            )
        )
    return model.num_params()


def _resumed_batch(resume_from: str) -> int:
    from trainer.checkpoint import resolve_resume
    from trainer.checkpoint_layout import read_marker

    path = resolve_resume(resume_from)
    marker = read_marker(path) if path else None
    state = (marker or {}).get("train_state") or {}
    return int(state.get("global_batch") or 0)


def for_launch(cfg: JobConfig, vocab: int, info) -> tuple[JobConfig, Choice | None]:
    """The layout of this launch, decided on rank 0 and shared with every rank (the same
    inputs on each, but one reading of the checkpoint and the memory is simpler to trust).
    auto with nothing that fits is an error; flags that the planner cannot evaluate just have
    no prediction."""
    result: object = None
    if info.is_main:
        try:
            batch = default_batch(cfg, info.world_size, _resumed_batch(cfg.train.resume_from))
            result = resolve(
                cfg,
                vocab=vocab,
                params=_params(cfg, vocab),
                world_size=info.world_size,
                gpus_per_node=info.local_world_size,
                device_type=info.device.type,
                batch=batch,
                memory_bytes=device_memory_bytes(info.device.type, info.local_world_size),
                how=cfg.parallel.layout,
            )
        except ValueError as exc:  # LayoutError, PlanError: sent as text (they pickle badly)
            result = f"layout: {exc}"
        # Only the choice travels: the rest of each rank's config is its own (its metrics
        # path, from its launch contract).
        if not isinstance(result, str):
            result = result[1]
    result = info.broadcast_object(result)
    if isinstance(result, str):
        if cfg.parallel.layout == "auto":
            raise LayoutError(result)
        return cfg, None
    assert isinstance(result, Choice)
    return (apply(cfg, result) if result.how == "auto" else cfg), result


def measured_bytes(module, optimizer, device) -> dict[str, int]:
    """What this rank's tensors hold right after an optimizer step: local shards of weights,
    their gradients and the optimizer state, each storage once (as the planner's resident
    bytes count them); on CUDA also the allocator's peak."""
    import torch
    from torch.distributed.tensor import DTensor

    def local(t):
        return t._local_tensor if isinstance(t, DTensor) else t

    def total(tensors) -> int:
        seen, n = set(), 0
        for t in tensors:
            if t is None:
                continue
            storage = local(t).untyped_storage()
            if storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            n += storage.nbytes()
        return n

    params = list(module.parameters())
    # ZeRO-1 keeps its shard's state in the local optimizer it wraps.
    local_optim = getattr(optimizer, "optim", optimizer)
    state = [v for s in local_optim.state.values() for v in s.values() if torch.is_tensor(v)]
    out = {
        "weights": total(params),
        "grads": total(p.grad for p in params),
        "optimizer": total(state),
    }
    if device.type == "cuda":
        out["cuda_peak_allocated"] = int(torch.cuda.max_memory_allocated(device))
    return out
