"""Parallelism chosen by config, applied to the unchanged model in a fixed order (as in
torchtitan): tensor parallelism, then activation checkpointing, then data parallelism
(DDP, ZeRO-1, or FSDP2), then the optimizer. docs/training.md says what each mode shards.

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

if TYPE_CHECKING:
    from torch.distributed.optim import ZeroRedundancyOptimizer

# checkpoint_wrapper inserts this into parameter names; get_state_dict drops it, and so do we.
_AC_PREFIX = "_checkpoint_wrapped_module."


@dataclass(frozen=True)
class ParallelDims:
    """world_size = dp * tp; rank = dp_rank * tp + tp_rank (the mesh is row-major)."""

    world_size: int
    tp: int
    rank: int = 0

    def __post_init__(self) -> None:
        if self.world_size % self.tp:
            raise ValueError(f"--tp {self.tp} does not divide the world size {self.world_size}")

    @property
    def dp(self) -> int:
        return self.world_size // self.tp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp


def compute_dtype(args: ParallelArgs, device: torch.device) -> torch.dtype:
    if args.precision == "bf16" or (args.precision == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return torch.float32


class Parallelized:
    """The model as the loop uses it, and the mode-specific pieces around it."""

    def __init__(self, model: GPT, cfg_parallel: ParallelArgs, info: DistInfo) -> None:
        self.base = model
        self.args = cfg_parallel
        self.info = info
        self.dims = ParallelDims(info.world_size, cfg_parallel.tp, info.rank)
        self.mode = cfg_parallel.mode
        self.dtype = compute_dtype(cfg_parallel, info.device)
        self.mesh: DeviceMesh | None = None
        if self.dims.tp > 1 and self.dims.dp > 1 and not self.mode.startswith("fsdp"):
            raise ValueError("--tp with more than one data-parallel rank needs --parallel fsdp")
        if self.dims.tp > 1 and self.mode == "zero1":
            # ZeRO-1 would split the optimizer over the tp ranks, which hold different shards.
            raise ValueError("--tp does not combine with --parallel zero1; use fsdp")
        if info.distributed and (self.dims.tp > 1 or self.mode.startswith("fsdp")):
            # Only where DTensors need it: plain DDP and ZeRO-1 use the default group, and a
            # mesh would create sub-communicators for nothing.
            self.mesh = init_device_mesh(
                info.device.type, (self.dims.dp, self.dims.tp), mesh_dim_names=("dp", "tp")
            )
        if self.dims.tp > 1:
            assert self.mesh is not None
            apply_tp(model, self.mesh["tp"])
        if cfg_parallel.activation_checkpointing:
            apply_ac(model)
        self.module: nn.Module = model
        if info.distributed and self.mode.startswith("fsdp"):
            assert self.mesh is not None
            mp = MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)
            apply_fsdp(model, self.mesh["dp"], self.mode == "fsdp", mp)
        elif info.distributed and self.dims.dp > 1:
            self.module = apply_ddp(model, info, cfg_parallel.bucket_cap_mb)
        # FSDP casts the parameters itself; everywhere else bf16 means autocast.
        self._autocast = self.dtype != torch.float32 and not isinstance(model, FSDPModule)

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


def apply_tp(model: GPT, tp_mesh: DeviceMesh) -> None:
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
    for block in model.blocks:
        parallelize_module(block, tp_mesh, plan)


def apply_ac(model: GPT) -> None:
    """Keep only each block's input; recompute its activations during the backward pass."""
    for i, block in enumerate(model.blocks):
        model.blocks[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)


def apply_fsdp(model: GPT, dp_mesh: DeviceMesh, reshard: bool, mp: MixedPrecisionPolicy) -> None:
    """FSDP2: each block is one all-gather / reduce-scatter unit, the root holds the rest.

    reshard=True frees the gathered parameters after forward and gathers them again for the
    backward (ZeRO-3); False keeps them until the backward is done (ZeRO-2-like: more memory,
    one all-gather less per step)."""
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp)


def apply_ddp(model: nn.Module, info: DistInfo, bucket_cap_mb: float = 25.0) -> nn.Module:
    """DDP all-reduces gradients in buckets of bucket_cap_mb as the backward pass fills them,
    so communication overlaps the rest of the backward."""
    if info.device.type == "cuda":
        return DDP(model, device_ids=[info.device.index], bucket_cap_mb=bucket_cap_mb)
    return DDP(model, bucket_cap_mb=bucket_cap_mb)


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


def state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(model, optimizer) state dicts with FQN keys, the same for every mode and world size."""
    if _is_zero1(optimizer):
        return get_model_state_dict(model), _zero1_optim_state(model, optimizer)
    return get_state_dict(model, optimizer)


def load_templates(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """`state_dicts`, less what a load must not ask for (ZeRO-1's shared param_groups)."""
    model_sd, optim_sd = state_dicts(model, optimizer)
    if _is_zero1(optimizer):
        optim_sd = {"state": optim_sd["state"]}
    return model_sd, optim_sd


def load_state_dicts(
    model: nn.Module, optimizer: torch.optim.Optimizer, model_sd: dict, optim_sd: dict
) -> None:
    """Put state dicts filled by dcp.load (from `state_dicts`' templates) back in place."""
    if _is_zero1(optimizer):
        set_model_state_dict(model, model_sd)
        return  # dcp.load wrote the optimizer state into the tensors of _zero1_optim_state
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)


# --- gradient clipping -------------------------------------------------------------------------


@torch.no_grad()
def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> float:
    """Clip the global gradient norm; DTensor gradients (FSDP, TP, or both) count once each.

    torch's clip_grad_norm_ cannot stack norms of DTensors that live on different meshes (the
    TP blocks and the FSDP-only embeddings); so each norm is made a plain replicated number
    first. One small collective per sharded parameter: fine for the reference model."""
    sq = []
    for p in params:
        if p.grad is None:
            continue
        n = p.grad.norm(dtype=torch.float32)
        if isinstance(n, DTensor):
            n = n.full_tensor()
        sq.append(n.pow(2))
    if not sq:
        return 0.0
    total = math.sqrt(float(torch.stack(sq).sum()))
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
