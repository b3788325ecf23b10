"""Memory planner: per-GPU memory and communication of a transformer training run under data,
ZeRO, tensor and pipeline parallelism, which layouts fit, and which one to use and why.

Pure arithmetic (no torch, no Django), so the CLI, the API and the submit form share it.
Formulas, sources and the measured tolerance: docs/planner.md.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

GiB = 1 << 30

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
OPTIMIZERS = ("adam", "sgd")

# Optimizer state per parameter (ZeRO paper, section 3.1: "K"). Mixed precision keeps an fp32
# master copy of the weights beside the fp32 moments; fp32 training updates the weights in
# place. Adam has two moments, SGD with momentum one.
OPTIMIZER_BYTES = {
    ("adam", True): 4 + 4 + 4,  # fp32 master + first moment + second moment
    ("adam", False): 4 + 4,
    ("sgd", True): 4 + 4,  # fp32 master + momentum
    ("sgd", False): 4,
}

# Per GPU, outside the model's tensors: CUDA context, cuBLAS workspaces, NCCL buffers (a CUDA
# context alone is ~0.5 GiB on an H100-class GPU; NCCL communicators add a few hundred MiB each).
FIXED_OVERHEAD_BYTES = 2 * GiB
# The caching allocator rarely packs tensors perfectly; leave this share of the model's bytes.
FRAGMENTATION = 0.10

# Limits that keep a request cheap to answer and catch typos (1e90 parameters).
MAX_GPUS = 1 << 20
MAX_LAYERS = 10_000
MAX_PARAMS = 10**15


class PlanError(ValueError):
    """Bad input: `field` names the offending input (as the CLI/API spell it, snake_case)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def _positive_int(name: str, value: object, hi: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise PlanError(name, f"must be a positive integer, got {value!r}")
    if hi is not None and value > hi:
        raise PlanError(name, f"must be at most {hi:,}, got {value:,}")


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer and how it is trained.

    `params` is optional: without it the GPT formula below is used. With it, everything that
    is not the embeddings (and the untied output head) is spread evenly over the layers.
    """

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    """Tokens per sequence."""
    micro_batch: int = 1
    """Sequences per micro-batch per data-parallel replica."""
    params: int | None = None
    dtype: str = "bf16"
    """bf16/fp16: mixed precision (16-bit weights, grads and activations, fp32 optimizer state);
    fp32: everything in fp32."""
    optimizer: str = "adam"
    activation_checkpointing: bool = False
    """Full recomputation: each layer keeps only its input between forward and backward."""
    flash_attention: bool = True
    """Attention that never stores the seq x seq scores (FlashAttention, torch SDPA)."""
    tied_embeddings: bool = False
    """The output head shares the token embedding's weights (GPT-2, the reference trainer)."""
    vocab_parallel: bool = True
    """Tensor parallelism splits the embedding and the output head too (Megatron); the
    reference trainer keeps them whole on every tensor-parallel rank."""
    global_batch: int | None = None
    """Sequences per optimizer step; default micro_batch x GPUs (one micro-batch per GPU)."""

    def __post_init__(self) -> None:
        _positive_int("layers", self.layers, MAX_LAYERS)
        _positive_int("hidden", self.hidden, 1 << 20)
        _positive_int("heads", self.heads, 1 << 14)
        _positive_int("vocab", self.vocab, 1 << 24)
        _positive_int("seq", self.seq, 1 << 24)
        _positive_int("micro_batch", self.micro_batch, 1 << 20)
        if self.hidden % self.heads:
            raise PlanError("hidden", f"{self.hidden} is not divisible by heads ({self.heads})")
        if self.dtype not in DTYPE_BYTES:
            raise PlanError("dtype", f"must be one of {', '.join(DTYPE_BYTES)}, got {self.dtype!r}")
        if self.optimizer not in OPTIMIZERS:
            raise PlanError(
                "optimizer", f"must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}"
            )
        if self.global_batch is not None:
            _positive_int("global_batch", self.global_batch)
            if self.global_batch % self.micro_batch:
                raise PlanError(
                    "global_batch",
                    f"{self.global_batch} is not a multiple of micro_batch ({self.micro_batch})",
                )
        if self.params is not None:
            _positive_int("params", self.params, MAX_PARAMS)
            if self.params <= self.non_block_params:
                raise PlanError(
                    "params",
                    f"{self.params:,} is not more than the embeddings alone "
                    f"({self.non_block_params:,} = vocab x hidden"
                    f"{'' if self.tied_embeddings else ' x 2'})",
                )

    @property
    def non_block_params(self) -> int:
        """Token embedding, output head unless tied, final LayerNorm (weight and bias)."""
        heads_and_embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return heads_and_embeddings + 2 * self.hidden

    @property
    def derived_params(self) -> int:
        """GPT formula (Kaplan et al. 2020; Narayanan et al. 2021, with biases):
        L x (12h^2 + 13h) + V x h (x 2 untied) + 2h. Per layer: QKV 3h^2 + 3h, attention
        output h^2 + h, MLP 4h^2 + 4h and 4h^2 + h, two LayerNorms 4h. Learned position
        embeddings (seq x h) are not counted: rotary models have none."""
        h = self.hidden
        return self.layers * (12 * h * h + 13 * h) + self.non_block_params

    @property
    def total_params(self) -> int:
        return self.params if self.params is not None else self.derived_params

    @property
    def block_params(self) -> int:
        """Parameters in all transformer blocks together."""
        return self.total_params - self.non_block_params

    @property
    def half_precision(self) -> bool:
        return self.dtype != "fp32"


@dataclass(frozen=True)
class ClusterShape:
    gpus: int
    gpus_per_node: int = 8
    gpu_mem_gb: float = 80.0
    """GPU memory in GiB (2^30 bytes), as nvidia-smi counts it."""
    overhead_bytes: int = FIXED_OVERHEAD_BYTES
    """Per GPU outside the model's tensors (CUDA context, workspaces, NCCL buffers); a CPU
    process has none of them (the trainer's auto layout on CPU passes 0)."""

    def __post_init__(self) -> None:
        _positive_int("gpus", self.gpus, MAX_GPUS)
        _positive_int("gpus_per_node", self.gpus_per_node, 1024)
        mem = self.gpu_mem_gb
        if isinstance(mem, bool) or not isinstance(mem, int | float) or not 0 < mem <= 1 << 20:
            raise PlanError("gpu_mem_gb", f"must be a number of GiB above 0, got {mem!r}")
        if not isinstance(self.overhead_bytes, int) or self.overhead_bytes < 0:
            raise PlanError("overhead_bytes", f"must be bytes >= 0, got {self.overhead_bytes!r}")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise PlanError(
                "gpus",
                f"{self.gpus} GPUs is not a whole number of {self.gpus_per_node}-GPU nodes "
                "(jobs larger than a node take whole nodes)",
            )

    @property
    def gpu_mem_bytes(self) -> int:
        return int(self.gpu_mem_gb * GiB)


@dataclass(frozen=True)
class Layout:
    """One way to spread the run over the GPUs, with its per-GPU cost (the worst stage's)."""

    dp: int
    tp: int
    pp: int
    zero: int
    micro_batches: int
    """Micro-batches per optimizer step on each data-parallel replica."""
    per_gpu_bytes: dict[str, int]
    """weights, grads, optimizer, activations, overhead and their total."""
    zero_buffer_bytes: dict[str, int]
    """The transient parts of per_gpu_bytes weights and grads under ZeRO-2/3 (gathered units,
    an unsharded gradient); what stays resident between steps is the rest."""
    comm_bytes_per_step: int
    """Bytes each GPU sends per optimizer step (all collectives and pipeline sends)."""
    comm_breakdown: dict[str, int]
    """comm_bytes_per_step split into dp (gradients, ZeRO gathers), tp and pp."""
    comm_inter_node_bytes: int
    """The part of comm_bytes_per_step whose group spans nodes (the network, not NVLink)."""
    pipeline_bubble: float
    """Idle share of a 1F1B pipeline step: (pp - 1) / (V x micro_batches + pp - 1)."""
    peak_stage: str
    """Which pipeline stage needs the most memory: first, last or only (pp = 1)."""
    fits: bool
    stages_per_rank: int = 1
    """Pipeline stages each rank holds: 1, or V > 1 under the interleaved 1F1B schedule
    (the bubble V times smaller, V times the pipeline messages, more activations in flight)."""

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        interleaved = f" interleaved x{self.stages_per_rank}" if self.stages_per_rank > 1 else ""
        return f"dp={self.dp} tp={self.tp} pp={self.pp}{interleaved} ZeRO-{self.zero}"


@dataclass(frozen=True)
class Plan:
    model: ModelShape
    cluster: ClusterShape
    layouts: list[Layout]
    recommended: Layout | None
    reasons: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        model = asdict(self.model)
        model["params"] = self.model.total_params
        model["params_derived"] = self.model.params is None
        model["global_batch"] = global_batch(self.model, self.cluster)
        return {
            "model": model,
            "cluster": asdict(self.cluster),
            "assumptions": {
                "fixed_overhead_bytes": self.cluster.overhead_bytes,
                "fragmentation": FRAGMENTATION,
                "tensor_parallel": "Megatron-style with sequence parallelism, inside a node",
                "pipeline_schedule": "1F1B, non-interleaved",
            },
            "layouts": [layout.to_dict() for layout in self.layouts],
            "recommended": self.recommended.to_dict() if self.recommended else None,
            "reasons": list(self.reasons),
        }


def global_batch(model: ModelShape, cluster: ClusterShape) -> int:
    return model.global_batch or model.micro_batch * cluster.gpus


def ring_allreduce_bytes(nbytes: float, n: int) -> float:
    """Bytes each of n GPUs sends in a ring all-reduce of nbytes: a reduce-scatter and an
    all-gather, each moving (n - 1)/n of the buffer (Patarasuk and Yuan 2009)."""
    # Twice the gather, computed so, so that it equals a reduce-scatter plus an all-gather of
    # the same buffer to the byte (ZeRO-0 and ZeRO-1 then tie exactly).
    return 2 * ring_gather_bytes(nbytes, n)


def ring_gather_bytes(nbytes: float, n: int) -> float:
    """Bytes each of n GPUs sends in a ring all-gather or reduce-scatter of nbytes."""
    return (n - 1) / n * nbytes if n > 1 else 0.0


def activation_parts(model: ModelShape, tp: int = 1) -> tuple[float, float]:
    """(bytes one layer keeps for backward per micro-batch, bytes of one layer's full
    activations) on one GPU of a tp-way tensor-parallel group.

    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
    section 4.1): a layer stores s*b*h*(34 + 5*a*s/h) bytes with 16-bit activations; with
    tensor and sequence parallelism every term is divided by t. The 5*a*s/h term is the
    softmax scores, their dropout mask and output; FlashAttention-style kernels keep none of
    them (they keep the output and a per-row log-sum-exp instead), so it is dropped when
    flash_attention is set. Bytes scale with the activation dtype (x 2 for fp32).
    With full activation checkpointing a layer keeps only its 16-bit input (2*s*b*h) and the
    backward pass recomputes one layer at a time, which briefly needs its full activations.
    """
    s, b, h, a = model.seq, model.micro_batch, model.hidden, model.heads
    scale = DTYPE_BYTES[model.dtype] / 2
    per_token = 34 + (0 if model.flash_attention else 5 * a * s / h)
    full = s * b * h * per_token * scale / tp
    if model.activation_checkpointing:
        return 2 * s * b * h * scale / tp, full
    return full, 0.0


def output_activation_bytes(model: ModelShape, tp: int = 1) -> float:
    """The output layer's saved tensors per micro-batch: the final LayerNorm's and the head's
    inputs (s*b*h each, activation dtype) and the fp32 log-probabilities that cross-entropy
    keeps for backward (4*s*b*V), vocabulary-parallel under TP."""
    s, b = model.seq, model.micro_batch
    act = DTYPE_BYTES[model.dtype]
    return (2 * s * b * model.hidden * act + 4 * s * b * model.vocab) / tp


def evaluate(
    model: ModelShape,
    cluster: ClusterShape,
    dp: int,
    tp: int,
    pp: int,
    zero: int,
    stages_per_rank: int = 1,
) -> Layout:
    """The per-GPU memory and traffic of one layout (see docs/planner.md for each term);
    `stages_per_rank` V > 1: the interleaved 1F1B schedule."""
    if dp * tp * pp != cluster.gpus:
        raise PlanError("gpus", f"dp x tp x pp = {dp * tp * pp}, not {cluster.gpus}")
    if model.layers % pp:
        raise PlanError("pp", f"{pp} does not divide the {model.layers} layers")
    v = stages_per_rank
    if v < 1 or (v > 1 and pp < 2) or model.layers % (pp * v):
        raise PlanError(
            "stages_per_rank",
            f"{v} stages per rank on {pp} pipeline ranks does not split {model.layers} layers",
        )
    if zero not in (0, 1, 2, 3):
        raise PlanError("zero", f"must be 0, 1, 2 or 3, got {zero!r}")
    batch = global_batch(model, cluster)
    micro_batches = max(1, math.ceil(batch / (dp * model.micro_batch)))
    wb = DTYPE_BYTES[model.dtype]  # weights and gradients
    ob = OPTIMIZER_BYTES[(model.optimizer, model.half_precision)]
    layers_here = model.layers // pp
    per_layer = model.block_params / model.layers
    embedding = model.vocab * model.hidden
    # ZeRO-3/FSDP gathers one unit (a block, or the embedding) at a time and prefetches the
    # next; the unsharded gradient of a unit lives until it is reduce-scattered.
    unit = max(per_layer / tp, embedding / (tp if model.vocab_parallel else 1))
    keep, recompute = activation_parts(model, tp)
    sbh_bytes = model.seq * model.micro_batch * model.hidden * wb

    stages = ["only"] if pp == 1 else ["first", "last"]
    worst: dict[str, float] | None = None
    worst_stage = stages[0]
    grad_bytes = weight_bytes = 0.0
    for stage in stages:
        if stage == "only":
            stage_embedding = model.non_block_params
        elif stage == "first":
            stage_embedding = embedding
        else:
            # The last stage holds the head; tied weights need their own copy there.
            stage_embedding = embedding + 2 * model.hidden
        split = tp if model.vocab_parallel else 1
        params = model.block_params / pp / tp + stage_embedding / split
        weights = params * wb
        if zero >= 3:  # never more than unsharded (a model of one or two units)
            weights = min(weights, weights / dp + 2 * unit * wb)
        grads = params * wb
        if zero >= 2:
            grads = min(grads, grads / dp + unit * wb)
        optimizer = params * ob / (dp if zero >= 1 else 1)
        # 1F1B: the first stage holds pp micro-batches in flight, the last one. Interleaved
        # over V stages per rank, the first rank warms up with (V - 1) pp + 2 (pp - 1) chunks
        # of a micro-batch (torch's Interleaved1F1B, Megatron's schedule) and holds one more
        # in the steady state: each chunk is 1/V of its layers, so it keeps
        # 1 + (pp - 1) / (V pp) times 1F1B's activations (Narayanan et al. 2021).
        # The last rank warms up with (V - 1) pp chunks and holds one more (1F1B: one).
        if v == 1:
            in_flight = min(pp, micro_batches) if stage == "first" else 1.0
        elif stage == "first":
            in_flight = min((v + 1) * pp - 1, v * micro_batches) / v
        else:
            in_flight = min((v - 1) * pp + 1, v * micro_batches) / v
        activations = in_flight * layers_here * keep + recompute
        if stage in ("only", "first"):
            tokens = math.ceil(in_flight)  # int64 token ids of the micro-batches in flight
            activations += tokens * 8 * model.seq * model.micro_batch
        if stage in ("only", "last"):
            activations += output_activation_bytes(model, tp if model.vocab_parallel else 1)
        parts = {
            "weights": weights,
            "grads": grads,
            "optimizer": optimizer,
            "activations": activations,
        }
        if worst is None or sum(parts.values()) > sum(worst.values()):
            worst, worst_stage = parts, stage
            grad_bytes = weight_bytes = params * wb
            buffers = {
                "weights": weights - params * wb / (dp if zero >= 3 else 1),
                "grads": grads - params * wb / (dp if zero >= 2 else 1),
            }
    assert worst is not None
    model_bytes = sum(worst.values())
    overhead = cluster.overhead_bytes + FRAGMENTATION * model_bytes
    per_gpu = {k: round(v) for k, v in worst.items()}
    per_gpu["overhead"] = round(overhead)
    per_gpu["total"] = round(model_bytes + overhead)

    # Data-parallel traffic. ZeRO-0/1 reduce gradients once per step (accumulation is local);
    # ZeRO-1 reduce-scatters them and all-gathers the updated weights (same volume as an
    # all-reduce, ZeRO paper section 7). ZeRO-2 must reduce-scatter every micro-batch's
    # gradients (it keeps only its shard); ZeRO-3 also gathers the weights for every forward
    # and backward: 3(N-1)/N x model bytes per micro-batch (1.5x DP, ZeRO paper).
    if zero == 0:
        dp_comm = ring_allreduce_bytes(grad_bytes, dp)
    elif zero == 1:
        dp_comm = ring_gather_bytes(grad_bytes, dp) + ring_gather_bytes(weight_bytes, dp)
    elif zero == 2:
        dp_comm = micro_batches * ring_gather_bytes(grad_bytes, dp) + ring_gather_bytes(
            weight_bytes, dp
        )
    else:
        dp_comm = micro_batches * (
            2 * ring_gather_bytes(weight_bytes, dp) + ring_gather_bytes(grad_bytes, dp)
        )
    # Megatron TP: two all-reduces of s*b*h activations per layer forward, two backward (with
    # sequence parallelism: all-gathers + reduce-scatters of the same volume); recomputation
    # repeats the forward ones.
    collectives = 6 if model.activation_checkpointing else 4
    tp_comm = micro_batches * layers_here * collectives * ring_allreduce_bytes(sbh_bytes, tp)
    # 1F1B: each micro-batch's activations go forward and their gradients come back, split
    # over the tensor-parallel ranks (Megatron's scatter/gather optimisation).
    # Interleaved, each micro-batch crosses between ranks V times as often.
    pp_comm = 2 * micro_batches * v * sbh_bytes / tp if pp > 1 else 0.0
    breakdown = {"dp": round(dp_comm), "tp": round(tp_comm), "pp": round(pp_comm)}
    # Rank order as Megatron's: tp innermost, then dp, pp outermost. TP never leaves a node;
    # a DP group spans tp x dp consecutive GPUs; consecutive pipeline stages sit tp x dp apart.
    gpn = cluster.gpus_per_node
    inter_node = (breakdown["dp"] if tp * dp > gpn else 0) + (
        breakdown["pp"] if tp * dp >= gpn else 0
    )
    return Layout(
        dp=dp,
        tp=tp,
        pp=pp,
        zero=zero,
        micro_batches=micro_batches,
        per_gpu_bytes=per_gpu,
        zero_buffer_bytes={k: max(0, round(v)) for k, v in buffers.items()},
        comm_bytes_per_step=sum(breakdown.values()),
        comm_breakdown=breakdown,
        comm_inter_node_bytes=inter_node,
        pipeline_bubble=round((pp - 1) / (v * micro_batches + pp - 1), 4),
        peak_stage=worst_stage,
        fits=per_gpu["total"] <= cluster.gpu_mem_bytes,
        stages_per_rank=v,
    )


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def enumerate_layouts(model: ModelShape, cluster: ClusterShape) -> list[Layout]:
    """Every layout with tp inside a node (a divisor of GPUs per node that also splits the
    heads), pp dividing the layers, dp = GPUs / (tp x pp) and ZeRO 0-3 (0 only when dp = 1,
    where sharding over one replica changes nothing)."""
    batch = global_batch(model, cluster)
    layouts = []
    for tp in _divisors(math.gcd(cluster.gpus_per_node, cluster.gpus)):
        if model.heads % tp:
            continue
        for pp in _divisors(math.gcd(model.layers, cluster.gpus // tp)):
            dp = cluster.gpus // (tp * pp)
            if dp * model.micro_batch > batch:
                continue  # more replicas than micro-batches in the global batch
            for zero in range(4) if dp > 1 else (0,):
                layouts.append(evaluate(model, cluster, dp, tp, pp, zero))
    return layouts


def recommendation_key(layout: Layout) -> tuple:
    """Order of preference among the layouts that fit:
    1. the shallowest pipeline (a 1F1B pipeline idles (pp-1)/(m+pp-1) of each step);
    2. the least traffic over the network between nodes (NVLink inside a node is ~10x faster,
       so tensor parallelism inside a node is worth it when it cuts the gradient traffic that
       crosses the network);
    3. the least tensor parallelism (its collectives block every layer; DP's overlap backward);
    4. the least traffic in all; 5. the least memory (headroom)."""
    return (
        layout.pp,
        layout.comm_inter_node_bytes,
        layout.tp,
        layout.comm_bytes_per_step,
        layout.per_gpu_bytes["total"],
    )


def _gib(n: float) -> str:
    return f"{n / GiB:,.1f} GiB"


def plan(model: ModelShape, cluster: ClusterShape) -> Plan:
    """Enumerate the layouts, mark which fit, and recommend one with its reasons."""
    layouts = enumerate_layouts(model, cluster)
    if not layouts:
        raise PlanError(
            "global_batch", "no layout: the global batch is smaller than micro_batch x GPUs"
        )
    fitting = sorted((lay for lay in layouts if lay.fits), key=recommendation_key)
    # Fitting layouts in order of preference, then the rest from the nearest to fitting.
    layouts.sort(
        key=lambda lay: (
            (0, recommendation_key(lay)) if lay.fits else (1, lay.per_gpu_bytes["total"])
        )
    )
    mem = cluster.gpu_mem_bytes
    if not fitting:
        smallest = min(layouts, key=lambda lay: lay.per_gpu_bytes["total"])
        reasons = [
            f"No layout fits in {_gib(mem)} per GPU; the smallest, {smallest.describe()}, "
            f"needs {_gib(smallest.per_gpu_bytes['total'])}."
        ]
        if not model.activation_checkpointing:
            reasons.append("Turn on activation checkpointing to keep only each layer's input.")
        if model.micro_batch > 1:
            reasons.append("Use a smaller micro-batch (activations grow with it).")
        reasons.append("Or use more GPUs, or GPUs with more memory.")
        return Plan(model, cluster, layouts, None, reasons)

    best = fitting[0]
    total = best.per_gpu_bytes["total"]
    reasons = [
        f"Fits: {_gib(total)} of {_gib(mem)} per GPU ({total / mem:.0%}), "
        f"{len(fitting)} of {len(layouts)} layouts fit."
    ]
    if best.pp == 1:
        reasons.append("pp=1: no pipeline bubble and no stage imbalance.")
    else:
        reasons.append(
            f"pp={best.pp}: no layout with a shallower pipeline fits; 1F1B bubble "
            f"{best.pipeline_bubble:.0%} with {best.micro_batches} micro-batches per step."
        )
    same_pp = [lay for lay in fitting if lay.pp == best.pp]
    if best.tp == 1:
        reasons.append("tp=1: no tensor-parallel collectives on the critical path.")
    else:
        narrower = [lay for lay in same_pp if lay.tp < best.tp]
        if not narrower:
            reasons.append(
                f"tp={best.tp}: the least tensor parallelism that fits at pp={best.pp}; it "
                f"stays inside one {cluster.gpus_per_node}-GPU node (NVLink)."
            )
        else:
            alt = min(narrower, key=recommendation_key)
            reasons.append(
                f"tp={best.tp} inside one {cluster.gpus_per_node}-GPU node (NVLink): "
                f"{_gib(best.comm_inter_node_bytes)} per GPU per step cross the network, "
                f"against {_gib(alt.comm_inter_node_bytes)} for the best fitting "
                f"tp={alt.tp} layout ({alt.describe()})."
            )
    if best.dp > 1:
        same_shape = {
            lay.zero: lay
            for lay in layouts
            if (lay.dp, lay.tp, lay.pp) == (best.dp, best.tp, best.pp)
        }
        what = {
            0: "ZeRO-0: plain data parallelism, nothing sharded",
            1: "ZeRO-1 shards the optimizer state",
            2: "ZeRO-2 shards optimizer state and gradients",
            3: "ZeRO-3/FSDP shards optimizer state, gradients and weights",
        }[best.zero]
        plain = same_shape[0].comm_breakdown["dp"]
        mine = best.comm_breakdown["dp"]
        if mine <= plain:
            what += " at no more data-parallel traffic than plain data parallelism"
        else:
            what += (
                f" at {mine / plain:.1f}x the data-parallel traffic of plain data parallelism "
                f"({best.micro_batches} micro-batches per step)"
            )
        lower = same_shape.get(best.zero - 1)
        if lower is not None and not lower.fits:
            what += f"; ZeRO-{lower.zero} would need {_gib(lower.per_gpu_bytes['total'])}"
        elif lower is not None:
            what += (
                f"; ZeRO-{lower.zero} also fits but needs more memory "
                f"({_gib(lower.per_gpu_bytes['total'])}) for the same traffic"
            )
        reasons.append(what + ".")
    comm = best.comm_breakdown
    reasons.append(
        f"Sends {_gib(best.comm_bytes_per_step)} per GPU per step (data parallel "
        f"{_gib(comm['dp'])}, tensor parallel {_gib(comm['tp'])}, pipeline {_gib(comm['pp'])}; "
        f"{_gib(best.comm_inter_node_bytes)} of it between nodes); "
        f"a ring all-reduce of G bytes over N GPUs sends 2(N-1)/N x G per GPU."
    )
    leaner = [lay for lay in fitting if lay.comm_bytes_per_step < best.comm_bytes_per_step]
    if leaner:
        alt = min(leaner, key=lambda lay: lay.comm_bytes_per_step)
        cost = (
            f"a pipeline of {alt.pp} stages (bubble {alt.pipeline_bubble:.0%})"
            if alt.pp > best.pp
            else f"{_gib(alt.comm_inter_node_bytes)} between nodes"
        )
        reasons.append(
            f"{alt.describe()} sends less in all ({_gib(alt.comm_bytes_per_step)}) "
            f"at the cost of {cost}."
        )
    return Plan(model, cluster, layouts, best, reasons)
