"""Per-slot telemetry for heartbeats: NVML readings on GPU nodes, an honest CPU stand-in else.

`util` is a percentage (0-100, NVML's unit); memory is in bytes. On GPU nodes each reading also
carries, where the GPU reports them, `temp_c`, `power_w`, `ecc_uncorrected` (volatile
uncorrected ECC errors since the driver loaded) and `retired_pages` (pages retired for double-bit
errors): what a node health check reads before a bad GPU fails jobs; and `xid`, the Xid
events the driver reported for the GPU since the last reading (nodeagent/xid.py), whose node
faults wait in `faults` for the agent to report as a failed health check. NVML comes from
NVIDIA's `nvidia-ml-py` (a dependency): on a node without the driver it says so, once, in the
log, and nothing is invented.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from nodeagent.xid import NODE_FAULT_XIDS, XidWatch

logger = logging.getLogger("nodeagent.telemetry")


def detect_gpu_kind(requested: str = "auto") -> str:
    """Return "cuda" or "cpu". `auto` looks for the NVIDIA device node rather than importing
    torch, which would cost the agent seconds and hundreds of MB just to answer a yes/no."""
    if requested in ("cpu", "cuda"):
        return requested
    if requested != "auto":
        raise ValueError(f"gpu kind must be auto, cpu or cuda, not {requested!r}")
    return "cuda" if os.path.exists("/dev/nvidia0") else "cpu"


class Telemetry:
    """Reads one entry per slot (GPU index 0..gpus-1)."""

    def __init__(
        self,
        gpus: int,
        gpu_kind: str,
        log: logging.Logger | logging.LoggerAdapter | None = None,  # type: ignore[type-arg]
    ) -> None:
        self._log = log or logger
        self.gpus = gpus
        self.gpu_kind = gpu_kind
        self._nvml: Any = None
        self.xid: XidWatch | None = None
        self.faults: list[dict[str, Any]] = []  # node-fault Xids not yet reported
        if gpu_kind == "cuda":
            try:
                import pynvml  # optional: only GPU nodes need it

                pynvml.nvmlInit()
                self._nvml = pynvml
            except Exception as exc:  # ImportError, or NVMLError with no driver
                self._log.info("no NVML telemetry (%s); reporting zeros for GPU slots", exc)
            else:
                self.xid = XidWatch(pynvml, gpus, self._log)

    def read(self) -> list[dict[str, Any]]:
        if self._nvml is not None:
            try:
                return self._read_nvml()
            except Exception as exc:
                self._log.warning("NVML read failed: %s", exc)
        if self.gpu_kind == "cuda":
            return [
                {"index": i, "kind": "cuda", "util": 0.0, "mem_used": 0, "mem_total": 0}
                for i in range(self.gpus)
            ]
        return self._read_cpu()

    def _read_nvml(self) -> list[dict[str, Any]]:
        nvml = self._nvml
        events = self.xid.poll() if self.xid is not None else []
        self.faults += [e for e in events if e["xid"] in NODE_FAULT_XIDS]
        out = []
        for index in range(self.gpus):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            util = nvml.nvmlDeviceGetUtilizationRates(handle)
            mem = nvml.nvmlDeviceGetMemoryInfo(handle)
            reading = {
                "index": index,
                "kind": "cuda",
                "util": float(util.gpu),
                "mem_used": int(mem.used),
                "mem_total": int(mem.total),
            }
            reading.update(_health(nvml, handle))
            if xids := [e["xid"] for e in events if e["gpu"] == index]:
                reading["xid"] = xids
            out.append(reading)
        return out

    def _read_cpu(self) -> list[dict[str, Any]]:
        # Slots on a CPU node share the host, so each gets the host's load average as a share
        # of its cores: an approximation, labelled as such by kind "cpu". No memory figure is
        # reported because a slot has no memory of its own.
        try:
            load = os.getloadavg()[0] / (os.cpu_count() or 1)
        except OSError:
            load = 0.0
        util = round(min(1.0, max(0.0, load)) * 100.0, 1)
        return [
            {"index": i, "kind": "cpu", "util": util, "mem_used": 0, "mem_total": 0}
            for i in range(self.gpus)
        ]


def _health(nvml: Any, handle: Any) -> dict[str, Any]:
    """What this GPU reports of its health; a query it does not support is left out (consumer
    GPUs have no ECC, some report no power), never invented."""
    queries = {
        "temp_c": lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU),
        "power_w": lambda: round(nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0, 1),
        "ecc_uncorrected": lambda: nvml.nvmlDeviceGetTotalEccErrors(
            handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
        ),
        "retired_pages": lambda: len(
            nvml.nvmlDeviceGetRetiredPages(
                handle, nvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR
            )
        ),
    }
    found = {}
    for name, query in queries.items():
        try:
            found[name] = query()
        except Exception:  # NVMLError_NotSupported and kin
            continue
    return found
