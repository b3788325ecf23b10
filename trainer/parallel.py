"""Parallelism chosen by config, applied to the unchanged model in a fixed order (as in
torchtitan): the pipeline cut (trainer/pipeline.py), tensor parallelism, then activation
checkpointing, then data parallelism (DDP, ZeRO-1, or FSDP2), then the optimizer.
docs/training.md says what each mode shards.

Also here: the layout-independent state dicts of model and optimizer for DCP (every mode saves
the same FQN keys, so a checkpoint from one mode or world size loads into any other), gradient
accumulation without a gradient sync on all but the last micro-batch, mixed precision, and a
gradient-norm clip that works when parameters are DTensors on different meshes.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from trainer.config import OptimArgs, ParallelArgs
from trainer.distributed import DistInfo
from trainer.model import GPT
from trainer.pipeline import Pipeline, StageGPT, rank_stages, tied_embedding

if TYPE_CHECKING:
    from torch.distributed.optim import ZeroRedundancyOptimizer

# checkpoint_wrapper inserts this into parameter names; get_state_dict drops it, and so do we.
_AC_PREFIX = "_checkpoint_wrapped_module."


@dataclass(frozen=True)
class ParallelDims:
    """world_size = pp * dp * tp; rank = (pp_rank * dp + dp_rank) * tp + tp_rank (the mesh is
    row-major: tensor parallelism innermost, inside a node; pipeline stages outermost)."""

    world_size: int
    tp: int
    rank: int = 0
    pp: int = 1

    def __post_init__(self) -> None:
        if self.world_size % self.tp:
            raise ValueError(f"--tp {self.tp} does not divide the world size {self.world_size}")
        if self.world_size % (self.tp * self.pp):
            raise ValueError(
                f"--pp {self.pp} x --tp {self.tp} does not divide the world size {self.world_size}"
            )

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)

    @property
    def dp_rank(self) -> int:
        return (self.rank // self.tp) % self.dp

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.tp * self.dp)

    def describe(self) -> str:
        return f"pp {self.pp} x dp {self.dp} x tp {self.tp}"


def compute_dtype(args: ParallelArgs, device: torch.device) -> torch.dtype:
    if args.precision == "bf16" or (args.precision == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return torch.float32


class Parallelized:
    """The model as the loop uses it, and the mode-specific pieces around it."""

    def __init__(self, model: GPT, cfg_parallel: ParallelArgs, info: DistInfo) -> None:
        self.args = cfg_parallel
        self.info = info
        self.dims = ParallelDims(info.world_size, cfg_parallel.tp, info.rank, cfg_parallel.pp)
        self.mode = cfg_parallel.mode
        self.dtype = compute_dtype(cfg_parallel, info.device)
        self.mesh: DeviceMesh | None = None
        self.pipeline: Pipeline | None = None
        if self.dims.tp > 1 and self.dims.dp > 1 and not self.mode.startswith("fsdp"):
            raise ValueError("--tp with more than one data-parallel rank needs --parallel fsdp")
        if (self.dims.tp > 1 or self.dims.pp > 1) and self.mode == "zero1":
            # ZeRO-1 would split the optimizer over every rank, which hold different shards.
            raise ValueError("--tp and --pp do not combine with --parallel zero1; use fsdp")
        needs_mesh = self.dims.tp > 1 or self.dims.pp > 1 or self.mode.startswith("fsdp")
        if info.distributed and needs_mesh:
            # Only where DTensors or sub-groups need it: plain DDP and ZeRO-1 use the default
            # group, and a mesh would create sub-communicators for nothing.
            self.mesh = init_device_mesh(
                info.device.type,
                (self.dims.pp, self.dims.dp, self.dims.tp),
                mesh_dim_names=("pp", "dp", "tp"),
            )
        if self.dims.pp > 1:
            per_rank = cfg_parallel.stages_per_rank
            stages = rank_stages(self.dims.pp_rank, self.dims.pp, per_rank)
            model = StageGPT(model, stages, self.dims.pp * per_rank)
        self.base: nn.Module = model
        if self.dims.tp > 1:
            assert self.mesh is not None
            apply_tp(model, self.mesh["tp"])
        if cfg_parallel.activation_checkpointing:
            apply_ac(model)
        self.module: nn.Module = model
        # What each pipeline stage runs: the stage itself, or views of a rank's several stages
        # (made now: tensor parallelism and activation checkpointing replaced the blocks).
        chunks = model.chunks() if isinstance(model, StageGPT) else [model]
        fsdp = info.distributed and self.mode.startswith("fsdp")
        if fsdp:
            assert self.mesh is not None
            mp = MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)
            apply_fsdp(model, self.mesh["dp"], self.mode == "fsdp", mp, roots=chunks)
        elif info.distributed and self.dims.dp > 1:
            group = self.mesh["dp"].get_group() if self.mesh is not None else None
            if self.dims.pp == 1:
                self.module = apply_ddp(model, info, cfg_parallel.bucket_cap_mb, group)
            # Under a pipeline, DDP's reducer breaks on a schedule's several backwards per
            # step (GPipe: "rebuilt parameter indices size is not same"); the Pipeline
            # all-reduces the stage's gradients over its data-parallel group after the step.
        # FSDP casts the parameters itself; everywhere else bf16 means autocast.
        self._autocast = self.dtype != torch.float32 and not fsdp
        if self.dims.pp > 1:
            assert self.mesh is not None
            self.pipeline = Pipeline(
                self.module,
                chunks,
                self.mesh,
                info.device,
                cfg_parallel.pp_schedule,
                # Plain data parallelism: no DDP wrapper (above), the Pipeline reduces.
                dp_group=None if fsdp else self.mesh["dp"].get_group(),
            )

    def autocast(self) -> contextlib.AbstractContextManager:
        if not self._autocast:
            return contextlib.nullcontext()
        return torch.autocast(self.info.device.type, dtype=self.dtype)

    @contextlib.contextmanager
    def grad_sync(self, sync: bool) -> Iterator[None]:
        """Accumulate gradients locally (no communication) unless sync is True."""
        if isinstance(self.module, DDP) and not sync:
            with self.module.no_sync():
                yield
        elif isinstance(self.base, FSDPModule):
            self.base.set_requires_gradient_sync(sync)
            yield
        else:
            yield

    def clip_grads(self, max_norm: float) -> float:
        """clip_grad_norm over every rank's parameters (one collective)."""
        pipe = self.pipeline
        skip = pipe.tied if pipe is not None and pipe.last else None
        stage_ranks = self.dims.dp * self.dims.tp if self.info.distributed else 1
        return clip_grad_norm(list(self.base.parameters()), max_norm, stage_ranks, skip)

    def build_optimizer(self, optim: OptimArgs) -> torch.optim.Optimizer:
        kw: dict[str, Any] = dict(lr=optim.lr, betas=(0.9, 0.99), weight_decay=optim.weight_decay)
        if self.mode == "zero1" and self.info.distributed:
            # Each rank keeps the AdamW state of its own share of the parameters, steps those,
            # and broadcasts the updated values; DDP still all-reduces whole gradients.
            # Imported here: torch.distributed.optim scripts its functional optimizers with
            # TorchScript on import (0.4 s and deprecation warnings) for every other mode.
            from torch.distributed.optim import ZeroRedundancyOptimizer

            return ZeroRedundancyOptimizer(
                self.base.parameters(), optimizer_class=torch.optim.AdamW, **kw
            )
        return torch.optim.AdamW(self.base.parameters(), **kw)


def blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, block) of the transformer blocks, for the whole model (a ModuleList) and for a
    pipeline stage (a ModuleDict keyed by layer index) alike."""
    return list(model.blocks.named_children())


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Megatron-style: q, k, v and the MLP's first layer split by output columns (whole heads),
    the two projections by input rows, so each block needs one all-reduce forward and one
    backward. Embeddings, norms and the head stay replicated on the tp ranks, which all see the
    same batch."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.proj": RowwiseParallel(),
        "mlp.fc": ColwiseParallel(),
        "mlp.proj": RowwiseParallel(),
    }
    for _, block in blocks(model):
        parallelize_module(block, tp_mesh, plan)


def apply_ac(model: nn.Module) -> None:
    """Keep only each block's input; recompute its activations during the backward pass."""
    for name, block in blocks(model):
        wrapped = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        model.blocks.register_module(name, wrapped)


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    reshard: bool,
    mp: MixedPrecisionPolicy,
    roots: list[nn.Module] | None = None,
) -> None:
    """FSDP2: each block is one all-gather / reduce-scatter unit, the root holds the rest.

    reshard=True frees the gathered parameters after forward and gathers them again for the
    backward (ZeRO-3); False keeps them until the backward is done (ZeRO-2-like: more memory,
    one all-gather less per step). `roots`: the modules whose forward runs (a rank's pipeline
    stages when it holds several, as torchtitan shards each model part; default the model):
    each is the root of what its blocks leave."""
    for _, block in blocks(model):
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp)
    for root in roots or [model]:
        fully_shard(root, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp)


def apply_ddp(
    model: nn.Module,
    info: DistInfo,
    bucket_cap_mb: float = 25.0,
    group: dist.ProcessGroup | None = None,
) -> nn.Module:
    """DDP all-reduces gradients in buckets of bucket_cap_mb as the backward pass fills them,
    so communication overlaps the rest of the backward. `group`: the data-parallel ranks of
    this pipeline stage (None: every rank)."""
    if info.device.type == "cuda":
        return DDP(
            model, device_ids=[info.device.index], bucket_cap_mb=bucket_cap_mb,
            process_group=group,
        )  # fmt: skip
    return DDP(model, bucket_cap_mb=bucket_cap_mb, process_group=group)


# --- state dicts for DCP ---------------------------------------------------------------------


def _is_zero1(optimizer: torch.optim.Optimizer) -> bool:
    return type(optimizer).__name__ == "ZeroRedundancyOptimizer"


def _param_fqns(model: nn.Module) -> dict[nn.Parameter, str]:
    fqns: dict[nn.Parameter, str] = {}
    for name, p in model.named_parameters():
        fqns.setdefault(p, name.replace(_AC_PREFIX, "").removeprefix("module."))
    return fqns


def _zero_init_state(optimizer: torch.optim.Optimizer) -> None:
    """Create AdamW's (zero) state by a step with zero gradients and lr 0 (as DCP does)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if not params or all(optimizer.state.get(p) for p in params):
        return
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for p in params:
        p.grad = None
    for g, lr in zip(optimizer.param_groups, lrs, strict=True):
        g["lr"] = lr


def _zero1_optim_state(model: nn.Module, zero: ZeroRedundancyOptimizer) -> dict[str, Any]:
    """The optimizer state in get_state_dict's FQN layout, holding only this rank's shard:
    DCP's union over the ranks is the full state, and every rank loads just its own part."""
    local = zero.optim
    _zero_init_state(local)
    fqns = _param_fqns(model)
    state = {fqns[p]: local.state[p] for g in local.param_groups for p in g["params"]}
    # The hyperparameters as one group over every parameter, as get_state_dict writes them
    # for the other modes (their loaders expect it); a ZeRO-1 load does not ask for them.
    hyper = {k: v for k, v in local.param_groups[0].items() if k != "params"}
    groups = [{**hyper, "params": list(dict.fromkeys(fqns.values()))}]
    return {"state": state, "param_groups": groups}


# A one-stage model's optimizer state names the tied embedding by its first FQN only.
_TIED_OPTIM_KEY, _HEAD_KEY = "wte.weight", "lm_head.weight"


def _rename_optim_key(optim_sd: dict, old: str, new: str) -> dict:
    state = {new if k == old else k: v for k, v in optim_sd.get("state", {}).items()}
    groups = [
        {**g, "params": [new if k == old else k for k in g["params"]]}
        for g in optim_sd.get("param_groups", [])
    ]
    out = {**optim_sd, "state": state}
    if "param_groups" in optim_sd:
        out["param_groups"] = groups
    return out


def _untied_head(model: nn.Module) -> bool:
    """A last pipeline stage, whose head is its own copy of the tied embedding."""
    tied = tied_embedding(model)
    base = getattr(model, "module", model)
    return tied is not None and getattr(base, "untied_head", False)


def state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(model, optimizer) state dicts with FQN keys, the same for every mode and world size.

    A last pipeline stage saves its head's optimizer state under the tied embedding's key, as
    a one-stage model names it: the first stage saves the same values under it (DCP writes
    replicated entries once), and a checkpoint moves between any numbers of stages."""
    if _is_zero1(optimizer):
        return get_model_state_dict(model), _zero1_optim_state(model, optimizer)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    if _untied_head(model):
        optim_sd = _rename_optim_key(optim_sd, _HEAD_KEY, _TIED_OPTIM_KEY)
    return model_sd, optim_sd


def load_templates(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """`state_dicts`, less what a load must not ask for: the param_groups.

    They hold only hyperparameters, which come from this run's config (the learning rate is
    set every step), and a checkpoint's copy is not layout-independent: each pipeline stage or
    ZeRO-1 rank saves a group listing its own parameters under the same key, and DCP keeps one
    of them. `load_state_dicts` puts this optimizer's own groups back."""
    model_sd, optim_sd = state_dicts(model, optimizer)
    return model_sd, {"state": optim_sd["state"]}


def load_state_dicts(
    model: nn.Module, optimizer: torch.optim.Optimizer, model_sd: dict, optim_sd: dict
) -> None:
    """Put state dicts filled by dcp.load (from `state_dicts`' templates) back in place."""
    if _is_zero1(optimizer):
        set_model_state_dict(model, model_sd)
        return  # dcp.load wrote the optimizer state into the tensors of _zero1_optim_state
    # The groups as this optimizer has them, in state_dicts' FQN form (load_templates).
    optim_sd = {**optim_sd, "param_groups": state_dicts(model, optimizer)[1]["param_groups"]}
    if _untied_head(model):
        optim_sd = _rename_optim_key(optim_sd, _TIED_OPTIM_KEY, _HEAD_KEY)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)


# --- gradient clipping -------------------------------------------------------------------------


@torch.no_grad()
def clip_grad_norm(
    params: list[nn.Parameter],
    max_norm: float,
    stage_ranks: int = 1,
    skip: nn.Parameter | None = None,
) -> float:
    """Clip the global gradient norm with one all-reduce for the whole model.

    Each rank adds the squares of its local gradient values, each divided by the number of
    ranks of its pipeline stage that hold the same values (`stage_ranks` = dp x tp over the
    shards: a DDP gradient is on every rank of the stage, an FSDP shard on the tp ranks, an
    FSDP + TP shard on one), so that one sum over every rank counts each value once, whatever
    mesh each parameter lives on (torch's clip_grad_norm_ cannot stack norms of DTensors on
    different meshes). Under a pipeline each stage holds its own layers and the sum covers
    them all; `skip` (the last stage's copy of the tied embedding) is left out so the tied
    tensor counts once, as in a one-stage model. (Before: one collective per sharded
    parameter, which bench/layouts.py measured as most of a small TP layout's step on gloo.)"""
    local = torch.zeros((), dtype=torch.float32)
    device = torch.device("cpu")
    for p in params:
        if p.grad is None or p is skip:
            continue
        grad = p.grad
        copies = stage_ranks
        if isinstance(grad, DTensor):
            shards = math.prod(
                grad.device_mesh.size(i) for i, pl in enumerate(grad.placements) if pl.is_shard()
            )
            copies = stage_ranks // shards
            grad = grad._local_tensor
        device = grad.device
        local = local.to(device) + grad.float().pow(2).sum() / copies
    if dist.is_initialized() and dist.get_world_size() > 1:
        local = local.reshape(1).to(device)
        dist.all_reduce(local)
    total = math.sqrt(float(local.sum()))
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
    return total


def all_mean(value: float, info: DistInfo) -> float:
    """The mean of value over every rank (a collective)."""
    if not info.distributed:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=info.device)
    dist.all_reduce(t)
    return float(t.item()) / info.world_size
