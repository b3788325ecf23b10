"""Step time of a layout, split into compute, exposed communication and pipeline bubble.

Pure arithmetic beside trainer/planner.py (which counts bytes; this turns them into seconds):

- compute: the model's training FLOPs per step on one GPU (6N + 12LCT per token, PaLM's count,
  trainer/flops.py; x 4/3 for the forward that activation checkpointing repeats) over the
  hardware's achieved FLOP/s (a GPU of a pp x tp group does 1 / (pp x tp) of its replica's
  work), plus the optimizer's pass over the state this GPU updates at memory bandwidth.
- pipeline bubble: a GPipe or 1F1B step of m micro-batches on pp stages idles (pp - 1) of
  m + pp - 1 slots (Narayanan et al. 2021): (pp - 1) / m x compute; interleaved over v stages
  per rank, (pp - 1) / (v m).
- communication: each part of the planner's bytes (dp, tp, pp) over the bus bandwidth of the
  link its group uses (NVLink inside a node, the network between nodes). Tensor-parallel
  collectives block the next matmul and pipeline sends the next stage: both are exposed.
  Data-parallel traffic overlaps the backward pass (DDP's buckets, FSDP's reduce-scatters;
  ZeRO-3's all-gathers also the forward, by prefetch): only the part longer than that window,
  or the share the overlap cannot hide, whichever is more, is exposed. Every collective also
  pays a latency per ring step (`ring_hops`), which dominates small ones.

docs/planner.md ("Step time") has the measured error per layout and where it comes from.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from trainer.planner import (
    DTYPE_BYTES,
    OPTIMIZER_BYTES,
    ClusterShape,
    Layout,
    ModelShape,
    global_batch,
)


@dataclass(frozen=True)
class Hardware:
    """What one GPU (or one CPU rank) achieves, not its data sheet."""

    name: str
    flops: float
    """Achieved FLOP/s per GPU on the model's training step (peak x MFU)."""
    intra_node_bw: float
    """Bus bandwidth of a collective inside a node, bytes/s per GPU."""
    inter_node_bw: float
    """Bus bandwidth of a collective across nodes, bytes/s per GPU."""
    overlap: float = 0.9
    """Share of the data-parallel traffic that can hide behind compute when the window is long
    enough (NCCL runs on its own stream; the last bucket never hides)."""
    mem_bw: float = 2.5e12
    """Achieved memory bandwidth, bytes/s: the optimizer step is a pass over its state."""
    hop_latency_s: float = 5e-6
    """Fixed cost of one step of a ring (a message to the next rank): an all-reduce over n
    ranks takes 2(n - 1) of them, a gather or reduce-scatter n - 1, a pipeline send one. It
    dominates small collectives (the tensor-parallel ones of a small model, gloo on CPU)."""

    def to_dict(self) -> dict:
        return asdict(self)


# H100/H200 SXM in 8-GPU NVLink nodes with a 400 Gb/s NIC per GPU: bf16 peak 989 TFLOP/s at
# 40% MFU (what large dense runs report), NCCL all-reduce bus bandwidth ~360 GB/s on NVLink 4
# and ~45 GB/s over 400 Gb/s InfiniBand (nccl-tests' published figures).
H100_NODE = Hardware(
    name="H100/H200 SXM, NVLink, 400 Gb/s per GPU",
    flops=0.40 * 989.4e12,
    intra_node_bw=360e9,
    inter_node_bw=45e9,
    hop_latency_s=10e-6,
)
# DDP's default gradient bucket (trainer/config.py's --bucket-cap-mb).
DDP_BUCKET_BYTES = 25 * (1 << 20)


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    exposed_comm_s: float
    bubble_s: float
    comm_s: float
    """All communication, hidden or not."""

    @property
    def total_s(self) -> float:
        return self.compute_s + self.exposed_comm_s + self.bubble_s

    def to_dict(self) -> dict:
        return {**asdict(self), "total_s": self.total_s}


def flops_per_gpu(model: ModelShape, cluster: ClusterShape, layout: Layout) -> float:
    """Training FLOPs one GPU does per optimizer step (recomputation included)."""
    n = model.total_params - model.vocab * model.hidden  # the lookup is not a matmul ...
    n += model.vocab * model.hidden if model.tied_embeddings else 0  # ... the tied head is
    per_token = 6.0 * n + 12.0 * model.layers * model.hidden * model.seq
    if model.activation_checkpointing:
        per_token *= 8 / 6  # one more forward (2 of the 6)
    tokens = global_batch(model, cluster) * model.seq
    return per_token * tokens / cluster.gpus


def optimizer_s(model: ModelShape, layout: Layout, hw: Hardware) -> float:
    """AdamW's pass over the parameters this GPU updates: it reads and writes the state and
    the weights and reads the gradients. Memory-bound; it does not shrink with data
    parallelism unless ZeRO shards the state (bench/layouts.py measured it as a third of a
    small model's CPU step under DDP)."""
    state = layout.per_gpu_bytes["optimizer"]
    updated = state / OPTIMIZER_BYTES[(model.optimizer, model.half_precision)]
    return (2 * state + 3 * updated * DTYPE_BYTES[model.dtype]) / hw.mem_bw


def ring_hops(model: ModelShape, layout: Layout) -> dict[str, int]:
    """Ring steps per optimizer step, by group (the latency part of each collective).

    dp: ZeRO-0/1 all-reduce the gradients once, in DDP buckets (ZeRO-1 adds a broadcast of
    every updated parameter tensor); ZeRO-2/3 (FSDP2) reduce-scatter every unit (a block, and
    the rest as one) each micro-batch and all-gather it once (ZeRO-2) or twice per
    micro-batch (ZeRO-3).
    tp: 4 all-reduces per layer per micro-batch (6 with recomputation). pp: a send forward
    and one back per micro-batch."""
    m, dp, tp = layout.micro_batches, layout.dp, layout.tp
    units = model.layers // layout.pp + 1
    hops = {"dp": 0, "tp": 0, "pp": 0}
    if dp > 1:
        if layout.zero <= 1:
            grad_bytes = model.total_params / layout.pp / tp * DTYPE_BYTES[model.dtype]
            buckets = max(1, math.ceil(grad_bytes / DDP_BUCKET_BYTES))
            hops["dp"] = buckets * 2 * (dp - 1)
            if layout.zero == 1:
                # torch's ZeroRedundancyOptimizer broadcasts every parameter tensor from the
                # rank that updated it (16 per GPT block with biases, 4 outside): one message
                # each, which bench/layouts.py measured as most of ZeRO-1's cost on gloo.
                hops["dp"] += 16 * model.layers // layout.pp + 4
        elif layout.zero == 2:
            hops["dp"] = units * (m + 1) * (dp - 1)
        else:
            hops["dp"] = units * 3 * m * (dp - 1)
    if tp > 1:
        collectives = 6 if model.activation_checkpointing else 4
        hops["tp"] = collectives * (model.layers // layout.pp) * m * 2 * (tp - 1)
    if layout.pp > 1:
        hops["pp"] = 2 * m
    return hops


def step_time(
    model: ModelShape,
    cluster: ClusterShape,
    layout: Layout,
    hw: Hardware,
    stages_per_rank: int = 1,
) -> StepTime:
    """`stages_per_rank` v > 1: the interleaved 1F1B schedule, whose bubble is v times
    smaller for v times the pipeline messages (Narayanan et al. 2021)."""
    matmuls = flops_per_gpu(model, cluster, layout) / hw.flops
    bubble = matmuls * (layout.pp - 1) / (layout.micro_batches * stages_per_rank)
    compute = matmuls + optimizer_s(model, layout, hw)
    gpn = cluster.gpus_per_node
    comm = {**layout.comm_breakdown}
    comm["pp"] *= stages_per_rank
    hops = ring_hops(model, layout)
    hops["pp"] *= stages_per_rank
    # Rank order as the planner's: tp innermost, dp next, pp outermost.
    dp_bw = hw.inter_node_bw if layout.tp * layout.dp > gpn else hw.intra_node_bw
    pp_bw = hw.inter_node_bw if layout.tp * layout.dp >= gpn else hw.intra_node_bw
    dp_s = comm["dp"] / dp_bw + hops["dp"] * hw.hop_latency_s
    tp_s = comm["tp"] / hw.intra_node_bw + hops["tp"] * hw.hop_latency_s
    pp_s = comm["pp"] / pp_bw + hops["pp"] * hw.hop_latency_s
    window = compute * (1.0 if layout.zero >= 3 else 2 / 3)  # backward is 2/3 of the work
    exposed_dp = max(dp_s - window, dp_s * (1 - hw.overlap))
    return StepTime(
        compute_s=compute,
        exposed_comm_s=exposed_dp + tp_s + pp_s,
        bubble_s=bubble,
        comm_s=dp_s + tp_s + pp_s,
    )
