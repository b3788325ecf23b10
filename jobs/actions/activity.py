"""Progress the platform sees without the script's help: a rank's output, CPU use, GPU use and
whether its stack moves.

A script that reports steps (the reference trainer, or any script through trainer.api) is
judged by its steps. One that reports none (a plain torchrun script, a Lightning or Hugging Face
run) used to be declared hung STARTUP_PROGRESS_TIMEOUT_S after start-up, however busy it was.
Until an attempt's first step, every heartbeat therefore notes whether any of its ranks on the
node printed something, used at least ACTIVITY_MIN_CPU_S of CPU since the rank's last counted
activity, had its GPU busy (NVML utilisation of at least GPU_BUSY_PERCENT, on GPU nodes), or had
a stack read from outside that differed from the previous reading (`stack_changed`, sampled by
the agent every 30 s while no step is reported: nodeagent/stack_sampler.py);
`Attempt.last_activity_at` is when that last happened, and the hang detector
(jobs/scheduling/detect.py) counts silence from it.

What this cannot tell: a rank spinning at full CPU inside a collective that will never finish
(NCCL busy-polls) looks busy by its CPU, though its stack stands still. Discounting CPU use when
the stack sits unchanged in a collective is the rule that would catch it; it needs NCCL's
spinning to be built against and is not built yet. Such a hang ends when NCCL's watchdog times
the collective out and the ranks exit, or is found once the script reports steps.
"""

from __future__ import annotations

from datetime import datetime

from jobs.conf import lockstep_setting
from jobs.models import Allocation, Attempt, Node

GPU_BUSY_PERCENT = 5.0  # NVML's utilisation: the share of time a kernel ran on the GPU


def busy_gpus(telemetry: list) -> set[int]:
    """Indices of the node's GPUs that ran kernels in the last sample (CUDA readings only: a
    CPU node's "util" is its load average, nobody's in particular)."""
    busy = set()
    for reading in telemetry or []:
        if not isinstance(reading, dict) or reading.get("kind") != "cuda":
            continue
        util, index = reading.get("util"), reading.get("index")
        if isinstance(util, int | float) and util >= GPU_BUSY_PERCENT and isinstance(index, int):
            busy.add(index)
    return busy


def note_activity(
    attempt: Attempt, node: Node, ranks: list[dict], *, printed: set[int], now: datetime
) -> bool:
    """Record activity of the attempt's ranks on `node` from one heartbeat: `ranks` as the
    agent reports them (`cpu_s` for live ones), `printed` the ranks whose output it carried.
    Returns whether there was any. Counts only before the first step (steps judge after)."""
    if attempt.first_step_at is not None:
        return False
    readings = {}
    for entry in ranks:
        cpu = entry.get("cpu_s")
        if entry.get("state") == "running" and isinstance(cpu, int | float) and cpu >= 0:
            readings[int(entry["rank"])] = float(cpu)
    moved = any(e.get("stack_changed") and e.get("state") == "running" for e in ranks)
    active = (
        bool(printed)
        or moved
        or (
            bool(busy := busy_gpus(node.telemetry))
            and attempt.allocations.filter(node=node, gpu__index__in=busy).exists()
        )
    )
    threshold = lockstep_setting("ACTIVITY_MIN_CPU_S")
    changed = []
    for allocation in attempt.allocations.filter(node=node, rank__in=readings):
        cpu = readings[allocation.rank]
        if allocation.cpu_s is None or cpu < allocation.cpu_s:  # first reading, or a new process
            allocation.cpu_s = cpu
            changed.append(allocation)
        elif cpu - allocation.cpu_s >= threshold:
            allocation.cpu_s = cpu
            changed.append(allocation)
            active = True
    if changed:
        Allocation.objects.bulk_update(changed, ["cpu_s"])
    if active:
        Attempt.objects.filter(pk=attempt.pk).update(last_activity_at=now)
        attempt.last_activity_at = now
    return active
