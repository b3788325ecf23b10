"""Node health checks: a bad node is found by the agent before it fails jobs, not after three.

Two depths:
- quick (milliseconds), before every attempt's ranks start on the node: the checkpoint and work
  directories are writable with at least MIN_FREE_BYTES free, and on GPU nodes each GPU the
  attempt got is visible to NVML, has no volatile uncorrected ECC errors and no retired pages
  pending, is below MAX_TEMP_C, and runs no process of anyone else; and no earlier attempt's
  ranks on them were killed without the kill being seen to work (nodeagent/kill_confirm.py);
- full: the quick checks for every GPU of the node, plus a small collective among as many
  processes as the node has GPUs (`nodeagent.health_probe`: gloo on a CPU node, NCCL on a GPU
  node, over the node's own network settings, so a wrong NCCL/GLOO interface shows up here),
  which also times a fixed matmul (`compute_ms`, compared with the fleet by the portal). It
  runs when the agent starts, every `--health-check-s` while the node is idle, and when the
  portal asks (a node held out of scheduling until a check passes).

A CPU node reports what it has (disks, the collective, its matmul time) and nothing invented:
no GPU check is listed where there is no GPU. The agent's loop never waits on a full check: it
runs in a thread and its report rides the next heartbeats until the portal has it.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

MIN_FREE_BYTES = 1 << 30
MAX_TEMP_C = 90
PROBE_TIMEOUT_S = 90.0


def _check(name: str, ok: bool, detail: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "ok": ok, "detail": detail, **extra}


def disk_checks(paths: Iterable[Path], min_free_bytes: int = MIN_FREE_BYTES) -> list[dict]:
    """Each directory exists (made if missing), takes a file, and has min_free_bytes free."""
    out = []
    for path in paths:
        name = f"disk {path}"
        try:
            path.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=path, prefix=".lockstep-health-"):
                pass
            st = os.statvfs(path)
        except OSError as exc:
            out.append(_check(name, False, f"not writable: {exc}"))
            continue
        free = st.f_bavail * st.f_frsize
        gib = free / (1 << 30)
        if free < min_free_bytes:
            need = min_free_bytes / (1 << 30)
            out.append(_check(name, False, f"{gib:.1f} GiB free, under {need:.1f} GiB"))
        else:
            out.append(_check(name, True, f"{gib:.1f} GiB free"))
    return out


def gpu_checks(indices: Iterable[int], own_pids: set[int], nvml: Any = None) -> list[dict]:
    """NVML's view of the given GPUs. `own_pids`: processes of this agent's attempts, which
    may use their GPUs; anyone else's process on a GPU makes it not free."""
    try:
        if nvml is None:
            import pynvml as nvml

            nvml.nvmlInit()
        count = nvml.nvmlDeviceGetCount()
    except Exception as exc:  # ImportError, or NVMLError with no driver
        return [_check("nvml", False, f"NVML unavailable: {exc}")]
    out = []
    for index in indices:
        name = f"gpu {index}"
        if index >= count:
            out.append(_check(name, False, f"not visible (NVML sees {count} GPU(s))"))
            continue
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
        except Exception as exc:  # a GPU fallen off the bus
            out.append(_check(name, False, f"NVML cannot reach it: {exc}"))
            continue
        problems = []
        readings = _readings(nvml, handle)
        if readings.get("ecc_uncorrected", 0):
            problems.append(f"{readings['ecc_uncorrected']} uncorrected ECC error(s)")
        if readings.get("retired_pending"):
            problems.append("retired pages pending a reset")
        if readings.get("temp_c", 0) >= MAX_TEMP_C:
            problems.append(f"{readings['temp_c']} °C")
        foreign = sorted(set(readings.get("pids", ())) - own_pids)
        if foreign:
            problems.append(f"in use by pid(s) {', '.join(map(str, foreign[:5]))}")
        detail = "; ".join(problems) or "visible, free, no ECC errors"
        out.append(_check(name, not problems, detail))
    return out


def _readings(nvml: Any, handle: Any) -> dict[str, Any]:
    queries = {
        "ecc_uncorrected": lambda: nvml.nvmlDeviceGetTotalEccErrors(
            handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
        ),
        "retired_pending": lambda: bool(nvml.nvmlDeviceGetRetiredPagesPendingStatus(handle)),
        "temp_c": lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU),
        "pids": lambda: [p.pid for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)],
    }
    found = {}
    for name, query in queries.items():
        try:
            found[name] = query()
        except Exception:  # NotSupported on this GPU: not checked, never invented
            continue
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def collective_check(
    ranks: int, gpu_kind: str, env: Mapping[str, str], timeout_s: float = PROBE_TIMEOUT_S
) -> dict:
    """`ranks` probe processes all-reduce over the node's own network settings (`env`: the
    agent's, with the node's env file) and time a matmul. A process that fails, hangs past
    timeout_s or sums wrong fails the check, with its last line as the detail."""
    port = _free_port()
    procs = []
    for rank in range(ranks):
        rank_env = {
            **env,
            "RANK": str(rank),
            "WORLD_SIZE": str(ranks),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "LOCKSTEP_PROBE_DEVICE": gpu_kind,
            "OMP_NUM_THREADS": "1",
        }
        if gpu_kind == "cuda":
            rank_env["CUDA_VISIBLE_DEVICES"] = str(rank)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "nodeagent.health_probe"],
                env=rank_env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
    deadline = time.monotonic() + timeout_s
    outputs, failed = [], None
    for rank, proc in enumerate(procs):
        try:
            text, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            for other in procs:
                other.wait()  # reaped: no zombies left by a hung check
            return _check(
                "collective", False, f"{ranks} rank(s) did not finish in {timeout_s:.0f} s"
            )
        outputs.append(text)
        if proc.returncode != 0 and failed is None:
            lines = [line for line in text.strip().splitlines() if line.strip()]
            failed = f"rank {rank} exited {proc.returncode}: {lines[-1][:300] if lines else ''}"
    if failed:
        return _check("collective", False, failed)
    try:
        result = json.loads(outputs[0].strip().splitlines()[-1])
    except (ValueError, IndexError):
        return _check("collective", False, f"no result from rank 0: {outputs[0][-300:]!r}")
    return _check(
        "collective",
        True,
        f"all-reduce over {ranks} rank(s) ({result['backend']}), "
        f"matmul {result['compute_ms']:.1f} ms on {result.get('device', '?')}",
        compute_ms=result["compute_ms"],
        device=str(result.get("device", ""))[:200],
    )


def report(checks: list[dict], kind: str) -> dict[str, Any]:
    failed = [c for c in checks if not c["ok"]]
    compute = next((c["compute_ms"] for c in checks if "compute_ms" in c), None)
    device = next((c["device"] for c in checks if c.get("device")), "")
    return {
        "kind": kind,
        "ok": not failed,
        "at": time.time(),
        "checks": checks,
        "reason": "; ".join(f"{c['name']}: {c['detail']}" for c in failed),
        **({"compute_ms": compute} if compute is not None else {}),
        **({"device": device} if device else {}),
    }


def engine_check(engine: Any) -> dict[str, Any]:
    """The container engine answers (`info`, up to 30 s). A wedged engine refuses every launch
    (its `image inspect` times out) while disks, GPUs and the collective are fine; without
    this check the node's cordon for it would lift at the next full check, and each cycle
    would cost another job a minute."""
    started = time.monotonic()
    ok = engine.works()
    took = time.monotonic() - started
    detail = (
        f"{engine.name} answered in {took:.1f} s"
        if ok
        else (f"{engine.name} did not answer `info` ({took:.0f} s)")
    )
    return {"name": "engine", "ok": ok, "detail": detail}


class HealthChecker:
    """The node's checks, as the agent runs them: quick ones inline, the full one in a thread,
    its report held until the portal acknowledges it."""

    def __init__(
        self,
        *,
        gpus: int,
        gpu_kind: str,
        dirs: list[Path],
        env: Mapping[str, str],
        every_s: float,
        clock: Any = time.monotonic,
        log: Any = None,
        engine: Any = None,
    ) -> None:
        self.gpus, self.gpu_kind, self.dirs, self.env = gpus, gpu_kind, dirs, dict(env)
        # The container engine, under the container runtime: the full check asks it too.
        self.engine = engine
        self.every_s = every_s  # 0: only when the portal asks
        self._clock = clock
        self._log = log or logging.getLogger("nodeagent.health_check")
        self._thread: threading.Thread | None = None
        self._last_started: float | None = None
        self.pending: dict[str, Any] | None = None  # a report not yet acknowledged
        self.last: dict[str, Any] | None = None

    def quick(
        self,
        indices: Iterable[int],
        own_pids: set[int],
        extra_dirs: Iterable[Path] = (),
        failing: Iterable[dict[str, Any]] = (),
    ) -> dict[str, Any]:
        """The quick checks before a launch onto GPUs `indices`, with `failing`: checks the
        agent has failed already (a kill on these GPUs it cannot confirm)."""
        # The full check looks at the same directories from now on (a checkpoint root seen in
        # a launch): a node cordoned for one is released only once it is fine again.
        for directory in extra_dirs:
            if directory not in self.dirs:
                self.dirs.append(directory)
        checks = disk_checks(self.dirs)
        if self.gpu_kind == "cuda":
            checks += gpu_checks(indices, own_pids)
        return report([*checks, *failing], "quick")

    def _full(self, own_pids: set[int]) -> None:
        checks = disk_checks(self.dirs)
        if self.gpu_kind == "cuda":
            checks += gpu_checks(range(self.gpus), own_pids)
        checks.append(collective_check(max(1, self.gpus), self.gpu_kind, self.env))
        if self.engine is not None:
            checks.append(engine_check(self.engine))
        self.last = self.pending = report(checks, "full")
        if self.last["ok"]:
            detail = "; ".join(c["detail"] for c in checks if c["name"] == "collective")
            self._log.info("health check passed (%s)", detail)
        else:
            self._log.error("health check failed: %s", self.last["reason"])

    def due(self, idle: bool, asked: bool) -> bool:
        """Only on an idle node: the collective and the matmul would compete with a job's
        ranks (and be judged slow for it). Asked by the portal (the node is held), as soon as
        its last jobs have ended; else at the agent's start and every `every_s`."""
        if self._thread is not None and self._thread.is_alive():
            return False
        if self.pending is not None:
            # The last report has not reached the portal yet: a full one would overwrite it
            # (a quick check's failure, a launch the node refused, a GPU's Xid).
            return False
        if asked:
            return idle
        if self._last_started is None:
            return self.every_s > 0  # at the agent's start
        return idle and self.every_s > 0 and self._clock() - self._last_started >= self.every_s

    def start_full(self, own_pids: set[int]) -> None:
        """Run a full check in the background (the loop never waits on it)."""
        self._last_started = self._clock()
        self._thread = threading.Thread(
            target=self._full, args=(set(own_pids),), name="health-check", daemon=True
        )
        self._thread.start()

    def wait(self, timeout_s: float) -> bool:
        if self._thread is not None:
            self._thread.join(timeout_s)
        return self._thread is None or not self._thread.is_alive()

    def ack(self, sent: dict[str, Any] | None) -> None:
        if sent is not None and self.pending is sent:
            self.pending = None
