"""The helpers a torchrun-style script calls to join Lockstep (trainer.api), on real processes:
two ranks launched with the launch contract's variables, as the node agent launches them."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import trainer
import trainer.checkpoint  # noqa: F401  (the reference trainer's module; the workers' zygote imports it)
from trainer import api

SCRIPT = [sys.executable, "-m", "trainer.examples.ddp_script"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp: Path, args: list[str], world: int = 2, resume_from: str = ""):
    port = _free_port()
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "LOCKSTEP_JOB_ID": "7",
            "LOCKSTEP_CHECKPOINT_DIR": str(tmp / "ckpt"),
            "LOCKSTEP_RESUME_FROM": resume_from,
            "LOCKSTEP_METRICS_PATH": str(tmp / f"metrics-{rank}.jsonl"),
        }
        procs.append(subprocess.Popen([*SCRIPT, *args], env=env, cwd=tmp))
    return procs


def _records(tmp: Path, rank: int, kind: str) -> list[dict]:
    path = tmp / f"metrics-{rank}.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def _wait(procs, timeout=120):
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:  # a rank left waiting in a collective would outlive the test
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes == [0] * len(procs), codes


def test_report_writes_step_records_with_null_for_a_diverged_loss(tmp_path, monkeypatch):
    monkeypatch.setattr(api, "_writer", None)
    monkeypatch.setenv("LOCKSTEP_METRICS_PATH", str(tmp_path / "m.jsonl"))
    monkeypatch.setenv("RANK", "3")
    trainer.report(5, loss=float("nan"), tokens_per_s=1200, step_time_s=float("inf"), lr="x")
    trainer.report(6, loss=0.25)
    api._writer.close()
    monkeypatch.setattr(api, "_writer", None)
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["rank"], r["step"]) for r in records] == [("step", 3, 5), ("step", 3, 6)]
    assert records[0]["loss"] is None and records[0]["step_time_s"] is None
    assert records[0]["tokens_per_s"] == 1200.0 and records[0]["lr"] is None
    assert records[1]["loss"] == 0.25
    with pytest.raises(ValueError, match="step must be a non-negative int"):
        trainer.report(-1, loss=1.0)
    with pytest.raises(ValueError, match=r"metric names \['kind'\] are reserved"):
        trainer.report(7, kind=1.0)


def test_set_total_steps_is_rank_0s_word_and_refuses_a_non_count(tmp_path, monkeypatch):
    for rank in (0, 1):
        monkeypatch.setattr(api, "_writer", None)
        monkeypatch.setenv("LOCKSTEP_METRICS_PATH", str(tmp_path / f"m{rank}.jsonl"))
        monkeypatch.setenv("RANK", str(rank))
        trainer.set_total_steps(500)
        for bad in (0, -1, 2.5, True, "500"):
            with pytest.raises(ValueError, match="total must be a positive int"):
                trainer.set_total_steps(bad)
        api._writer.close()
    monkeypatch.setattr(api, "_writer", None)
    (record,) = [json.loads(line) for line in (tmp_path / "m0.jsonl").read_text().splitlines()]
    assert (record["kind"], record["rank"], record["total_steps"]) == ("total_steps", 0, 500)
    assert (tmp_path / "m1.jsonl").read_text() == ""  # the portal reads rank 0's only


def test_report_takes_a_one_element_tensor_as_a_number(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(api, "_writer", None)
    monkeypatch.setenv("LOCKSTEP_METRICS_PATH", str(tmp_path / "m.jsonl"))
    trainer.report(1, loss=torch.tensor(0.5), grad=torch.ones(3))
    api._writer.close()
    monkeypatch.setattr(api, "_writer", None)
    (record,) = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert record["loss"] == 0.5 and record["grad"] is None


def test_only_should_stop_takes_over_sigterm(tmp_path, monkeypatch):
    # A script that reports but never asks must still die on SIGTERM, not ignore it.
    monkeypatch.setattr(api, "_stop", api.StopFlag((signal.SIGTERM,)))
    monkeypatch.setenv("LOCKSTEP_CHECKPOINT_DIR", str(tmp_path))
    before = signal.getsignal(signal.SIGTERM)
    try:
        trainer.report(1, loss=1.0)
        trainer.resume_from()
        with trainer.save_checkpoint(1):
            pass
        assert signal.getsignal(signal.SIGTERM) is before
        assert trainer.should_stop() is False
        assert signal.getsignal(signal.SIGTERM) is not before
    finally:
        signal.signal(signal.SIGTERM, before)


def test_report_outside_lockstep_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(api, "_writer", None)
    monkeypatch.delenv("LOCKSTEP_METRICS_PATH", raising=False)
    monkeypatch.chdir(tmp_path)
    trainer.report(1, loss=1.0)
    assert list(tmp_path.iterdir()) == []


def test_resume_from_alone_takes_the_latest_committed_save(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("LOCKSTEP_CHECKPOINT_DIR", "LOCKSTEP_RESUME_FROM", "LOCKSTEP_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    assert trainer.resume_from() is None
    for step in (10, 30):
        with trainer.save_checkpoint(step) as path:
            (path / "state.pt").write_bytes(b"x")
    (tmp_path / "checkpoints" / "step-000040").mkdir()  # a save that never finished
    assert trainer.resume_from() == Path("checkpoints") / "step-000030"
    # Under Lockstep the portal decides: an empty choice is a fresh start.
    monkeypatch.setenv("LOCKSTEP_JOB_ID", "1")
    monkeypatch.setenv("LOCKSTEP_RESUME_FROM", "")
    assert trainer.resume_from() is None


def test_the_save_helper_is_not_shadowed_by_the_checkpoint_module():
    # A helper named `checkpoint` was: importing trainer.checkpoint rebinds the name.
    assert callable(trainer.save_checkpoint) and trainer.save_checkpoint is api.save_checkpoint


def test_a_save_that_raises_is_never_committed(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCKSTEP_CHECKPOINT_DIR", str(tmp_path))
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(OSError), trainer.save_checkpoint(3) as path:
        raise OSError("disk full")
    assert path.is_dir() and not (path / "COMMITTED").exists()


def test_a_sigterm_to_one_rank_stops_both_after_the_same_step_with_a_committed_save(tmp_path):
    procs = _launch(tmp_path, ["--steps", "100000", "--step-sleep", "0.02"])
    deadline = time.monotonic() + 120
    while len(_records(tmp_path, 1, "step")) < 10:
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
        time.sleep(0.1)
    procs[1].send_signal(signal.SIGTERM)  # as the agent stops a preempted job, one rank here
    _wait(procs)
    last = [_records(tmp_path, rank, "step")[-1]["step"] for rank in (0, 1)]
    assert last[0] == last[1] < 100000
    (saved,) = [r for r in _records(tmp_path, 0, "checkpoint") if r["step"] == last[0]]
    step_dir = Path(saved["path"])
    assert step_dir == (tmp_path / "ckpt" / f"step-{last[0]:06d}").resolve()
    assert json.loads((step_dir / "COMMITTED").read_text()) == {"step": last[0], "world_size": 2}
    assert saved["bytes"] > 0 and _records(tmp_path, 1, "checkpoint") == []


def test_a_restart_resumes_at_the_next_step_with_the_losses_of_an_unbroken_run(tmp_path):
    unbroken, broken = tmp_path / "unbroken", tmp_path / "broken"
    unbroken.mkdir()
    broken.mkdir()
    _wait(_launch(unbroken, ["--steps", "40"]))
    _wait(_launch(broken, ["--steps", "25", "--checkpoint-every", "25"]))
    _wait(_launch(broken, ["--steps", "40"], resume_from=str(broken / "ckpt" / "step-000025")))
    # The plain script says how long the run is (trainer.set_total_steps), rank 0 only.
    assert [r["total_steps"] for r in _records(unbroken, 0, "total_steps")] == [40]
    assert _records(unbroken, 1, "total_steps") == []
    for rank in (0, 1):
        want = {r["step"]: r["loss"] for r in _records(unbroken, rank, "step")}
        steps = [(r["step"], r["loss"]) for r in _records(broken, rank, "step")]
        assert [s for s, _ in steps] == list(range(1, 26)) + list(range(26, 41))
        for step, loss in steps[25:]:
            assert loss == pytest.approx(want[step], rel=1e-6, abs=1e-9)
