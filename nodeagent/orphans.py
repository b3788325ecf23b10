"""Workers an earlier agent process left running (it crashed or was SIGKILLed): each attempt's
workers file lists its ranks' pids, and a new agent on the same work dir kills them before
anything else, since it cannot wait on or report them and the portal gave their GPUs away. (The
containers it left, found by the agent identity they are labelled with, are removed by
nodeagent/engine_calls.StaleSweep.)"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
from collections.abc import Iterable
from pathlib import Path

from nodeagent.workers import RankWorker

WORKERS_FILE = "workers.json"


def write_workers_file(attempt_dir: Path, workers: Iterable[RankWorker]) -> None:
    """List the started ranks of an attempt, with their start times, for a later agent."""
    entries = [
        {"rank": w.rank, "pid": w.pid, "start_time": _process_start_time(w.pid)}
        for w in workers
        if w.pid is not None
    ]
    (attempt_dir / WORKERS_FILE).write_text(
        json.dumps({"boot_id": _kernel_boot_id(), "workers": entries})
    )


def kill_orphans(work_dir: Path, log: logging.Logger | logging.LoggerAdapter) -> int:  # type: ignore[type-arg]
    """SIGKILL the process groups the workers files under `work_dir` name, if they are still
    the same processes, and remove the files. Returns how many were killed."""
    killed = 0
    boot_id = _kernel_boot_id()
    for path in sorted(work_dir.glob(f"attempt-*/{WORKERS_FILE}")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            path.unlink(missing_ok=True)
            continue
        if data.get("boot_id") == boot_id:
            for entry in data.get("workers", []):
                pid, start = entry.get("pid"), entry.get("start_time")
                # The start time tells a surviving worker from a new process given its pid;
                # a missing process may still have left children in its group, and Linux
                # keeps that group id from being reused while they live.
                now_start = _process_start_time(pid)
                if pid and (now_start is None or now_start == start):
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(pid, signal.SIGKILL)
                        killed += 1
                        log.warning("killed orphan worker pid %s from %s", pid, path.parent.name)
        path.unlink(missing_ok=True)
    return killed


def _process_start_time(pid: int | None) -> int | None:
    """Start time of a process in clock ticks since boot (Linux /proc), None if unknown."""
    if pid is None:
        return None
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name may contain spaces and parentheses; fields resume after the last ')'.
    fields = stat[stat.rfind(")") + 2 :].split()
    return int(fields[19]) if len(fields) > 19 else None


def _kernel_boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""
