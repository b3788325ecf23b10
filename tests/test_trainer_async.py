"""Asynchronous DCP checkpoints (--async-checkpoint), as real processes: the loop runs on while
a save is written in the background, the commit marker comes only after every rank's write is
done, a SIGTERM waits for the in-flight save, and a save killed half-way is never resumed from.
Every staging mode (fresh buffers, reused buffers, a copy overlapped with the next step) saves
exactly the state of its step: the same bytes as a synchronous save of the same run; and an
overlapped copy holds the optimizer step back until it is taken."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint._state_dict_stager import StateDictStager
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests import test_trainer as base
from trainer.checkpoint import CheckpointManager, TrainState
from trainer.checkpoint_layout import dir_bytes, is_committed, latest_committed, read_marker
from trainer.distributed import DistInfo
from trainer.metrics import MetricsWriter
from trainer.model import GPT, GPTConfig

ASYNC = ["--async-checkpoint", "--checkpoint-every", "10", "--steps", "100000"]


def step_times(path: Path) -> dict[int, float]:
    return {r["step"]: r["time"] for r in base.records(path, "step")}


def test_async_saves_overlap_training_and_a_sigterm_waits_for_the_save_in_flight(tmp_path):
    # Every write sleeps 1.5 s first (fault injection), so each save is visibly in flight.
    procs = base.start_gang(tmp_path, [*ASYNC, "--fault-save-delay-ms", "1500"], {})
    metrics = tmp_path / "rank-0.metrics.jsonl"
    try:
        deadline = time.monotonic() + 90
        while not (metrics.exists() and len(base.records(metrics, "checkpoint")) >= 1):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.05)
        base.wait_for_steps(metrics, base.records(metrics, "step")[-1]["step"] + 3, procs)
        assert latest_committed(tmp_path / "ckpt") is not None
        procs[1].send_signal(signal.SIGTERM)
        for r, p in enumerate(procs):
            assert p.wait(timeout=60) == 0, (tmp_path / f"rank{r}.log").read_text()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()

    (end,) = base.records(metrics, "end")
    assert end["reason"] == "preempted"
    ckpts = base.records(metrics, "checkpoint")
    saved = [c["step"] for c in ckpts]
    assert saved[0] == 10 and saved[-1] == end["step"] and saved == sorted(set(saved))
    times = step_times(metrics)
    for c in ckpts:
        path = Path(c["path"])
        assert read_marker(path)["step"] == c["step"]
        assert c["save_bytes"] == c["bytes"] == dir_bytes(path) > 0
        assert c["save_staging"] == "reuse"  # the default
        # Staging blocked briefly; the write (>= 1.5 s) ran in the background. The stall also
        # counts any wait for the write (at the next save or the exit): every part is in it.
        assert c["save_background_s"] >= 1.5 > c["save_staging_s"] + c["save_staging_wait_s"]
        parts = c["save_staging_s"] + c["save_staging_wait_s"] + c["save_write_wait_s"]
        assert c["save_stall_s"] == c["save_s"] == pytest.approx(parts)
    # The loop went on while step 10's save was written: later steps ended before its commit.
    first = ckpts[0]
    assert max(s for s, t in times.items() if t < first["time"]) >= 12, first
    # Whatever was in flight at the SIGTERM was committed before the exit: no torn step dirs.
    assert all(is_committed(d) for d in (tmp_path / "ckpt").glob("step-*"))


def test_an_async_save_killed_in_the_background_never_becomes_the_resume_point(tmp_path):
    """One rank (DCP's thread-based writer): step 10's save commits, step 20's is killed while
    it is written in the background; the resume takes step 10."""
    ckpt = tmp_path / "ckpt"
    proc = base.start([*ASYNC, "--fault-save-delay-ms", "2500"], base.trainer_env(tmp_path),
                      tmp_path, "killed")  # fmt: skip
    metrics = tmp_path / "rank-0.metrics.jsonl"
    try:
        deadline = time.monotonic() + 90
        # Step 20 waited for step 10's commit, then started its own save and trained on.
        while not (
            metrics.exists() and any(s["step"] >= 24 for s in base.records(metrics, "step"))
        ):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.02)
        assert [c["step"] for c in base.records(metrics, "checkpoint")] == [10]
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert is_committed(ckpt / "step-000010") and not is_committed(ckpt / "step-000020")
    assert latest_committed(ckpt) == ckpt / "step-000010"
    resumed = tmp_path / "resumed.metrics.jsonl"
    out = base.run(["--steps", "12", "--checkpoint-every", "10", "--async-checkpoint"],
                   base.trainer_env(tmp_path, ckpt=ckpt, resume=ckpt / "step-000020",
                                    metrics=resumed), tmp_path)  # fmt: skip
    assert "step-000020 is not a committed checkpoint" in out, out
    assert base.records(resumed, "start")[0]["resumed_from_step"] == 10
    assert [s["step"] for s in base.records(resumed, "step")] == [11, 12]
    assert read_marker(ckpt / "step-000012")["train_state"]["sample_position"] == 12 * 16


def load_flat(step_dir: Path, tmp: Path) -> dict:
    """Every tensor and value of a DCP checkpoint, by key."""
    out = tmp / f"{step_dir.parent.parent.name}-{step_dir.name}.pt"
    dcp_to_torch_save(step_dir, out)
    return torch.load(out, weights_only=False)


def assert_same(a, b, where: str = "") -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    else:
        assert a == b, where


def test_every_staging_mode_saves_exactly_the_state_a_synchronous_save_of_its_step_holds(tmp_path):
    """The same seeded run saved synchronously and with each async staging mode, while the
    writes are slowed (so training goes on during them, and a later save reuses buffers only
    after the earlier write): every step's checkpoint is bit-for-bit the synchronous one."""
    args = ["--steps", "30", "--checkpoint-every", "10", "--deterministic"]
    slow = [*args, "--async-checkpoint", "--fault-save-delay-ms", "400"]
    modes = ("fresh", "reuse", "overlap")
    runs = {"sync": args, **{m: [*slow, "--async-checkpoint-staging", m] for m in modes}}
    for name, argv in runs.items():
        d = tmp_path / name
        d.mkdir()
        base.run(argv, base.trainer_env(d), d)
    reference = base.losses(tmp_path / "sync" / "rank-0.metrics.jsonl")
    for name in runs:
        metrics = tmp_path / name / "rank-0.metrics.jsonl"
        assert base.losses(metrics) == reference, name  # the same training, step by step
        ckpts = base.records(metrics, "checkpoint")
        assert [c["step"] for c in ckpts] == [10, 20, 30], name
        times = step_times(metrics)
        for c in ckpts:
            assert c["save_staging"] == ("sync" if name == "sync" else name)
            parts = c["save_staging_s"] + c["save_staging_wait_s"] + c["save_write_wait_s"]
            assert c["save_stall_s"] == pytest.approx(parts)
            if name != "sync" and c["step"] < 30:
                # Training went on while this save was written: a later step ended first.
                assert max(s for s, t in times.items() if t < c["time"]) > c["step"], (name, c)
            if name == "sync":
                continue
            got = load_flat(Path(c["path"]), tmp_path)
            want = load_flat(tmp_path / "sync" / "ckpt" / Path(c["path"]).name, tmp_path)
            assert_same(got, want, f"{name} step {c['step']}")


def tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=13, block_size=8, n_layer=1, n_head=2, n_embd=16))


def forward_backward(model: GPT, optimizer: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 13, (4, 8), generator=g)
    optimizer.zero_grad()
    _, loss = model(x, x)
    loss.backward()


@pytest.mark.parametrize("hooked", [True, False])
def test_an_overlapped_copy_holds_the_next_optimizer_step_until_it_is_taken(
    tmp_path, monkeypatch, hooked
):
    """In process, with the background copy held back until the next optimizer.step() is
    called and then slowed by 0.4 s: that step waits for the copy (and the wait is the save's
    stall), so the checkpoint holds the weights and AdamW moments of the saved step, not the
    next one. Without the pre-step hook (hooked=False, the control) the same race saves the
    next step's state."""
    real_stage = StateDictStager.stage
    stepping = threading.Event()

    def slow_stage(self, state_dict, non_blocking=False):
        assert stepping.wait(timeout=30)
        time.sleep(0.4)
        return real_stage(self, state_dict, non_blocking)

    monkeypatch.setattr(StateDictStager, "stage", slow_stage)
    model = tiny_gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    forward_backward(model, optimizer, seed=1)
    optimizer.step()
    metrics = tmp_path / "m.jsonl"
    writer = MetricsWriter(metrics, 0)
    ckpt = CheckpointManager(tmp_path / "ckpt", every=1, model=model, optimizer=optimizer,
                             dist_info=DistInfo(), metrics=writer, async_save=True,
                             async_type="thread", async_staging="overlap")  # fmt: skip
    if not hooked:
        ckpt._step_hook.remove()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {i: s["exp_avg"].clone() for i, s in enumerate(optimizer.state.values())}
    path = ckpt.save(TrainState(step=1))
    forward_backward(model, optimizer, seed=2)  # the training goes on at once
    stepping.set()
    started = time.perf_counter()
    optimizer.step()
    waited = time.perf_counter() - started
    assert any(not torch.equal(v, saved[k]) for k, v in model.state_dict().items())
    ckpt.close()
    writer.close()
    (record,) = base.records(metrics, "checkpoint")

    fresh = tiny_gpt()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    loader = CheckpointManager(tmp_path / "ckpt", every=1, model=fresh, optimizer=fresh_opt,
                               dist_info=DistInfo(), metrics=writer)  # fmt: skip
    assert loader.load(path).step == 1
    same_weights = all(torch.equal(v, saved[k]) for k, v in fresh.state_dict().items())
    same_moments = all(
        torch.equal(s["exp_avg"], moments[i]) for i, s in enumerate(fresh_opt.state.values())
    )
    if hooked:
        assert waited >= 0.3 and record["save_staging_wait_s"] >= 0.3, (waited, record)
        assert record["save_stall_s"] >= record["save_staging_wait_s"]
        assert same_weights and same_moments
    else:
        assert record["save_staging_wait_s"] == 0
        assert not same_weights and not same_moments
