"""Lockstep's reference trainer: a small GPT trained with DDP, DCP checkpoints with a commit
marker, preemption on SIGTERM, and per-rank metric records for the node agent.

Modules: config (flags), data (datasets), model (the GPT), distributed (process group, DDP),
checkpoint (CheckpointManager, commit protocol), metrics (records), train (the loop).

For any torchrun-style script, the helpers of trainer.api: report(step, **metrics),
set_total_steps(n), should_stop(), checkpoint_dir(), resume_from() and save_checkpoint(step)
(examples/ddp_script.py). Not `checkpoint`: that name is the trainer.checkpoint module.
"""

from trainer.api import (
    checkpoint_dir,
    report,
    resume_from,
    save_checkpoint,
    set_total_steps,
    should_stop,
)

__all__ = [
    "checkpoint_dir",
    "report",
    "resume_from",
    "save_checkpoint",
    "set_total_steps",
    "should_stop",
]
