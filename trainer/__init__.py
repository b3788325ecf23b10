"""Lockstep's reference trainer: a small GPT trained with DDP, DCP checkpoints with a commit
marker, preemption on SIGTERM, and per-rank metric records for the node agent.

Modules: config (flags), data (datasets), model (the GPT), distributed (process group, DDP),
checkpoint (CheckpointManager, commit protocol), metrics (records), train (the loop).
"""
