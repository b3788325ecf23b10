"""Step time of a layout, split into compute, exposed communication and pipeline bubble.

Pure arithmetic beside trainer/planner.py (which counts bytes; this turns them into seconds):

- compute: the model's training FLOPs per step on one GPU (6N + 12LCT per token, PaLM's count,
  trainer/flops.py; x 4/3 for the forward that activation checkpointing repeats) over the
  hardware's achieved FLOP/s. A GPU of a pp x tp group does 1 / (pp x tp) of its replica's work.
- pipeline bubble: a GPipe or 1F1B step of m micro-batches on pp stages idles (pp - 1) of
  m + pp - 1 slots (Narayanan et al. 2021): (pp - 1) / m x compute.
- communication: each part of the planner's bytes (dp, tp, pp) over the bus bandwidth of the
  link its group uses (NVLink inside a node, the network between nodes). Tensor-parallel
  collectives block the next matmul and pipeline sends the next stage: both are exposed.
  Data-parallel traffic overlaps the backward pass (DDP's buckets, FSDP's reduce-scatters;
  ZeRO-3's all-gathers also the forward, by prefetch): only the part longer than that window,
  or the share the overlap cannot hide, whichever is more, is exposed.

docs/planner.md ("Step time") has the measured error per layout and where it comes from.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from trainer.planner import ClusterShape, Layout, ModelShape, global_batch


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
)


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


def step_time(model: ModelShape, cluster: ClusterShape, layout: Layout, hw: Hardware) -> StepTime:
    compute = flops_per_gpu(model, cluster, layout) / hw.flops
    bubble = compute * (layout.pp - 1) / layout.micro_batches
    gpn = cluster.gpus_per_node
    comm = layout.comm_breakdown
    # Rank order as the planner's: tp innermost, dp next, pp outermost.
    dp_bw = hw.inter_node_bw if layout.tp * layout.dp > gpn else hw.intra_node_bw
    pp_bw = hw.inter_node_bw if layout.tp * layout.dp >= gpn else hw.intra_node_bw
    dp_s = comm["dp"] / dp_bw
    tp_s = comm["tp"] / hw.intra_node_bw
    pp_s = comm["pp"] / pp_bw
    window = compute * (1.0 if layout.zero >= 3 else 2 / 3)  # backward is 2/3 of the work
    exposed_dp = max(dp_s - window, dp_s * (1 - hw.overlap))
    return StepTime(
        compute_s=compute,
        exposed_comm_s=exposed_dp + tp_s + pp_s,
        bubble_s=bubble,
        comm_s=dp_s + tp_s + pp_s,
    )
