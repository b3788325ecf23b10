"""Data position and elastic resume, as real gloo processes: a checkpoint saved at one world
size resumes at another with the same model, optimizer and exact next sample; the global batch
is kept by gradient accumulation, or (when allowed) changes with a linearly scaled lr."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import pytest

from tests import test_trainer as base
from trainer.checkpoint import TrainState
from trainer.checkpoint_layout import latest_committed, read_marker
from trainer.config import parse_args
from trainer.train import lr_scale_at, resolve_batch

# Small enough for four CPU processes on a shared 2-core host.
TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "8",
        "--lr", "3e-3", "--warmup-steps", "3", "--log-every", "100"]  # fmt: skip


def gang(
    tmp: Path,
    name: str,
    world: int,
    args: list[str],
    *,
    resume: str | Path = "",
    env: dict[str, str] | None = None,
) -> Path:
    """Run `world` ranks to completion under tmp/name; share tmp/ckpt; return the run dir.
    `env`: variables added to the launch contract's (which drops the caller's LOCKSTEP_*)."""
    run_dir = tmp / name
    run_dir.mkdir()
    port = base.free_port()
    procs = []
    for r in range(world):
        contract = base.trainer_env(
            run_dir, rank=r, world_size=world, port=port, ckpt=tmp / "ckpt", resume=resume
        )
        procs.append(base.start([*TINY, *args], {**contract, **(env or {})}, run_dir, f"rank{r}"))
    try:
        # Generous: on a loaded 2-core host most of a run is 3-4 interpreters importing torch.
        for r, p in enumerate(procs):
            assert p.wait(timeout=240) == 0, (run_dir / f"rank{r}.log").read_text()[-3000:]
    except subprocess.TimeoutExpired:
        logs = {r: (run_dir / f"rank{r}.log").read_text()[-1500:] for r in range(world)}
        raise AssertionError(f"{name}: a rank did not finish; logs: {logs}") from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    return run_dir


def samples(run_dir: Path) -> list[dict]:
    rows = []
    for path in sorted(run_dir.glob("samples-*.jsonl")):
        rows += [json.loads(line) for line in path.read_text().splitlines()]
    return rows


def global_losses(run_dir: Path, world: int) -> dict[int, float]:
    """Mean of the ranks' losses per step: the global batch's loss when ranks hold equal rows."""
    per_rank = [base.losses(run_dir / f"rank-{r}.metrics.jsonl") for r in range(world)]
    return {s: sum(rank[s] for rank in per_rank) / world for s in per_rank[0]}


def test_resharded_resumes_continue_at_the_exact_next_sample(tmp_path):
    """2 ranks for 3 steps, 3 ranks to step 7 (across the epoch boundary), 1 rank to step 10:
    two whole epochs of 60 samples, each consumed exactly once, in a new order each epoch."""
    data = ["--dataset", "synthetic://addition?epoch=60", "--checkpoint-every", "0",
            "--record-samples", "samples-{rank}.jsonl"]  # fmt: skip
    first = gang(tmp_path, "w2", 2, [*data, "--batch-size", "6", "--steps", "3"])
    ckpt = tmp_path / "ckpt"
    marker = read_marker(ckpt / "step-000003")
    assert marker["train_state"]["sample_position"] == 36
    assert marker["train_state"]["global_batch"] == 12
    # The global batch (12) is kept: 3 ranks x 4 rows, then 1 rank x 2 micro-batches of 6.
    second = gang(tmp_path, "w3", 3, [*data, "--batch-size", "4", "--steps", "7"],
                  resume=ckpt / "step-000003")  # fmt: skip
    third = gang(tmp_path, "w1", 1, [*data, "--batch-size", "6", "--steps", "10"],
                 resume=latest_committed(ckpt))  # fmt: skip
    assert "2 micro-batches" in (third / "rank0.log").read_text()
    assert read_marker(ckpt / "step-000010")["train_state"]["epoch"] == 2

    rows = samples(first) + samples(second) + samples(third)
    assert sorted({r["step"] for r in rows}) == list(range(1, 11))
    seen: list[tuple[int, int, int]] = []  # (position, epoch, id)
    for r in rows:
        lo, hi = r["positions"]
        assert len(r["ids"]) == len(r["epochs"]) == hi - lo
        seen += zip(range(lo, hi), r["epochs"], r["ids"], strict=True)
    seen.sort()
    # Every position 0..119 exactly once: nothing repeated or skipped across three restarts.
    assert [p for p, _, _ in seen] == list(range(120))
    for epoch in (0, 1):
        ids = [i for _, e, i in seen if e == epoch]
        assert sorted(ids) == list(range(60)), epoch
    assert [i for _, e, i in seen if e == 0] != [i for _, e, i in seen if e == 1]


def test_four_to_two_to_three_ranks_keeps_the_global_batch_and_the_loss_trajectory(tmp_path):
    """A global batch of 24: 4 ranks x 6, then 2 ranks x 2 micro-batches of 6, then 3 ranks x
    2 micro-batches of 4. The losses follow an uninterrupted 1-rank run of the same batch."""
    common = ["--batch-size", "6", "--checkpoint-every", "3"]
    ckpt = tmp_path / "ckpt"
    w4 = gang(tmp_path, "w4", 4, [*common, "--steps", "3"])
    w2 = gang(tmp_path, "w2", 2, [*common, "--steps", "6"], resume=ckpt / "step-000003")
    w3 = gang(tmp_path, "w3", 3, [*common, "--steps", "9"], resume=ckpt / "step-000006")
    assert "global batch 24 = 2 x 2 micro-batches of <= 6" in (w2 / "rank0.log").read_text()
    assert "global batch 24 = 3 x 2 micro-batches of <= 6" in (w3 / "rank0.log").read_text()
    for step, world in ((3, 4), (6, 2), (9, 3)):
        marker = read_marker(ckpt / f"step-{step:06d}")
        assert marker["world_size"] == world
        assert marker["train_state"]["sample_position"] == 24 * step
        assert marker["train_state"]["global_batch"] == 24
    assert base.records(w3 / "rank-0.metrics.jsonl", "start")[0]["resumed_from_step"] == 6

    straight_tmp = tmp_path / "straight"
    straight_tmp.mkdir()
    straight = gang(straight_tmp, "w1", 1, ["--batch-size", "24", "--steps", "9",
                                           "--checkpoint-every", "0"])  # fmt: skip
    reference = global_losses(straight, 1)
    got = global_losses(w4, 4) | global_losses(w2, 2) | global_losses(w3, 3)
    assert sorted(got) == list(range(1, 10))
    for step in got:
        assert got[step] == pytest.approx(reference[step], abs=2e-4), (step, got, reference)
    assert got[9] < got[1] - 0.1  # and it is training, not standing still


def test_allowing_a_batch_change_scales_the_lr_linearly_with_a_warmup(tmp_path):
    """2 ranks x 6 (global 12), then 3 ranks x 6 (global 18): lr x 1.5, reached over the
    3 warm-up steps after the resume."""
    common = ["--batch-size", "6", "--checkpoint-every", "4", "--log-every", "1"]
    ckpt = tmp_path / "ckpt"
    gang(tmp_path, "w2", 2, [*common, "--steps", "4"])
    w3 = gang(tmp_path, "w3", 3, [*common, "--steps", "8", "--allow-batch-change"],
              resume=ckpt / "step-000004")  # fmt: skip
    log = (w3 / "rank0.log").read_text()
    assert "global batch 12 -> 18" in log
    lrs = {
        int(line.split("step ")[1].split("/")[0]): float(line.split(" lr ")[1].split()[0])
        for line in log.splitlines()
        if "/8 loss" in line
    }
    # Base lr 3e-3 (its own warm-up ended at step 3); scale 1 -> 1.5 over steps 4..7.
    assert lrs == pytest.approx({5: 3e-3 * (1 + 0.5 / 3), 6: 3e-3 * (1 + 1 / 3),
                                 7: 4.5e-3, 8: 4.5e-3}, rel=1e-2)  # fmt: skip
    state = read_marker(ckpt / "step-000008")["train_state"]
    assert state["global_batch"] == 18 and state["reference_global_batch"] == 12
    assert state["sample_position"] == 4 * 12 + 4 * 18
    assert "1 micro-batches" in log  # no accumulation: each rank keeps its 6 rows


def test_resolve_batch_keeps_the_global_batch_unless_a_change_is_allowed():
    cfg = parse_args(["--batch-size", "8", "--warmup-steps", "4"])
    fresh = resolve_batch(cfg, dp=4, resumed=None)
    assert (fresh.global_batch, fresh.reference_global_batch, fresh.sample_position) == (32, 32, 0)
    saved = TrainState(step=10, sample_position=320, global_batch=32, reference_global_batch=32)
    kept = resolve_batch(cfg, dp=2, resumed=saved)  # accumulation keeps 32
    assert (kept.global_batch, kept.sample_position, kept.lr_scale_to) == (32, 320, 1.0)
    explicit = resolve_batch(parse_args(["--global-batch-size", "48"]), dp=2, resumed=saved)
    assert explicit.global_batch == 48 and explicit.lr_scale_to == 1.0
    allowed = parse_args(["--batch-size", "8", "--warmup-steps", "4", "--allow-batch-change"])
    changed = resolve_batch(allowed, dp=2, resumed=saved)  # 2 x 8 = 16: half the batch
    assert (changed.global_batch, changed.lr_scale_from, changed.lr_scale_to) == (16, 1.0, 0.5)
    scales = [lr_scale_at(changed, s, 4) for s in range(10, 16)]
    assert scales == pytest.approx([1.0, 0.875, 0.75, 0.625, 0.5, 0.5])
    # Growing back to 4 ranks mid-ramp starts from where the ramp is.
    mid = dataclasses.replace(changed, step=12)
    again = resolve_batch(allowed, dp=4, resumed=mid)
    assert (again.lr_scale_from, again.lr_scale_to, again.lr_ramp_start) == (0.75, 1.0, 12)
