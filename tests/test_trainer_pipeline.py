"""Pipeline parallelism as real gloo processes: 2 stages x 2 data-parallel ranks (GPipe, 1F1B,
interleaved 1F1B) and 2 x 2 x 2 (pp x dp x tp, 1F1B and interleaved) each follow DDP's loss
curve on the same global batch, and a checkpoint saved with 2 stages resumes with 1 and with
4, one saved interleaved resumes on a plain pipeline, and each continues the curve."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.test_trainer_elastic import gang, global_losses
from tests.test_trainer_layout import assert_within_prediction, layout_records
from trainer.checkpoint_layout import read_marker
from trainer.config import parse_args
from trainer.parallel import ParallelDims

# Four layers so that 1, 2 and 4 stages all cut it; a global batch of 32 for every layout.
SHAPE = ["--n-layer", "4", "--global-batch-size", "32", "--steps", "6",
         "--checkpoint-every", "3"]  # fmt: skip
# fp32 on CPU: the same arithmetic in another order. Measured difference from DDP over these
# steps is about 1e-6; the tolerance leaves room for summation order, not for a wrong gradient
# (a missing tied-gradient sum or a wrong micro-batch weight moves the loss by 1e-3 or more).
TOLERANCE = 1e-4
INTERLEAVED_TP = ["--pp", "2", "--tp", "2", "--batch-size", "4", "--parallel", "fsdp",
                  "--pp-schedule", "interleaved"]  # fmt: skip


@pytest.fixture(scope="module")
def ddp(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("ddp4")
    gang(tmp, "run", 4, [*SHAPE, "--batch-size", "8", "--parallel", "ddp"])
    return tmp


def assert_follows(got: dict[int, float], reference: dict[int, float], steps: list[int]) -> None:
    assert sorted(got) == steps, got
    for step in steps:
        assert got[step] == pytest.approx(reference[step], abs=TOLERANCE), (step, got, reference)


@pytest.mark.parametrize(
    ("world", "flags"),
    [
        (4, ["--pp", "2", "--batch-size", "4", "--parallel", "ddp"]),
        (4, ["--pp", "2", "--batch-size", "4", "--parallel", "ddp", "--pp-schedule", "gpipe"]),
        (8, ["--pp", "2", "--tp", "2", "--batch-size", "4", "--parallel", "fsdp"]),
        # Two stages per rank (layers 0 and 2 on rank 0, 1 and 3 on rank 1), each its own
        # FSDP root, as torchtitan shards model parts.
        (
            4,
            [
                "--pp",
                "2",
                "--batch-size",
                "4",
                "--parallel",
                "fsdp",
                "--pp-schedule",
                "interleaved",
            ],
        ),  # fmt: skip
        # The same with tensor parallelism inside each stage: pp x dp x tp on 8 ranks.
        (
            8,
            INTERLEAVED_TP,
        ),
    ],
    ids=[
        "pp2-dp2-1f1b",
        "pp2-dp2-gpipe",
        "pp2-dp2-tp2-fsdp",
        "pp2x2-dp2-interleaved-fsdp",
        "pp2x2-dp2-tp2-interleaved-fsdp",
    ],
)
def test_pipeline_layouts_follow_the_ddp_loss_curve(world, flags, ddp, tmp_path):
    run = gang(tmp_path, "pp", world, [*SHAPE, *flags])
    assert_follows(global_losses(run, world), global_losses(ddp / "run", 4), [1, 2, 3, 4, 5, 6])
    log = (run / "rank0.log").read_text()
    assert "pp 2 x dp 2" in log and "4 micro-batches" in log, log[-2000:]
    marker = read_marker(tmp_path / "ckpt" / "step-000006")
    assert marker["config"]["parallel"]["pp"] == 2
    # Each rank's weights, gradients and optimizer state against the planner's worst stage.
    records = layout_records(run, world)
    assert len(records) == world and records[0]["layout"]["pp"] == 2
    assert_within_prediction(records)


def test_a_two_stage_checkpoint_resumes_on_one_and_on_four_stages(ddp, tmp_path):
    saved = tmp_path / "saved"
    saved.mkdir()
    gang(saved, "pp2", 4, [*SHAPE, "--pp", "2", "--batch-size", "4"])
    reference = global_losses(ddp / "run", 4)
    for world, flags in [
        (2, ["--batch-size", "16"]),  # pp=1: plain DDP over 2 ranks
        (4, ["--pp", "4", "--batch-size", "8"]),  # 4 stages, one block each
    ]:
        tmp = tmp_path / f"w{world}-{flags[1]}"
        tmp.mkdir()
        shutil.copytree(saved / "ckpt", tmp / "ckpt")
        run = gang(tmp, "resumed", world, [*SHAPE, *flags], resume=tmp / "ckpt" / "step-000003")
        # The same model, optimizer state and next sample: the curve continues where the
        # 4-rank DDP run went, which never saw a pipeline.
        assert_follows(global_losses(run, world), reference, [4, 5, 6])


def test_an_interleaved_checkpoint_resumes_on_a_plain_pipeline(ddp, tmp_path):
    """Saved by ranks that each hold two stages (their layers not contiguous), loaded by
    ranks that hold one: the checkpoint names every weight as the whole model does."""
    saved = tmp_path / "saved"
    saved.mkdir()
    flags = ["--pp", "2", "--batch-size", "4", "--parallel", "ddp"]
    run = gang(saved, "interleaved", 4, [*SHAPE, *flags, "--pp-schedule", "interleaved"])
    reference = global_losses(ddp / "run", 4)
    assert_follows(global_losses(run, 4), reference, [1, 2, 3, 4, 5, 6])
    assert "interleaved schedule" in (run / "rank0.log").read_text()
    tmp = tmp_path / "plain"
    tmp.mkdir()
    shutil.copytree(saved / "ckpt", tmp / "ckpt")
    resumed = gang(tmp, "resumed", 4, [*SHAPE, *flags], resume=tmp / "ckpt" / "step-000003")
    assert_follows(global_losses(resumed, 4), reference, [4, 5, 6])


def test_pipeline_flags_are_checked():
    cfg = parse_args(["--n-layer", "4", "--pp", "2", "--pp-schedule", "gpipe"])
    assert (cfg.parallel.pp, cfg.parallel.pp_schedule, cfg.microbatches_per_replica) == (
        2,
        "gpipe",
        4,
    )
    with pytest.raises(ValueError, match="must divide --n-layer"):
        parse_args(["--n-layer", "3", "--pp", "2"])
    with pytest.raises(ValueError, match="zero1"):
        parse_args(["--n-layer", "2", "--pp", "2", "--parallel", "zero1"])
    with pytest.raises(SystemExit):
        parse_args(["--pp-schedule", "zigzag"])
    interleaved = parse_args(["--n-layer", "8", "--pp", "2", "--pp-schedule", "interleaved"])
    assert interleaved.parallel.stages_per_rank == 2
    with pytest.raises(ValueError, match="x 2 stages per rank must divide --n-layer 6"):
        parse_args(["--n-layer", "6", "--pp", "2", "--pp-schedule", "interleaved"])
    with pytest.raises(ValueError, match="needs --pp 2 or more"):
        parse_args(["--pp-schedule", "interleaved"])
    with pytest.raises(ValueError, match="needs --pp-schedule interleaved"):
        parse_args(["--n-layer", "4", "--pp", "2", "--pp-stages-per-rank", "2"])
    with pytest.raises(ValueError, match="multiple of --pp"):
        parse_args(["--n-layer", "4", "--pp", "2", "--pp-schedule", "interleaved",
                    "--pp-microbatches", "3"])  # fmt: skip
    dims = ParallelDims(world_size=8, tp=2, rank=5, pp=2)
    assert (dims.dp, dims.pp_rank, dims.dp_rank) == (2, 1, 0)
    assert ParallelDims(world_size=8, tp=2, rank=3, pp=2).dp_rank == 1
    with pytest.raises(ValueError, match="does not divide"):
        ParallelDims(world_size=6, tp=2, pp=2)
