#!/bin/sh
# Issue 5's GPU checks in one device run (docs/training-benchmarks.md section 3,
# docs/planner.md): throughput and MFU of the reference model with the planner's layout (bf16,
# fp32 baseline), and the memory planner against the CUDA allocator. Needs only torch and numpy
# (no Django): the device machine's own Python. About 5 minutes on one H200.
#
#   sh bench/gpu_issue5.sh            # results into $OUT (the device tool's), else bench/results
set -eu
out=${OUT:-bench/results}
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
"$py" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
"$py" bench/mfu.py --out "$out/mfu-gpu.json"
"$py" -m trainer.planner_check --device cuda --json > "$out/planner_check-gpu.json" || true
"$py" -m trainer.planner_check --device cuda
