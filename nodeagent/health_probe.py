"""One rank of a node health check's collective (nodeagent/health_check.py): join a process
group over the node's network settings, all-reduce ones (the sum must be the world size),
time a fixed matmul, and print one JSON line (rank 0). A wrong result exits 1 with the reason;
a broken network fails in init or the all-reduce, with torch's message as the last line."""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

MATMUL_N = 512
MATMUL_REPEATS = 5


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu"


def main() -> int:
    import torch
    import torch.distributed as dist

    cuda = os.environ.get("LOCKSTEP_PROBE_DEVICE") == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=60))
    try:
        ones = torch.ones(1024, device=device)
        dist.all_reduce(ones)
        world = dist.get_world_size()
        if not torch.all(ones == world):
            print(f"all-reduce summed {ones[0].item()} over {world} rank(s)", file=sys.stderr)
            return 1
        a = torch.randn(MATMUL_N, MATMUL_N, device=device)
        (a @ a).sum().item()  # warm up
        started = time.perf_counter()
        for _ in range(MATMUL_REPEATS):
            (a @ a).sum().item()  # .item() waits for the GPU
        compute_ms = (time.perf_counter() - started) * 1000 / MATMUL_REPEATS
        if dist.get_rank() == 0:
            # What the matmul ran on: the portal compares its time only with the same kind.
            device_name = torch.cuda.get_device_name(0) if cuda else _cpu_model()
            result = {"backend": backend, "world": world, "compute_ms": compute_ms}
            print(json.dumps({**result, "device": device_name}))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
