"""Throughput and MFU of the reference trainer on one device, with the layout the memory
planner picks (issue 5: "on a GPU, wherever one is available: throughput and MFU of the
reference model on one H200, bf16, with the layout the planner picks").

For each precision asked (bf16 and, as the baseline in the same run, fp32 on a GPU; fp32 on
a CPU), the planner (`trainer/planner.py`) is asked for a 1-GPU layout of the shape with the
device's memory: without activation checkpointing if that fits, else with it. The trainer
then runs that layout (`python -m trainer`, one process) and its step records give the
tokens/s (median after the warm-up steps). Model FLOPs per token are PaLM's 6N + 12 L C T
(`trainer/flops.py`); MFU is achieved over the data-sheet peak for the device and dtype, and
is left out where the peak is not known (CPUs).

    .venv/bin/python bench/mfu.py                     # the device at hand, its default shape
    .venv/bin/python bench/mfu.py --shape tiny --steps 20
    # writes bench/results/mfu-<device>.json
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from standalone import trainer_env  # noqa: E402  (bench/, the script's own folder)

from trainer.flops import mfu, peak_flops, training_flops_per_token  # noqa: E402
from trainer.planner import ClusterShape, ModelShape, plan  # noqa: E402

SHAPES = {
    # GPT-2 XL-like width at 24 layers: 1.2 B parameters, 8 x 1,024 tokens a step; its
    # mixed-precision Adam state (about 20 GB) fits one H200 with room for activations.
    "1b": {"n_layer": 24, "n_head": 16, "n_embd": 2048, "block_size": 1024, "batch_size": 8},
    # The CPU shape: small enough for a 2-core machine in seconds.
    "tiny": {"n_layer": 2, "n_head": 4, "n_embd": 128, "block_size": 64, "batch_size": 8},
}
VOCAB = 256  # byte-level text (the trainer's file datasets); the bench writes its own file
DATASET_BYTES = 8 << 20
PARAMS_LINE = re.compile(r"trainer: ([\d,]+) params")


def device_at_hand() -> tuple[str, str, float | None]:
    """("cuda" or "cpu", a name for the device, its memory in GiB or None)."""
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return "cuda", torch.cuda.get_device_name(0), props.total_memory / 2**30
    return "cpu", "cpu", None


def pick_layout(shape: dict, dtype: str, mem_gib: float) -> dict:
    """The planner's recommendation for one device, plainest first: activation
    checkpointing only if the run does not fit without it."""
    for checkpointing in (False, True):
        model = ModelShape(
            layers=shape["n_layer"],
            hidden=shape["n_embd"],
            heads=shape["n_head"],
            vocab=VOCAB,
            seq=shape["block_size"],
            micro_batch=shape["batch_size"],
            dtype=dtype,
            activation_checkpointing=checkpointing,
            tied_embeddings=True,
        )
        result = plan(model, ClusterShape(gpus=1, gpus_per_node=1, gpu_mem_gb=mem_gib))
        if result.recommended is not None and result.recommended.fits:
            layout = result.recommended
            return {
                "activation_checkpointing": checkpointing,
                "dp": layout.dp,
                "tp": layout.tp,
                "pp": layout.pp,
                "zero": layout.zero,
                "planned_bytes": layout.per_gpu_bytes,
                "reasons": list(result.reasons),
            }
    raise SystemExit(f"the planner finds no 1-device layout for {shape} in {mem_gib:.0f} GiB")


def run_trainer(shape: dict, dtype: str, layout: dict, steps: int, device: str, work: Path):
    env, metrics = trainer_env(work, dtype, LOCKSTEP_DEVICE=device)
    dataset = work / "bytes.bin"
    if not dataset.exists():
        # Random bytes: the throughput of a byte-level model does not depend on the text.
        dataset.write_bytes(random.Random(0).randbytes(DATASET_BYTES))
    argv = [sys.executable, "-m", "trainer", "--steps", str(steps), "--log-every", "10"]
    argv += ["--dataset", str(dataset)]
    argv += ["--checkpoint-every", str(steps + 1), "--precision", dtype]
    for flag in ("n_layer", "n_head", "n_embd", "block_size", "batch_size"):
        argv += ["--" + flag.replace("_", "-"), str(shape[flag])]
    if layout["activation_checkpointing"]:
        argv.append("--activation-checkpointing")
    t0 = time.monotonic()
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{dtype} run failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    # The trainer's final save of a 1.2 B model is about 14 GB: not kept for the next run.
    shutil.rmtree(work / f"ckpt-{dtype}", ignore_errors=True)
    found = PARAMS_LINE.search(done.stdout)
    if found is None:
        raise SystemExit(f"no parameter count in the trainer's output:\n{done.stdout[-2000:]}")
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return {
        "argv": argv[1:],
        "wall_s": round(time.monotonic() - t0, 1),
        "params": int(found.group(1).replace(",", "")),
        "steps": [r for r in records if r["kind"] == "step"],
        "device": next((r.get("device") for r in records if r["kind"] == "start"), None),
    }


def measure(shape_name: str, dtypes: list[str], steps: int, warmup: int) -> dict:
    device, name, mem_gib = device_at_hand()
    shape = SHAPES[shape_name]
    results = []
    with tempfile.TemporaryDirectory(prefix="lockstep-mfu-") as tmp:
        for dtype in dtypes:
            layout = pick_layout(shape, dtype, mem_gib or 64.0)
            run = run_trainer(shape, dtype, layout, steps, device, Path(tmp))
            used = [s for s in run["steps"] if s["step"] > warmup]
            if not used:
                raise SystemExit(f"no steps after the {warmup} warm-up steps")
            tokens_per_s = statistics.median(s["tokens_per_s"] for s in used)
            # N: every parameter but the position embeddings (a lookup, no matmul).
            matmul = run["params"] - shape["block_size"] * shape["n_embd"]
            per_token = training_flops_per_token(
                params=matmul,
                n_layer=shape["n_layer"],
                n_embd=shape["n_embd"],
                seq=shape["block_size"],
            )
            peak = peak_flops(name, dtype)
            results.append(
                {
                    "dtype": dtype,
                    "layout": layout,
                    "params": run["params"],
                    "matmul_params": matmul,
                    "trainer_device": run["device"],
                    "steps_used": len(used),
                    "tokens_per_s": round(tokens_per_s, 1),
                    "step_time_s": round(statistics.median(s["step_time_s"] for s in used), 5),
                    "flops_per_token": per_token,
                    "achieved_tflops": round(tokens_per_s * per_token / 1e12, 4),
                    "peak_tflops": None if peak is None else peak / 1e12,
                    "mfu": None if peak is None else round(mfu(tokens_per_s, per_token, peak), 4),
                    "wall_s": run["wall_s"],
                    "argv": run["argv"],
                }
            )
    return {
        "benchmark": "throughput and MFU of the reference trainer on one device (issue 5)",
        "device": name,
        "device_mem_gib": None if mem_gib is None else round(mem_gib, 1),
        "shape": {"name": shape_name, **shape, "vocab": VOCAB},
        "warmup_steps_excluded": warmup,
        "mfu_definition": "PaLM: (6N + 12 L C T) x tokens/s over the dense data-sheet peak",
        "results": results,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None)
    parser.add_argument("--dtypes", default=None, help="comma-separated: bf16,fp32")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    device, name, _ = device_at_hand()
    shape = args.shape or ("1b" if device == "cuda" else "tiny")
    dtypes = (args.dtypes or ("bf16,fp32" if device == "cuda" else "fp32")).split(",")
    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    result = measure(shape, dtypes, args.steps, args.warmup)
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    out = args.out or ROOT / "bench" / "results" / f"mfu-{slug}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    for r in result["results"]:
        shown = "n/a (peak unknown)" if r["mfu"] is None else f"{r['mfu']:.1%}"
        print(
            f"{name} {r['dtype']}: {r['tokens_per_s']:,.0f} tokens/s, "
            f"{r['achieved_tflops']:.3f} TFLOP/s, MFU {shown}, layout "
            f"dp={r['layout']['dp']} tp={r['layout']['tp']} pp={r['layout']['pp']} "
            f"ZeRO-{r['layout']['zero']}"
            + (", activation checkpointing" if r["layout"]["activation_checkpointing"] else "")
        )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
