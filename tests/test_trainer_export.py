"""`python -m trainer.export`: the command the queue worker runs to turn a sharded checkpoint
into one file, so that the platform's own processes never import torch."""

import subprocess
import sys

import torch
import torch.distributed.checkpoint as dcp


def test_a_dcp_checkpoint_becomes_one_torch_file(tmp_path):
    weights = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "step": 7}
    dcp.save(weights, checkpoint_id=str(tmp_path / "step-7"))
    out = tmp_path / "state_dict.pt"
    done = subprocess.run(
        [sys.executable, "-m", "trainer.export", str(tmp_path / "step-7"), str(out)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    loaded = torch.load(out, weights_only=False)
    assert torch.equal(loaded["model"]["w"], weights["model"]["w"]) and loaded["step"] == 7
    assert not out.with_suffix(".pt.tmp").exists()


def test_a_missing_checkpoint_fails_with_its_reason_last_and_writes_nothing(tmp_path):
    out = tmp_path / "state_dict.pt"
    done = subprocess.run(
        [sys.executable, "-m", "trainer.export", str(tmp_path / "nowhere"), str(out)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]  # what the queue worker records
    assert last.startswith("CheckpointException: ") and "nowhere" in last
    assert not out.exists()
