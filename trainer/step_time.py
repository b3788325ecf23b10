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
  pays a latency per ring step (`ring_hops`), which dominates small ones. Each collective the
  rank waits on costs it a fixed `Hardware.call_s` and `Hardware.peer_s` per peer it waits
  for (`waited_calls`, `waited_peers`), and each of FSDP2's unit gathers and reductions its
  bookkeeping (`Hardware.fsdp_unit_s`), counted from the collectives the reference trainer
  issues (`collective_calls`).

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

    call_s: float = 10e-6
    """Fixed cost to the rank of each collective whose result it needs before it can go on
    (`waited_calls`), beyond the bytes and the ring steps: the launch and the framework's
    dispatch around it (DTensor's, DDP's), and on ranks that share CPU cores the CPU the
    collective takes from their compute. About 10 us where a GPU runs the collective and the
    host runs ahead (not measured here); on gloo ranks sharing 2 cores bench/layouts.py
    calibrates it (0-1.2 ms of CPU across its runs)."""
    peer_s: float = 0.0
    """And per peer it waits for in such a collective (`waited_peers`: n - 1 over n ranks):
    the last of its peers to arrive decides, and on ranks that share cores each peer may be
    off its core. bench/layouts.py needs it to tell tp4 (all-reduces over 4) from tp2 x dp2
    (over 2): one constant per call put one of them 25-30% off once the other was fitted.
    0 where a GPU runs the collective (not measured); 0.2-0.6 ms of CPU on 2 shared cores."""
    fsdp_unit_s: float = 0.0
    """FSDP2's bookkeeping per unit gather or reduce-scatter (`fsdp_unit_calls`): its pre- and
    post-hooks, the copies into and out of the flat buffer, the wait on the work. On a GPU the
    host runs ahead of the device and this hides (0 here, not measured); on a CPU rank it is
    CPU taken from compute: torch.profiler put `FSDP::all_gather`'s own CPU at 2.5 ms a call
    at 2 ranks on 2 cores, and bench/layouts.py calibrates it on the ZeRO-3 layout (0.1-2.7
    ms across its runs: the figure this shared machine gives varies most)."""

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


# Tensor-parallel all-reduces per block per micro-batch: forward, after the attention and the
# MLP projections (row-parallel); backward, the input gradient of every column-parallel layer.
# The reference trainer's q, k and v are three such layers (Megatron fuses them: 2 + 2); a
# recomputed forward adds its 2 again.
TP_FORWARD, TP_BACKWARD = 2, 4
# Small collectives outside the layers every step, over every rank: the loss averaged for the
# metrics and the gradient norm for clipping. Under a pipeline also one over the stages (the
# last stage's loss, "pp_step") and one between the first and last stage (the tied
# embedding's gradient, "tied").
STEP_EXTRAS = 2


def collective_calls(model: ModelShape, layout: Layout) -> dict[str, dict[str, int]]:
    """Collectives one GPU issues per optimizer step, by group and kind ("all_reduce",
    "all_gather", "reduce_scatter", "broadcast", "p2p"), as the reference trainer issues them
    (bench/layouts.py counts them in torch.profiler's traces and checks these counts).

    m micro-batches per step. dp: DDP and ZeRO-1 one all-reduce per gradient bucket (ZeRO-1
    then a broadcast of every updated parameter tensor: 16 per GPT block with biases, 4
    outside); FSDP2 all-gathers each unit (a block, and the rest as one) once per micro-batch
    (ZeRO-2) or twice, for the forward and again for the backward (ZeRO-3; under a pipeline
    the stage keeps them gathered between its backwards: m + 1), and reduce-scatters each
    unit once, at the last micro-batch. tp: TP_FORWARD + TP_BACKWARD all-reduces per block per
    micro-batch. step, pp_step, tied: the small all-reduces of STEP_EXTRAS. pp, on the busiest
    rank: per micro-batch a stage at either end of the
    pipeline sends and receives once, a middle stage twice each way; interleaved, a rank holds
    `layout.stages_per_rank` stages (on 2 ranks each holds one end; beyond, middle ranks
    none)."""
    m, dp, tp, pp = layout.micro_batches, layout.dp, layout.tp, layout.pp
    stages_per_rank = layout.stages_per_rank
    layers = model.layers // pp
    units = layers + 1
    calls: dict[str, dict[str, int]] = {"dp": {}, "tp": {}, "pp": {}, "step": {}}
    calls["step"]["all_reduce"] = STEP_EXTRAS
    if dp > 1:
        if layout.zero <= 1:
            grad_bytes = model.total_params / pp / tp * DTYPE_BYTES[model.dtype]
            calls["dp"]["all_reduce"] = max(1, math.ceil(grad_bytes / DDP_BUCKET_BYTES))
            if layout.zero == 1:
                calls["dp"]["broadcast"] = 16 * layers + 4
        else:
            gathers = m if layout.zero == 2 else (m + 1 if pp > 1 else 2 * m)
            calls["dp"]["all_gather"] = units * gathers
            calls["dp"]["reduce_scatter"] = units
    if tp > 1:
        forward = TP_FORWARD * (2 if model.activation_checkpointing else 1)
        calls["tp"]["all_reduce"] = (forward + TP_BACKWARD) * layers * m
    if pp > 1:
        ends = 1 if pp == 2 else 0  # end stages on the busiest rank
        calls["pp"]["p2p"] = m * (2 * ends + 4 * (stages_per_rank - ends))
        calls["pp_step"] = {"all_reduce": 1}
        calls["tied"] = {"all_reduce": 1}
    return calls


def group_sizes(layout: Layout) -> dict[str, int]:
    """Ranks in each group of `collective_calls` (a pipeline message is between two)."""
    world = layout.dp * layout.tp * layout.pp
    return {"dp": layout.dp, "tp": layout.tp, "pp": 2, "step": world, "pp_step": layout.pp,
            "tied": 2}  # fmt: skip


# Ring steps of one collective over n ranks: an all-reduce is a reduce-scatter and an
# all-gather; a pipeline send is one message, and so is a broadcast's latency (its owner
# sends to every rank at once; bench/layouts.py measured ZeRO-1's 68 broadcasts per step at
# about one ring step each, where n - 1 predicted twice its step).
_HOPS = {
    "all_reduce": lambda n: 2 * (n - 1),
    "all_gather": lambda n: n - 1,
    "reduce_scatter": lambda n: n - 1,
    "broadcast": lambda n: 1,
    "p2p": lambda n: 1,
}


def ring_hops(model: ModelShape, layout: Layout) -> dict[str, int]:
    """Ring steps per optimizer step, by group (the latency part of each collective): each of
    `collective_calls` over its group's ranks. The step's own small all-reduces are counted
    with the data-parallel group's (they are a handful)."""
    size = group_sizes(layout)
    hops = {"dp": 0, "tp": 0, "pp": 0}
    for group, kinds in collective_calls(model, layout).items():
        n = size[group]
        if n < 2:
            continue
        key = group if group in hops else "dp"
        hops[key] += sum(count * _HOPS[kind](n) for kind, count in kinds.items())
    return hops


def _waited(model: ModelShape, layout: Layout) -> list[tuple[int, int]]:
    """(collectives, group size) the rank waits on per optimizer step: tensor parallelism's
    all-reduces; FSDP's gathers and reduce-scatters; DDP's and ZeRO-1's gradient all-reduces,
    which the optimizer step waits for; the step's own small all-reduces (the loss for the
    metrics, the gradient norm, over every rank; under a pipeline the loss over the stages and
    the tied embedding's gradient). Not counted: ZeRO-1's broadcasts, issued together and waited
    on once, and pipeline messages, posted ahead, whose waits are the bubble (with them,
    bench/layouts.py predicted 4-stage 1F1B 42% slow; without, within 1%)."""
    size = group_sizes(layout)
    out = []
    for group, kinds in collective_calls(model, layout).items():
        if group == "pp" or size[group] < 2:
            continue
        plain_dp = group == "dp" and layout.zero < 2
        out.append((kinds.get("all_reduce", 0) if plain_dp else sum(kinds.values()), size[group]))
    return out


def waited_calls(model: ModelShape, layout: Layout) -> int:
    """Collectives the rank waits on per optimizer step (each `Hardware.call_s`)."""
    return sum(calls for calls, _ in _waited(model, layout))


def waited_peers(model: ModelShape, layout: Layout) -> int:
    """Peers the rank waits for per optimizer step: n - 1 for each collective it waits on
    over n ranks (each `Hardware.peer_s`)."""
    return sum(calls * (n - 1) for calls, n in _waited(model, layout))


def fsdp_unit_calls(model: ModelShape, layout: Layout) -> int:
    """FSDP2's gathers and reduce-scatters per optimizer step, each with its hooks and copies
    (`Hardware.fsdp_unit_s`); 0 without FSDP (ZeRO-2/3) or data parallelism."""
    if layout.zero < 2 or layout.dp < 2:
        return 0
    return sum(collective_calls(model, layout)["dp"].values())


def step_time(
    model: ModelShape,
    cluster: ClusterShape,
    layout: Layout,
    hw: Hardware,
) -> StepTime:
    """A layout of `stages_per_rank` V > 1 runs the interleaved 1F1B schedule, whose bubble
    is V times smaller for V times the pipeline messages (Narayanan et al. 2021; the
    planner's bytes already count them)."""
    matmuls = flops_per_gpu(model, cluster, layout) / hw.flops
    bubble = matmuls * (layout.pp - 1) / (layout.micro_batches * layout.stages_per_rank)
    compute = matmuls + optimizer_s(model, layout, hw)
    gpn = cluster.gpus_per_node
    comm = layout.comm_breakdown
    hops = ring_hops(model, layout)
    # Rank order as the planner's: tp innermost, dp next, pp outermost.
    dp_bw = hw.inter_node_bw if layout.tp * layout.dp > gpn else hw.intra_node_bw
    pp_bw = hw.inter_node_bw if layout.tp * layout.dp >= gpn else hw.intra_node_bw
    dp_s = comm["dp"] / dp_bw + hops["dp"] * hw.hop_latency_s
    tp_s = comm["tp"] / hw.intra_node_bw + hops["tp"] * hw.hop_latency_s
    pp_s = comm["pp"] / pp_bw + hops["pp"] * hw.hop_latency_s
    window = compute * (1.0 if layout.zero >= 3 else 2 / 3)  # backward is 2/3 of the work
    exposed_dp = max(dp_s - window, dp_s * (1 - hw.overlap))
    calls_s = (
        waited_calls(model, layout) * hw.call_s
        + waited_peers(model, layout) * hw.peer_s
        + fsdp_unit_calls(model, layout) * hw.fsdp_unit_s
    )
    return StepTime(
        compute_s=compute,
        exposed_comm_s=exposed_dp + tp_s + pp_s + calls_s,
        bubble_s=bubble,
        comm_s=dp_s + tp_s + pp_s + calls_s,
    )
