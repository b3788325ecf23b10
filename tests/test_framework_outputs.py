"""What the agent sees a framework write on its own (nodeagent/scalars.py, nodeagent/saves.py)
and `$(NAME)` in commands (nodeagent/contract.py), against real files: event files written by
torch's SummaryWriter in real processes, saves written by torch.save."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from nodeagent import saves, scalars
from nodeagent.contract import expand_command
from nodeagent.saves import SaveWatcher, classify, seed_resume
from nodeagent.scalars import EventFileName, ScalarTail
from trainer import framework_saves

WRITER = """
import sys, time
from torch.utils.tensorboard import SummaryWriter
w = SummaryWriter(sys.argv[1])
for step in range(int(sys.argv[2])):
    w.add_scalar("train/loss", 1.0 / (step + 1), step)
    w.add_scalar("lr", 0.1, step)
w.add_scalar("diverged", float("nan"), 99)
w.flush()
time.sleep(float(sys.argv[3]))
w.close()
"""


def _writer(cwd: Path, logdir: str, steps: int, linger_s: float) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", WRITER, logdir, str(steps), str(linger_s)], cwd=cwd
    )


def _wait_for_file(root: Path, timeout: float = 60.0) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = list(root.rglob("events.out.tfevents.*"))
        if found:
            return found[0]
        time.sleep(0.1)
    raise AssertionError(f"no event file under {root}")


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_scalars_of_a_rank_are_found_in_its_working_directory_and_read_after_it_exits(tmp_path):
    cwd = tmp_path / "repo"
    cwd.mkdir()
    started = time.time()
    proc = _writer(cwd, "runs/exp", steps=5, linger_s=4)
    path = _wait_for_file(cwd)
    tail = ScalarTail(tmp_path / "ckpt", started)
    # Found through /proc/<pid>/cwd (the rank's own view), attributed by the pid in its name.
    tail.discover({3: (proc.pid, proc.pid)})
    assert proc.wait(timeout=60) == 0
    records, count = tail.read()
    assert count == len(records)
    by_tag = {}
    for r in records:
        by_tag.setdefault(r["name"], []).append((r["step"], r["value"]))
        assert r["kind"] == "scalar" and r["rank"] == 3
    assert by_tag["train/loss"] == [(s, pytest.approx(1 / (s + 1))) for s in range(5)]
    assert [s for s, _ in by_tag["lr"]] == list(range(5))
    # A non-finite value travels as null (the heartbeat is JSON).
    assert by_tag["diverged"] == [(99, None)]
    assert tail.at_eof
    assert path.name.endswith(f".{proc.pid}.0") or f".{proc.pid}." in path.name


def test_unacked_scalars_are_sent_again_and_acked_ones_never(tmp_path):
    started = time.time()
    proc = _writer(tmp_path, str(tmp_path / "ckpt" / "tb"), steps=3, linger_s=0)
    assert proc.wait(timeout=60) == 0
    clock = _Clock()
    tail = ScalarTail(tmp_path / "ckpt", started, clock=clock)
    tail.discover({0: (proc.pid, None)}, final=True)
    first, count = tail.read()
    again, _ = tail.read()  # the heartbeat carrying `first` failed: no ack
    assert again == first and len(first) == 7
    tail.ack(count)
    assert tail.read() == ([], 0)


def test_event_files_of_other_processes_or_earlier_runs_are_not_read(tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = _writer(tmp_path, str(ckpt / "tb"), steps=2, linger_s=0)
    assert proc.wait(timeout=60) == 0
    name = EventFileName.parse(_wait_for_file(ckpt).name)
    assert name is not None and name.pid == proc.pid
    # Another rank's pid: not this attempt's file.
    other = ScalarTail(ckpt, time.time() - 60)
    other.discover({0: (proc.pid + 1, None)}, final=True)
    assert other.read() == ([], 0)
    # The same pid, but the attempt was launched after the file was created: an earlier run.
    later = ScalarTail(ckpt, name.created + 3600)
    later.discover({0: (proc.pid, None)}, final=True)
    assert later.read() == ([], 0)


def test_the_directory_walk_skips_hidden_and_heavy_directories_and_stops_deep(tmp_path):
    for rel in (
        ".venv/a/events.out.tfevents.1.h.1.0",
        "node_modules/events.out.tfevents.1.h.2.0",
        "a/b/c/d/e/f/events.out.tfevents.1.h.3.0",
        "lightning_logs/version_0/events.out.tfevents.1.h.4.0",
    ):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"")
    found = scalars.find_event_files(tmp_path)
    assert [p.relative_to(tmp_path).as_posix() for p in found] == [
        "lightning_logs/version_0/events.out.tfevents.1.h.4.0"
    ]


@pytest.mark.parametrize(
    ("rel", "expected"),
    [
        ("ckpt/epoch=0-step=20.ckpt", ("lightning", 20)),
        ("ckpt/last.ckpt", None),
        ("ckpt/last-v1.ckpt", None),
        ("out/checkpoint-30", ("hf", 30)),
        ("model_000120.pt", ("torch", 120)),
        ("weights.pth", ("torch", None)),
        ("resnet50.pth", ("torch", None)),  # a number in a word is not a step
        ("training_args.bin", None),  # the Hugging Face Trainer's, not a save
        ("notes.txt", None),
    ],
)
def test_saves_are_classified_by_format(tmp_path, rel, expected):
    path = tmp_path / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    if rel.startswith("out/"):
        path.mkdir()
    else:
        path.write_bytes(b"x")
    assert classify(path) == expected


def _hf_dir(root: Path, step: int, *, finished: bool = True) -> Path:
    path = root / f"checkpoint-{step}"
    path.mkdir(parents=True)
    torch.save({"w": torch.ones(2)}, path / "optimizer.pt")
    (path / "model.safetensors").write_bytes(b"weights")
    if finished:
        (path / "trainer_state.json").write_text(f'{{"global_step": {step}}}')
    return path


def test_a_save_is_reported_once_when_whole_and_settled(tmp_path):
    clock = _Clock()
    watcher = SaveWatcher(tmp_path, clock=clock)
    torch.save({"state_dict": {"w": torch.ones(3)}}, tmp_path / "epoch=0-step=10.ckpt")
    (tmp_path / "epoch=0-step=20.ckpt").write_bytes(b"PK\x03\x04 cut short")  # a partial zip
    _hf_dir(tmp_path / "out", 5)
    _hf_dir(tmp_path / "out", 6, finished=False)
    torch.save({"w": torch.ones(1)}, tmp_path / "out" / "checkpoint-5" / "extra.pt")
    watcher.scan()
    assert watcher.read() == ([], 0)  # seen once: not settled yet
    clock.now += saves.SCAN_EVERY_S
    watcher.scan()
    records, count = watcher.read()
    got = {(r["format"], r.get("step"), Path(r["path"]).name) for r in records}
    # Not the cut zip, not the HF directory without its state, nothing inside a save.
    assert got == {("lightning", 10, "epoch=0-step=10.ckpt"), ("hf", 5, "checkpoint-5")}
    assert all(r["kind"] == "checkpoint" and r["bytes"] > 0 for r in records)
    watcher.ack(count)
    clock.now += saves.SCAN_EVERY_S
    watcher.scan()
    assert watcher.read() == ([], 0)  # reported once


def test_a_save_still_growing_waits_and_at_the_end_no_settling_is_needed(tmp_path):
    clock = _Clock()
    watcher = SaveWatcher(tmp_path, clock=clock)
    target = tmp_path / "model_7.pt"
    torch.save({"w": torch.ones(3)}, target)
    watcher.scan()
    clock.now += saves.SCAN_EVERY_S
    torch.save({"w": torch.ones(300)}, target)  # rewritten since: not settled
    os.utime(target, ns=(time.time_ns(), time.time_ns() + 10**9))
    watcher.scan()
    assert watcher.read() == ([], 0)
    watcher.scan(final=True)  # the ranks exited: nobody writes any more
    records, _ = watcher.read()
    assert [(r["format"], r["step"]) for r in records] == [("torch", 7)]


def test_the_save_resumed_from_is_laid_out_where_each_framework_looks(tmp_path):
    old = tmp_path / "job-1" / "attempt-1"
    new = tmp_path / "job-1" / "attempt-2"
    hf = _hf_dir(old / "out", 20)
    lightning = old / "ckpt" / "epoch=0-step=20.ckpt"
    lightning.parent.mkdir(parents=True)
    torch.save({"state_dict": {"w": torch.ones(1)}}, lightning)
    plain = old / "latest.pt"
    torch.save({"w": torch.ones(1)}, plain)

    made = seed_resume(new, str(hf), "hf")
    assert (new / "out" / "checkpoint-20" / "trainer_state.json") in made
    # Hard links: nothing copied.
    assert (new / "out/checkpoint-20/optimizer.pt").stat().st_ino == (
        hf / "optimizer.pt"
    ).stat().st_ino
    assert seed_resume(new, str(hf), "hf") == []  # idempotent: every node's agent calls it

    seed_resume(new, str(lightning), "lightning")
    alias = new / "ckpt" / framework_saves.LIGHTNING_RESUME
    assert alias.stat().st_ino == lightning.stat().st_ino
    assert classify(alias) is None  # Lightning's `last*` pattern; never reported as a save

    seed_resume(new, str(plain), "torch")
    copy = new / "latest.pt"
    # A copy: a script overwriting latest.pt in place must not rewrite attempt 1's save.
    assert copy.stat().st_ino != plain.stat().st_ino
    with open(copy, "wb") as f:
        f.write(b"overwritten")
    assert torch.load(plain, weights_only=True)["w"].tolist() == [1.0]

    # What was laid out is not this attempt's: a watcher started now reports none of it.
    watcher = SaveWatcher(new)
    watcher.scan(final=True)
    assert watcher.read() == ([], 0)
    assert seed_resume(new, str(tmp_path / "elsewhere.pt"), "torch") == []
    assert seed_resume(new, str(hf), "dcp") == []


def test_a_command_names_the_platform_paths_with_dollar_parentheses():
    env = {"LOCKSTEP_CHECKPOINT_DIR": "/ck/job-1/attempt-2", "RANK": "3"}
    argv = ["train.py", "--out", "$(LOCKSTEP_CHECKPOINT_DIR)/run", "--rank=$(RANK)"]
    assert expand_command(argv, env) == ["train.py", "--out", "/ck/job-1/attempt-2/run", "--rank=3"]
    # Kubernetes' rules: $$ is a literal $, an unknown name stays as written, $VAR is not ours.
    assert expand_command(["$$(RANK)", "$(NOPE)", "$RANK", "a$$b"], env) == [
        "$(RANK)",
        "$(NOPE)",
        "$RANK",
        "a$b",
    ]


def test_links_and_fifos_in_a_jobs_directory_are_never_followed_or_opened(tmp_path):
    """The agent reads these as root: a link could name another team's files, a FIFO would
    block its loop."""
    other = tmp_path / "other-team" / "secret.pt"
    other.parent.mkdir()
    torch.save({"w": torch.ones(1)}, other)
    ckpt = tmp_path / "job-1" / "attempt-1"
    ckpt.mkdir(parents=True)
    (ckpt / "stolen.pt").symlink_to(other)
    os.mkfifo(ckpt / "model_5.pt")
    os.mkfifo(ckpt / f"events.out.tfevents.{int(time.time())}.host.{os.getpid()}.0")
    watcher = SaveWatcher(ckpt)
    watcher.scan(final=True)
    assert watcher.read() == ([], 0)
    tail = ScalarTail(ckpt, time.time() - 60)
    tail.discover({0: (os.getpid(), None)}, final=True)
    assert tail.read() == ([], 0)
    # Nor is a save resumed from a link, or from outside the job's directory.
    new = tmp_path / "job-1" / "attempt-2"
    assert seed_resume(new, str(ckpt / "stolen.pt"), "torch") == []
    assert seed_resume(new, str(other), "torch") == []
    assert not new.exists() or not any(new.iterdir())


def test_a_save_rewritten_in_place_is_reported_again_and_a_seeded_one_once_changed(tmp_path):
    clock = _Clock()
    old = tmp_path / "job-1" / "attempt-1"
    old.mkdir(parents=True)
    torch.save({"w": torch.ones(1)}, old / "latest.pt")
    new = tmp_path / "job-1" / "attempt-2"
    seed_resume(new, str(old / "latest.pt"), "torch")
    watcher = SaveWatcher(new, clock=clock)
    watcher.scan(final=True)
    assert watcher.read() == ([], 0)  # as laid out: attempt 1's save, not this attempt's
    for size in (2, 3):
        torch.save({"w": torch.ones(size)}, new / "latest.pt")  # the script saves again
        watcher.scan(final=True)
        records, count = watcher.read()
        assert [Path(r["path"]).name for r in records] == ["latest.pt"]
        assert records[0]["bytes"] == (new / "latest.pt").stat().st_size
        watcher.ack(count)
    # Attempt 1's save is untouched by the overwrites (a copy, not a link).
    assert torch.load(old / "latest.pt", weights_only=True)["w"].tolist() == [1.0]
