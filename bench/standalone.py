"""The environment a benchmark gives `python -m trainer` run on its own (no agent): the launch
contract's paths, so the trainer writes its metric records and checkpoints under `work`."""

import os
from pathlib import Path


def trainer_env(work: Path, name: str, **extra: str) -> tuple[dict[str, str], Path]:
    """(environment, metrics file) for a run called `name` under `work`."""
    metrics = work / f"{name}.jsonl"
    env = dict(
        os.environ,
        LOCKSTEP_METRICS_PATH=str(metrics),
        LOCKSTEP_CHECKPOINT_DIR=str(work / f"ckpt-{name}"),
        LOCKSTEP_JOB_ID=f"bench-{name}",
        PYTHONUNBUFFERED="1",
        **extra,
    )
    return env, metrics
