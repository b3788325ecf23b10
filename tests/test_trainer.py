"""The trainer, run as real processes: training, DDP over gloo, DCP checkpoints with the commit
marker, resharded and exact resumes, preemption by SIGTERM, both datasets, stack dumps of a hung
gang on SIGUSR1, and the fault-injection hooks (a stalled rank, a straggler).

No Django and no database. Run: `pytest tests/test_trainer*.py -p no:cacheprovider`; the other
test_trainer_*.py files cover the data position and elastic resume, the parallel modes, and
asynchronous checkpoints.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from trainer.checkpoint import resolve_resume
from trainer.checkpoint_layout import MARKER, dir_bytes, is_committed, latest_committed, read_marker
from trainer.data import AdditionDataset, BatchPlan, GlobalSampler, build_dataset

REPO = Path(__file__).resolve().parent.parent

# A tiny model so each run costs about a second beyond the interpreter start-up.
TINY = [
    "--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "16",
    "--batch-size", "16", "--lr", "3e-3", "--warmup-steps", "5", "--log-every", "10",
]  # fmt: skip

CONTRACT_VARS = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
)  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trainer_env(
    tmp: Path,
    *,
    rank: int = 0,
    world_size: int = 1,
    port: int | None = None,
    ckpt: Path | None = None,
    resume: str | Path = "",
    metrics: Path | None = None,
) -> dict[str, str]:
    """The launch contract for one rank, as the node agent would set it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCKSTEP_")}
    for key in CONTRACT_VARS:
        env.pop(key, None)
    env.update(
        PYTHONPATH=str(REPO),
        OMP_NUM_THREADS="1",
        LOCKSTEP_DEVICE="cpu",
        LOCKSTEP_CHECKPOINT_DIR=str(ckpt or tmp / "ckpt"),
        LOCKSTEP_RESUME_FROM=str(resume),
        LOCKSTEP_METRICS_PATH=str(metrics or tmp / f"rank-{rank}.metrics.jsonl"),
    )
    if world_size > 1:
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size),
            GROUP_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
    return env


def start(args: list[str], env: dict[str, str], cwd: Path, name: str) -> subprocess.Popen:
    # The child gets its own copy of the file descriptor; ours can close at once.
    with open(cwd / f"{name}.log", "wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "trainer", *TINY, *args],
            env=env,
            cwd=cwd,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def run(args: list[str], env: dict[str, str], cwd: Path, name: str = "run") -> str:
    """Run one trainer process to completion; return its output."""
    proc = start(args, env, cwd, name)
    rc = proc.wait(timeout=120)
    out = (cwd / f"{name}.log").read_text()
    assert rc == 0, out
    return out


def records(path: Path, kind: str | None = None) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in rows if kind is None or r["kind"] == kind]


def losses(path: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(path, "step")}


# --- pure pieces (no processes) -------------------------------------------------------------


def test_samples_are_a_pure_function_of_their_id_and_epochs_are_seeded_permutations():
    data = build_dataset("synthetic://addition?epoch=50")
    assert data.num_samples(16) == 50
    x1, y1 = data.samples(np.array([3, 7, 3]), block_size=16)
    assert torch.equal(x1[0], x1[2]) and torch.equal(y1[0], y1[2])
    assert not torch.equal(x1[0], x1[1])
    sampler = GlobalSampler(50, seed=1)
    epochs, ids = sampler.lookup(0, 120)  # two epochs and a fifth of a third
    assert epochs.tolist() == [0] * 50 + [1] * 50 + [2] * 20
    assert sorted(ids[:50]) == list(range(50)) == sorted(ids[50:100])
    assert ids[:50].tolist() != ids[50:100].tolist()  # a new order each epoch
    assert ids[:50].tolist() != GlobalSampler(50, seed=2).lookup(0, 50)[1].tolist()
    assert sampler.lookup(37, 64)[1].tolist() == ids[37:64].tolist()


def test_batch_plan_splits_the_global_batch_into_equal_micro_batch_counts():
    plan = BatchPlan(global_batch=24, dp_size=3, micro_batch=6)
    assert plan.accum_steps == 2
    assert [plan.micro_ranges(r) for r in range(3)] == [
        [(0, 4), (4, 8)], [(8, 12), (12, 16)], [(16, 20), (20, 24)],
    ]  # fmt: skip
    uneven = BatchPlan(global_batch=10, dp_size=3, micro_batch=4)  # ranks get 4, 3, 3 rows
    ranges = [r for rank in range(3) for r in uneven.micro_ranges(rank)]
    assert uneven.accum_steps == 1 and ranges == [(0, 4), (4, 7), (7, 10)]
    with pytest.raises(ValueError):
        BatchPlan(global_batch=2, dp_size=3, micro_batch=4)


def test_addition_rows_hold_correct_sums_and_only_answers_are_scored():
    data = AdditionDataset(digits=3)
    # 38 inputs + 1 last target = 39 characters = 3 problems of 13 ("123+456=0579\n").
    x, y = data.samples(np.arange(8), block_size=38)
    for row_x, row_y in zip(x.tolist(), y.tolist(), strict=True):
        full = data.decode(row_x) + "\n"
        problems = full.splitlines()
        assert len(problems) == 3
        for problem in problems:
            lhs, answer = problem.split("=")
            a, b = lhs.split("+")
            assert answer == f"{int(a) + int(b):04d}", full
        scored = "".join(full[t + 1] for t in range(38) if row_y[t] >= 0)
        assert scored == "".join(p.split("=")[1] + "\n" for p in problems)


def test_latest_committed_ignores_directories_without_the_marker(tmp_path):
    for step, committed in ((10, True), (20, True), (30, False)):
        d = tmp_path / f"step-{step:06d}"
        d.mkdir()
        (d / "__0_0.distcp").write_bytes(b"x" * 10)
        if committed:
            (d / MARKER).write_text(json.dumps({"step": step, "world_size": 1, "time": 0}))
    (tmp_path / "step-000040").mkdir()
    (tmp_path / "step-000040" / MARKER).write_text("{not json")  # a torn marker is no marker
    assert latest_committed(tmp_path) == tmp_path / "step-000020"
    assert resolve_resume(tmp_path / "step-000030") == tmp_path / "step-000020"
    assert resolve_resume(tmp_path / "step-000010") == (tmp_path / "step-000010").resolve()
    assert resolve_resume(tmp_path) == tmp_path / "step-000020"
    assert resolve_resume("") is None
    assert latest_committed(tmp_path / "missing") is None


# --- real processes -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """60 uninterrupted steps, checkpoints every 25 (and at the end)."""
    d = tmp_path_factory.mktemp("straight")
    out = run(["--steps", "60", "--checkpoint-every", "25", "--deterministic"], trainer_env(d), d)
    (d / "stdout.txt").write_text(out)
    return d


@pytest.fixture(scope="module")
def first_20(tmp_path_factory) -> Path:
    """The same run stopped after 20 steps, checkpoints every 10."""
    d = tmp_path_factory.mktemp("first20")
    run(["--steps", "20", "--checkpoint-every", "10", "--deterministic"], trainer_env(d), d)
    return d


def test_single_process_run_learns_and_commits_a_checkpoint(straight):
    tmp_path, out = straight, (straight / "stdout.txt").read_text()
    metrics = tmp_path / "rank-0.metrics.jsonl"

    (first,) = records(metrics, "start")
    assert first["rank"] == 0 and first["world_size"] == 1 and first["resumed_from_step"] == 0
    assert first["total_steps"] == 60  # --steps: the portal projects the run's end from it
    steps = records(metrics, "step")
    assert [r["step"] for r in steps] == list(range(1, 61))
    for r in steps:
        assert set(r) == {
            "kind", "rank", "step", "loss", "tokens_per_s", "step_time_s", "compute_s", "time",
        }  # fmt: skip
        assert r["tokens_per_s"] == pytest.approx(16 * 16 / r["step_time_s"])
        assert 0 < r["compute_s"] < r["step_time_s"]  # data + forward, before backward
    start_loss = sum(r["loss"] for r in steps[:5]) / 5
    end_loss = sum(r["loss"] for r in steps[-5:]) / 5
    assert start_loss > 2.3  # about ln(13): uniform over the addition alphabet
    assert end_loss < start_loss - 0.5, (start_loss, end_loss)

    ckpts = records(metrics, "checkpoint")
    assert [c["step"] for c in ckpts] == [25, 50, 60]  # every 25, plus the final step
    for c in ckpts:
        path = Path(c["path"])
        assert path == tmp_path / "ckpt" / f"step-{c['step']:06d}"
        assert read_marker(path)["step"] == c["step"]
        assert c["bytes"] == dir_bytes(path) > 0
        assert c["save_s"] > 0
    assert latest_committed(tmp_path / "ckpt") == tmp_path / "ckpt" / "step-000060"
    (end,) = records(metrics, "end")
    assert end["step"] == 60 and end["reason"] == "finished"
    assert "step 60/60" in out


def test_two_ranks_over_gloo_then_resume_on_one_rank(tmp_path):
    port, ckpt = free_port(), tmp_path / "ckpt"
    procs = [
        start(
            ["--steps", "30", "--checkpoint-every", "10"],
            trainer_env(tmp_path, rank=r, world_size=2, port=port, ckpt=ckpt),
            tmp_path,
            f"rank{r}",
        )
        for r in range(2)
    ]
    for r, p in enumerate(procs):
        assert p.wait(timeout=120) == 0, (tmp_path / f"rank{r}.log").read_text()

    for r in range(2):
        metrics = tmp_path / f"rank-{r}.metrics.jsonl"
        assert records(metrics, "start")[0]["world_size"] == 2
        assert [s["step"] for s in records(metrics, "step")] == list(range(1, 31))
        assert records(metrics, "end")[0]["reason"] == "finished"
    # Only rank 0 reports checkpoints, each after its commit.
    assert [c["step"] for c in records(tmp_path / "rank-0.metrics.jsonl", "checkpoint")] == [
        10, 20, 30,
    ]  # fmt: skip
    assert records(tmp_path / "rank-1.metrics.jsonl", "checkpoint") == []
    # Each rank trains on its own data, so the two ranks' losses differ.
    assert losses(tmp_path / "rank-0.metrics.jsonl") != losses(tmp_path / "rank-1.metrics.jsonl")
    latest = latest_committed(ckpt)
    assert latest == ckpt / "step-000030" and read_marker(latest)["world_size"] == 2

    # Resharding: the 2-rank checkpoint resumes on 1 rank.
    resumed = tmp_path / "resumed.metrics.jsonl"
    run(
        ["--steps", "40", "--checkpoint-every", "10"],
        trainer_env(tmp_path, ckpt=ckpt, resume=latest, metrics=resumed),
        tmp_path,
    )
    assert records(resumed, "start")[0]["resumed_from_step"] == 30
    assert [s["step"] for s in records(resumed, "step")] == list(range(31, 41))
    # It continues the 2-rank model, not a fresh one (a fresh model starts near ln(13) = 2.56).
    assert losses(resumed)[31] < losses(tmp_path / "rank-0.metrics.jsonl")[1] - 0.3
    assert latest_committed(ckpt) == ckpt / "step-000040"


def test_resumed_run_reproduces_the_uninterrupted_run_exactly(straight, first_20, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(first_20 / "ckpt", ckpt)
    resumed = tmp_path / "resumed.jsonl"
    run(
        ["--steps", "40", "--checkpoint-every", "10", "--deterministic"],
        trainer_env(tmp_path, resume=ckpt / "step-000020", metrics=resumed),
        tmp_path,
    )
    uninterrupted = losses(straight / "rank-0.metrics.jsonl")
    before, after = losses(first_20 / "rank-0.metrics.jsonl"), losses(resumed)
    assert sorted(before) == list(range(1, 21)) and sorted(after) == list(range(21, 41))
    for step in range(1, 41):
        again = before[step] if step <= 20 else after[step]
        assert again == pytest.approx(uninterrupted[step], abs=1e-6, rel=0), step


def wait_for_steps(path: Path, n: int, procs: list[subprocess.Popen], timeout: float = 60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and len(records(path, "step")) >= n:
            return
        assert all(p.poll() is None for p in procs), "trainer exited early"
        time.sleep(0.05)
    raise AssertionError(f"fewer than {n} step records in {path} after {timeout} s")


def test_sigterm_checkpoints_at_the_next_step_boundary_and_exits_0(tmp_path):
    proc = start(["--steps", "100000", "--checkpoint-every", "0"], trainer_env(tmp_path),
                 tmp_path, "run")  # fmt: skip
    metrics = tmp_path / "rank-0.metrics.jsonl"
    wait_for_steps(metrics, 5, [proc])
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=15) == 0, (tmp_path / "run.log").read_text()
    assert time.monotonic() - sent < 5

    (end,) = records(metrics, "end")
    assert end["reason"] == "preempted"
    stop = end["step"]
    assert records(metrics, "step")[-1]["step"] == stop >= 5
    assert read_marker(tmp_path / "ckpt" / f"step-{stop:06d}")["step"] == stop
    assert [c["step"] for c in records(metrics, "checkpoint")] == [stop]


def test_sigterm_to_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    port = free_port()
    procs = [
        start(["--steps", "100000", "--checkpoint-every", "0"],
              trainer_env(tmp_path, rank=r, world_size=2, port=port), tmp_path, f"rank{r}")
        for r in range(2)
    ]  # fmt: skip
    wait_for_steps(tmp_path / "rank-1.metrics.jsonl", 5, procs)
    procs[1].send_signal(signal.SIGTERM)  # rank 0 never hears of it but must stop too
    for r, p in enumerate(procs):
        assert p.wait(timeout=30) == 0, (tmp_path / f"rank{r}.log").read_text()
    ends = [records(tmp_path / f"rank-{r}.metrics.jsonl", "end")[0] for r in range(2)]
    assert {e["reason"] for e in ends} == {"preempted"}
    assert ends[0]["step"] == ends[1]["step"]
    assert latest_committed(tmp_path / "ckpt").name == f"step-{ends[0]['step']:06d}"


def test_uncommitted_step_dir_is_never_resumed_from(first_20, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(first_20 / "ckpt", ckpt)
    # A save killed half-way: all the data files of a newer step, but no marker.
    torn = ckpt / "step-000030"
    shutil.copytree(ckpt / "step-000020", torn)
    (torn / MARKER).unlink()
    (torn / "stale-part.distcp").write_bytes(b"half")

    resumed = tmp_path / "resumed.jsonl"
    out = run(
        ["--steps", "30", "--checkpoint-every", "10"],
        trainer_env(tmp_path, resume=torn, metrics=resumed),
        tmp_path,
    )
    assert "not a committed checkpoint" in out
    assert records(resumed, "start")[0]["resumed_from_step"] == 20
    assert records(resumed, "step")[0]["step"] == 21
    # Redoing step 30 replaced the torn directory with a clean, committed one.
    assert read_marker(torn)["step"] == 30
    assert not (torn / "stale-part.distcp").exists()


def test_resume_with_no_committed_checkpoint_starts_fresh_and_says_so(tmp_path, capsys):
    (tmp_path / "step-000010").mkdir()
    assert resolve_resume(tmp_path / "step-000010") is None
    assert resolve_resume(tmp_path / "step-000099") is None
    assert "starting fresh" in capsys.readouterr().err


def test_text_file_dataset_trains_on_local_bytes(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog.\n" * 200)
    env = trainer_env(tmp_path)
    env["LOCKSTEP_DATASET"] = f"file://{text}"
    out = run(["--steps", "30", "--checkpoint-every", "0"], env, tmp_path)
    assert f"dataset file://{text}" in out
    steps = records(tmp_path / "rank-0.metrics.jsonl", "step")
    assert len(steps) == 30
    assert steps[0]["loss"] > 5.0  # about ln(256): uniform over bytes
    assert steps[-1]["loss"] < steps[0]["loss"] - 1.0
    # A plain path works too; targets are the inputs shifted by one byte.
    data = build_dataset(str(text))
    assert data.num_samples(8) == (len(text.read_bytes()) - 1) // 8
    x, y = data.samples(np.array([0, 5]), block_size=8)
    assert data.vocab_size == 256 and torch.equal(x[:, 1:], y[:, :-1])


def test_time_based_checkpoints_are_taken_at_the_same_step_on_every_rank(tmp_path):
    """--checkpoint-interval-s (the job's checkpoint_interval_s): rank 0's clock decides."""
    port, ckpt = free_port(), tmp_path / "ckpt"
    args = ["--steps", "60", "--checkpoint-every", "0", "--checkpoint-interval-s", "0.3"]
    procs = [
        start(
            args,
            trainer_env(tmp_path, rank=r, world_size=2, port=port, ckpt=ckpt),
            tmp_path,
            f"rank{r}",
        )
        for r in range(2)
    ]
    for r, p in enumerate(procs):
        assert p.wait(timeout=120) == 0, (tmp_path / f"rank{r}.log").read_text()
    saved = [c["step"] for c in records(tmp_path / "rank-0.metrics.jsonl", "checkpoint")]
    # Saves in between (not only the final one at step 60), each committed by both ranks.
    assert len(saved) >= 2 and saved[-1] == 60, saved
    for step in saved:
        assert read_marker(ckpt / f"step-{step:06d}")["world_size"] == 2


# --- hang diagnosis and fault injection -----------------------------------------------------


def start_gang(tmp_path: Path, args: list[str], extra_env: dict[str, str], world_size: int = 2):
    port = free_port()
    procs = []
    for r in range(world_size):
        env = trainer_env(tmp_path, rank=r, world_size=world_size, port=port)
        env.update(extra_env)
        procs.append(start(args, env, tmp_path, f"rank{r}"))
    return procs


def test_a_stalled_rank_hangs_the_gang_and_sigusr1_dumps_every_ranks_stacks(tmp_path):
    procs = start_gang(
        tmp_path, ["--steps", "1000", "--checkpoint-every", "0"],
        {"LOCKSTEP_TEST_STALL_AT_STEP": "5"},
    )  # fmt: skip
    try:
        metric_files = [tmp_path / f"rank-{r}.metrics.jsonl" for r in range(2)]
        for path in metric_files:
            wait_for_steps(path, 4, procs)
        # Rank 0 sleeps before step 5; rank 1 blocks in step 5's gradient all-reduce.
        time.sleep(2.0)
        for path in metric_files:
            assert [s["step"] for s in records(path, "step")] == [1, 2, 3, 4]
        assert all(p.poll() is None for p in procs), "a hung gang is alive, not dead"

        for p in procs:
            p.send_signal(signal.SIGUSR1)
        logs = [tmp_path / f"rank{r}.log" for r in range(2)]

        def dumped(log: Path) -> bool:
            text = log.read_text()
            return "(most recent call first)" in text and 'train.py", line' in text

        deadline = time.monotonic() + 10
        while not all(dumped(log) for log in logs):
            assert time.monotonic() < deadline, [log.read_text()[-3000:] for log in logs]
            time.sleep(0.05)
        time.sleep(0.3)
        assert all(p.poll() is None for p in procs), "SIGUSR1 must not stop the process"
        stalled, blocked = (log.read_text() for log in logs)
        assert "Current thread" in stalled and "Current thread" in blocked
        assert "in fault" in stalled  # asleep in the test hook
        assert "in backward" in blocked  # waiting for rank 0 in the gradient all-reduce
        for text in (stalled, blocked):
            assert "in train_step" in text and "in train\n" in text
        for path in metric_files:  # still no progress
            assert records(path, "step")[-1]["step"] == 4
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)


def test_a_straggler_shows_in_compute_s_not_in_step_time(tmp_path):
    procs = start_gang(
        tmp_path, ["--steps", "15", "--checkpoint-every", "0"],
        {"LOCKSTEP_TEST_SLOW_RANK": "1", "LOCKSTEP_TEST_SLOW_MS": "50"},
    )  # fmt: skip
    for r, p in enumerate(procs):
        assert p.wait(timeout=120) == 0, (tmp_path / f"rank{r}.log").read_text()
    steps = [records(tmp_path / f"rank-{r}.metrics.jsonl", "step") for r in range(2)]
    assert [len(s) for s in steps] == [15, 15]
    compute = [statistics.median(s["compute_s"] for s in rank) for rank in steps]
    wall = [statistics.median(s["step_time_s"] for s in rank) for rank in steps]
    assert compute[1] - compute[0] >= 0.040, compute
    # The fast rank waits for the straggler in the all-reduce, so the wall times agree.
    assert abs(wall[0] - wall[1]) <= 0.3 * max(wall), wall
    assert wall[0] >= 0.050, wall


def test_a_save_killed_half_way_never_becomes_the_resume_point(tmp_path):
    """SIGKILL while step 20's data is on disk but before its commit: resume uses step 10."""
    ckpt = tmp_path / "ckpt"
    env = trainer_env(tmp_path, ckpt=ckpt)
    proc = start(
        ["--steps", "40", "--checkpoint-every", "10", "--fault-commit-delay-ms", "4000"],
        env,
        tmp_path,
        "killed",
    )
    half = ckpt / "step-000020"
    deadline = time.monotonic() + 90
    while not (half / ".metadata").exists():  # DCP writes .metadata last: all data is down
        assert proc.poll() is None and time.monotonic() < deadline, "no save of step 20 seen"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert not is_committed(half) and any(half.iterdir())
    assert latest_committed(ckpt) == ckpt / "step-000010"
    resumed = tmp_path / "resumed.metrics.jsonl"
    out = run(
        ["--steps", "12", "--checkpoint-every", "10"],
        trainer_env(tmp_path, ckpt=ckpt, resume=half, metrics=resumed),
        tmp_path,
    )
    assert "step-000020 is not a committed checkpoint" in out, out
    assert records(resumed, "start")[0]["resumed_from_step"] == 10
    assert [s["step"] for s in records(resumed, "step")] == [11, 12]
