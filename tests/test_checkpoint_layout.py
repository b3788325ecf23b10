"""The checkpoint layout and commit marker (trainer/checkpoint_layout.py): one torch-free
definition that the trainer, the helper API, the portal and retention all read."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_layout_loads_no_torch():
    code = "import sys, trainer.checkpoint_layout; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_saves_live_per_attempt_and_only_committed_ones_count(tmp_path):
    from trainer.checkpoint_layout import attempt_dir, latest_committed, step_dirs, write_marker

    here = attempt_dir(tmp_path, 7, 2)
    assert here == tmp_path.resolve() / "job-7" / "attempt-2"
    for step in (5, 20, 100):
        (here / f"step-{step:06d}").mkdir(parents=True)
    write_marker(here / "step-000020", {"step": 20, "world_size": 2})
    (here / "step-000100" / "COMMITTED").write_text("{torn")  # a torn marker is no marker
    assert [p.name for p in step_dirs(here)] == ["step-000005", "step-000020", "step-000100"]
    assert latest_committed(here) == here / "step-000020"
    assert step_dirs(tmp_path / "missing") == [] and latest_committed(tmp_path / "missing") is None


def test_a_removed_save_loses_its_marker_first_and_a_missing_one_is_tolerated(tmp_path):
    from trainer.checkpoint_layout import is_committed, remove_step_dir, write_marker

    step = tmp_path / "step-000010"
    step.mkdir()
    (step / "shard").write_bytes(b"x" * 10)
    write_marker(step, {"step": 10, "world_size": 1})
    assert is_committed(step)
    remove_step_dir(step)
    assert not step.exists()
    remove_step_dir(step, ignore_errors=True)  # already gone: a retried prune
