"""Asynchronous DCP checkpoints (--async-checkpoint), as real processes: the loop runs on while
a save is written in the background, the commit marker comes only after every rank's write is
done, a SIGTERM waits for the in-flight save, and a save killed half-way is never resumed from."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from tests import test_trainer as base
from trainer.checkpoint import dir_bytes, is_committed, latest_committed, read_marker

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
        assert c["save_background_s"] >= 1.5 > c["save_stall_s"] == c["save_s"]
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
