"""Pipeline parallelism: the model cut by layers into `pp` stages, one per rank of a pipeline
group, run by torch.distributed.pipelining's schedules (GPipe or 1F1B); or, interleaved
(Narayanan et al. 2021), into pp x v smaller stages, v per rank, stage s on rank s % pp, which
cuts the bubble v-fold for v times the point-to-point messages.

The device mesh is (pp, dp, tp), row-major as Megatron's: tensor parallelism innermost (inside
a node), pipeline stages outermost, so rank = pp_rank * dp * tp + dp_rank * tp + tp_rank.

What a stage holds (`StageGPT`): the first stage the token and position embeddings, every stage
its contiguous share of the blocks, the last stage the final norm and the output head. A rank
of an interleaved pipeline holds its v stages in one StageGPT (its weights, for the optimizer,
checkpoints and tensor parallelism) and runs each through a `StageChunk`, a view of its share
(the module each PipelineStage runs, and FSDP's root for it). The stage keeps GPT's attribute
names, so its parameters have the same FQNs as the whole model's
(`blocks.5.attn.q.weight` on whichever stage holds block 5): a checkpoint saved with any number
of stages loads into any other, pp = 1 included (trainer/parallel.py's state dicts).

The tied embedding (GPT-2 ties the output head to the token embedding) cannot be one tensor
when the first and last stage are different ranks. As Megatron does, the last stage keeps its
own copy, initialised from the same weights, and after each backward the two gradients are
summed over an embedding group (first and last stage of the same dp/tp coordinate): both copies
then take identical optimizer steps and stay equal, as the single tied tensor would.

Each schedule splits the rank's share of the global batch into n_microbatches equal chunks,
scores each chunk's loss on the last stage and divides the accumulated gradients by the number
of chunks (scale_grads), which is the gradient of the replica's mean loss, as the data-parallel
path computes it with gradient accumulation.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.distributed.tensor import DTensor

from trainer.model import GPT, IGNORE_INDEX

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}
# Schedules that run several stages per rank (a list of PipelineStages).
MULTI_STAGE = frozenset({"interleaved"})


def stage_layers(n_layer: int, stages: int, stage: int) -> range:
    """The blocks of `stage`: contiguous, the number of stages dividing the layers (as the
    planner assumes)."""
    if n_layer % stages:
        raise ValueError(f"{stages} pipeline stages do not divide the {n_layer} layers")
    per = n_layer // stages
    return range(stage * per, (stage + 1) * per)


def rank_stages(pp_rank: int, pp: int, per_rank: int = 1) -> list[int]:
    """The stages of a pipeline rank, as torch's multi-stage schedules place them: stage s on
    rank s % pp (rank 0 of pp 2 with 2 per rank: stages 0 and 2)."""
    return [pp_rank + k * pp for k in range(per_rank)]


def _run_stage(part: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The forward of a stage (or of a rank's only stage): embeddings on the first, its blocks,
    the norm and head on the last."""
    if part.wte is not None:
        assert part.wpe is not None
        pos = torch.arange(x.shape[1], device=x.device)  # (T,)
        x = part.wte(x) + part.wpe(pos)  # (B, T) -> (B, T, C)
    for block in part.blocks.values():
        x = block(x)  # (B, T, C)
    if part.lm_head is not None:
        assert part.ln_f is not None
        return part.lm_head(part.ln_f(x))  # (B, T, V)
    return x


class StageGPT(nn.Module):
    """A pipeline rank's stages of a GPT, with the whole model's parameter names.

    `stages`: its stage indices of `total` (one, except under an interleaved schedule).
    forward(x), for a rank of one stage: token ids (B, T) on the first stage, the residual
    stream (B, T, C) on the others; returns the residual stream, or the logits (B, T, V) on
    the last stage. A rank of several stages runs them through `chunks()`."""

    def __init__(self, full: GPT, stages: int | list[int], total: int) -> None:
        super().__init__()
        self.cfg = full.cfg
        self.stages = [stages] if isinstance(stages, int) else list(stages)
        self.total = total
        self.first, self.last = 0 in self.stages, total - 1 in self.stages
        # Unused parts are dropped, not kept: a stage only holds (and saves) its own weights.
        self.wte = full.wte if self.first else None
        self.wpe = full.wpe if self.first else None
        layers = [i for s in self.stages for i in stage_layers(full.cfg.n_layer, total, s)]
        # A ModuleDict keyed by the layer's index keeps the FQN `blocks.<i>` of the ModuleList.
        self.blocks = nn.ModuleDict({str(i): full.blocks[i] for i in layers})
        self.ln_f = full.ln_f if self.last else None
        self.lm_head = full.lm_head if self.last else None
        self.untied_head = self.last and not self.first
        if self.untied_head:
            assert self.lm_head is not None
            self.lm_head.weight = nn.Parameter(full.wte.weight.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert len(self.stages) == 1, "a rank of several stages runs them through chunks()"
        return _run_stage(self, x)

    def chunks(self) -> list[nn.Module]:
        """The modules its PipelineStages run, one per stage: itself for a rank of one stage.
        Made after tensor parallelism and activation checkpointing have replaced its blocks,
        as they hold the blocks themselves."""
        if len(self.stages) == 1:
            return [self]
        return [StageChunk(self, stage) for stage in self.stages]


class StageChunk(nn.Module):
    """One stage of a rank that holds several: the holder's modules for that stage, shared
    (not copied). Not a child of the holder, so every parameter keeps the one FQN it has
    there."""

    def __init__(self, holder: StageGPT, stage: int) -> None:
        super().__init__()
        first, last = stage == 0, stage == holder.total - 1
        self.wte = holder.wte if first else None
        self.wpe = holder.wpe if first else None
        layers = stage_layers(holder.cfg.n_layer, holder.total, stage)
        self.blocks = nn.ModuleDict({str(i): holder.blocks[str(i)] for i in layers})
        self.ln_f = holder.ln_f if last else None
        self.lm_head = holder.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _run_stage(self, x)


def tied_embedding(module: nn.Module) -> nn.Parameter | None:
    """The stage's copy of the tied embedding: the token embedding on the first stage, the
    head on the last (both on a one-stage model, where they are one tensor anyway)."""
    base = getattr(module, "module", module)  # through DDP
    if not isinstance(base, StageGPT) or base.first == base.last:
        return None
    layer = base.wte if base.first else base.lm_head
    return layer.weight if layer is not None else None


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """GPT.forward's loss, for the last stage's output of one micro-batch."""
    return F.cross_entropy(
        logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX
    )  # (B*T, V), (B*T,)


def embedding_groups(mesh: DeviceMesh) -> dist.ProcessGroup | None:
    """The group of this rank's first and last stage at the same (dp, tp) coordinate, or None
    on a middle stage. Every rank creates every group (new_group is collective)."""
    pp, dp, tp = mesh.mesh.shape
    ranks = mesh.mesh.reshape(pp, dp * tp)
    mine = None
    me = dist.get_rank()
    for coord in range(dp * tp):
        pair = [int(ranks[0, coord]), int(ranks[pp - 1, coord])]
        group = dist.new_group(pair)
        if me in pair:
            mine = group
    return mine


class Pipeline:
    """This rank's stages and the schedule that runs them.

    `module`: the rank's StageGPT (or its DDP/FSDP wrapper); `chunks`: what each of its stages
    runs (`StageGPT.chunks`, FSDP-wrapped where FSDP is on)."""

    def __init__(
        self,
        module: nn.Module,
        chunks: list[nn.Module],
        mesh: DeviceMesh,
        device: torch.device,
        schedule: str,
        dp_group: dist.ProcessGroup | None = None,
    ) -> None:
        holder = getattr(module, "module", module)
        assert isinstance(holder, StageGPT)
        self.pp = mesh.mesh.shape[0]
        self.first, self.last = holder.first, holder.last
        self.pp_group = mesh["pp"].get_group()
        self.stages = [
            PipelineStage(chunk, stage, holder.total, device, group=self.pp_group)
            for chunk, stage in zip(chunks, holder.stages, strict=True)
        ]
        if (schedule in MULTI_STAGE) != (len(self.stages) > 1):
            raise ValueError(f"the {schedule} schedule runs {len(self.stages)} stage(s) per rank")
        self.schedule_name = schedule
        # Made at the first step: the number of micro-batches follows the global batch, which
        # is known only once a checkpoint has been read.
        self._schedules: dict[int, object] = {}
        self.tied = tied_embedding(module)
        self.tied_group = embedding_groups(mesh)
        self.device = device
        self.module = module
        self.dp_group = dp_group if mesh.mesh.shape[1] > 1 else None

    def schedule(self, n_microbatches: int):
        if n_microbatches not in self._schedules:
            cls = SCHEDULES[self.schedule_name]
            stages = self.stages if self.schedule_name in MULTI_STAGE else self.stages[0]
            self._schedules[n_microbatches] = cls(stages, n_microbatches, loss_fn=loss_fn)
        return self._schedules[n_microbatches]

    def step(self, x: torch.Tensor, y: torch.Tensor, n_microbatches: int) -> float:
        """Forward and backward of one replica batch (B, T) in n_microbatches equal chunks;
        the tied embedding's gradients summed; returns the replica's mean loss on every stage."""
        schedule = self.schedule(n_microbatches)
        losses: list[torch.Tensor] = []
        if self.first:
            schedule.step(x)
        elif self.last:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        self._average_dp_grads()
        self._sum_tied_grads()
        # Only the last stage scores the loss; one small all-reduce tells the other stages.
        mean = torch.stack(losses).float().mean() if losses else torch.zeros((), device=self.device)
        total = mean.detach().reshape(1).to(self.device, torch.float32)
        dist.all_reduce(total, group=self.pp_group)
        return float(total.item())

    @torch.no_grad()
    def _average_dp_grads(self) -> None:
        """Plain data parallelism under a pipeline: one all-reduce of the stage's flattened
        gradients after the schedule (FSDP reduce-scatters them itself, during backward)."""
        if self.dp_group is None:
            return
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.dp_group)
        flat /= dist.get_world_size(self.dp_group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    @torch.no_grad()
    def _sum_tied_grads(self) -> None:
        if self.tied is None or self.tied_group is None or self.tied.grad is None:
            return
        grad = self.tied.grad
        # Under FSDP each copy is sharded alike over the dp ranks: the local shards line up.
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        dist.all_reduce(local, group=self.tied_group)
