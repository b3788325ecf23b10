"""Model FLOPs and MFU (trainer/flops.py) and the MFU benchmark's CPU path (bench/mfu.py)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.flops import matmul_params, mfu, peak_flops, training_flops_per_token
from trainer.model import GPT, GPTConfig

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "n_layer,n_embd,vocab,block", [(2, 128, 256, 32), (4, 256, 13, 128), (3, 96, 50, 7)]
)
def test_matmul_params_are_the_reference_models_parameters_less_its_position_embeddings(
    n_layer, n_embd, vocab, block
):
    model = GPT(
        GPTConfig(vocab_size=vocab, block_size=block, n_layer=n_layer, n_head=4, n_embd=n_embd)
    )
    expected = model.num_params() - block * n_embd
    assert matmul_params(n_layer=n_layer, n_embd=n_embd, vocab=vocab) == expected


def test_training_flops_are_palms_6n_plus_12_lct():
    # By hand: 6 x 429,568 + 12 x 2 x 128 x 32.
    assert training_flops_per_token(params=429_568, n_layer=2, n_embd=128, seq=32) == 2_675_712
    # GPT-3 175B (96 layers, 12,288 wide, 2,048 tokens): the attention term is 2.9 e10 of
    # 1.08 e12 FLOPs per token (PaLM, appendix B, counts the same two terms).
    flops = training_flops_per_token(params=175_000_000_000, n_layer=96, n_embd=12288, seq=2048)
    assert flops == pytest.approx(6 * 175e9 + 2.899e10, rel=1e-3)


def test_peaks_are_known_by_device_name_and_dtype_and_unknown_elsewhere():
    assert peak_flops("NVIDIA H200", "bf16") == 989.4e12
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989.4e12
    assert peak_flops("NVIDIA A100-SXM4-80GB", "fp32") == 19.5e12
    assert peak_flops("cpu", "fp32") is None
    assert peak_flops("NVIDIA GeForce RTX 4090", "bf16") is None
    assert peak_flops("NVIDIA H100 PCIe", "bf16") is None  # not the SXM part's peak
    assert peak_flops("NVIDIA H200 NVL", "bf16") is None
    # 2,000 tokens/s of a 1e9-FLOP token on a 4e12 peak: half of it.
    assert mfu(2000, 1e9, 4e12) == pytest.approx(0.5)


def test_the_mfu_benchmark_runs_the_planners_layout_and_reports_the_trainers_throughput(
    tmp_path,
):
    out = tmp_path / "mfu.json"
    done = subprocess.run(
        [sys.executable, "bench/mfu.py", "--shape", "tiny", "--steps", "8", "--warmup", "2"]
        + ["--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "LOCKSTEP_DEVICE": "cpu", "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    (run,) = result["results"]
    shape = result["shape"]
    assert run["dtype"] == "fp32" and run["trainer_device"] == "cpu"
    assert run["layout"]["dp"] == run["layout"]["tp"] == run["layout"]["pp"] == 1
    assert run["steps_used"] == 6
    assert run["matmul_params"] == matmul_params(
        n_layer=shape["n_layer"], n_embd=shape["n_embd"], vocab=shape["vocab"]
    )
    assert run["flops_per_token"] == training_flops_per_token(
        params=run["matmul_params"],
        n_layer=shape["n_layer"],
        n_embd=shape["n_embd"],
        seq=shape["block_size"],
    )
    assert run["tokens_per_s"] > 0
    expected = run["tokens_per_s"] * run["flops_per_token"] / 1e12
    assert run["achieved_tflops"] == pytest.approx(expected, rel=1e-3, abs=1e-4)
    assert run["mfu"] is None and "MFU n/a" in done.stdout  # no data-sheet peak for a CPU


def test_the_mfu_benchmark_rejects_fewer_steps_than_warm_up():
    done = subprocess.run(
        [sys.executable, "bench/mfu.py", "--steps", "5", "--warmup", "10"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "must exceed --warmup" in done.stderr
