"""Parallel modes as real 2-rank gloo runs: each reaches DDP's losses on a tiny model, saves
DCP checkpoints and resumes from them, and checkpoints move between modes (the state dicts have
the same FQN keys in every mode)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.test_trainer_elastic import gang, global_losses
from trainer.checkpoint_layout import read_marker
from trainer.config import ParallelArgs, parse_args
from trainer.parallel import ParallelDims, compute_dtype

STEPS = ["--steps", "4", "--checkpoint-every", "2", "--batch-size", "8"]

# (flags, tolerance against DDP's per-step global loss)
MODES = {
    "zero1": (["--parallel", "zero1"], 1e-4),
    "fsdp": (["--parallel", "fsdp"], 1e-4),
    "fsdp-noreshard": (["--parallel", "fsdp-noreshard"], 1e-4),
    "ddp-ac-small-buckets": (
        ["--parallel", "ddp", "--activation-checkpointing", "--bucket-cap-mb", "0.01"],
        1e-4,
    ),
    # Both ranks form one tensor-parallel group: one data-parallel rank, so the same global
    # batch of 16 takes two micro-batches of 8.
    "fsdp-tp2": (["--parallel", "fsdp", "--tp", "2", "--global-batch-size", "16"], 1e-4),
    # bf16 parameters and activations (FSDP's MixedPrecisionPolicy): close, not equal.
    "fsdp-bf16": (["--parallel", "fsdp", "--precision", "bf16"], 0.1),
}


@pytest.fixture(scope="module")
def ddp(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("ddp")
    gang(tmp, "run", 2, [*STEPS, "--parallel", "ddp"])
    return tmp


@pytest.mark.parametrize("mode", list(MODES))
def test_each_mode_matches_ddp_and_resumes_from_its_own_checkpoint(mode, ddp, tmp_path):
    flags, tol = MODES[mode]
    reference = global_losses(ddp / "run", 2)
    fresh = gang(tmp_path, "fresh", 2, [*STEPS, *flags])
    got = global_losses(fresh, 2)
    assert sorted(got) == [1, 2, 3, 4]
    for step in got:
        assert got[step] == pytest.approx(reference[step], abs=tol), (step, got, reference)
    assert read_marker(tmp_path / "ckpt" / "step-000004")["config"]["parallel"]["mode"] in mode

    resumed = gang(tmp_path, "resumed", 2, [*STEPS, *flags],
                   resume=tmp_path / "ckpt" / "step-000002")  # fmt: skip
    again = global_losses(resumed, 2)
    assert sorted(again) == [3, 4]
    for step in again:
        assert again[step] == pytest.approx(got[step], abs=1e-5 if tol < 0.01 else tol), step


@pytest.mark.parametrize(
    ("saved_by", "loaded_by"),
    [
        ("ddp", ["--parallel", "fsdp", "--tp", "2", "--global-batch-size", "16"]),
        ("ddp", ["--parallel", "zero1"]),
    ],  # fmt: skip
)
def test_a_checkpoint_from_one_mode_resumes_in_another(saved_by, loaded_by, ddp, tmp_path):
    shutil.copytree(ddp / "ckpt", tmp_path / "ckpt")
    resumed = gang(tmp_path, "resumed", 2, [*STEPS, *loaded_by],
                   resume=tmp_path / "ckpt" / "step-000002")  # fmt: skip
    reference = global_losses(ddp / "run", 2)
    got = global_losses(resumed, 2)
    assert sorted(got) == [3, 4]
    for step in got:
        assert got[step] == pytest.approx(reference[step], abs=1e-4), step


def test_parallel_flags_are_parsed_and_checked():
    cfg = parse_args(["--parallel", "fsdp-noreshard", "--tp", "2", "--bucket-cap-mb", "50",
                      "--activation-checkpointing", "--precision", "bf16"])  # fmt: skip
    assert cfg.parallel == ParallelArgs(
        mode="fsdp-noreshard", bucket_cap_mb=50.0, activation_checkpointing=True, tp=2,
        precision="bf16",
    )  # fmt: skip
    with pytest.raises(SystemExit):
        parse_args(["--parallel", "zero3"])
    with pytest.raises(ValueError, match="divisible by --tp"):
        parse_args(["--tp", "3"])
    with pytest.raises(ValueError, match="does not divide"):
        ParallelDims(world_size=4, tp=3)
    dims = ParallelDims(world_size=8, tp=2, rank=5)
    assert (dims.dp, dims.dp_rank) == (4, 2)
    assert compute_dtype(ParallelArgs(), torch.device("cpu")) == torch.float32
    assert compute_dtype(ParallelArgs(), torch.device("cuda")) == torch.bfloat16
    assert compute_dtype(ParallelArgs(precision="fp32"), torch.device("cuda")) == torch.float32
