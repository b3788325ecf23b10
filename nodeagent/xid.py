"""Xid events: the errors the NVIDIA driver reports for a GPU, read through NVML's event API.

Some Xids are the GPU's own failure (it fell off the bus, an uncorrectable ECC error, an
NVLink error): the node should take no further job until a full health check passes, and the
job that was on it fails through no fault of its own. Others are usually the job's (an MMU
fault from a bad kernel, an illegal address): shown, not held against the node. The agent
polls the event set at every heartbeat without waiting (`XidWatch.poll`); node faults become a
failed health check (`fault_report`), which the portal turns into a cordon with the Xid as its
reason (jobs/actions/node_health.py). Without NVML (CPU nodes, no driver) there is no watch
and nothing is reported.
"""

from __future__ import annotations

import logging
import time
from typing import Any

# Xids that mean the node's hardware (NVIDIA's Xid catalogue, "XID Errors" in its GPU
# deployment and management documentation): after one the GPU needs a reset or a technician.
NODE_FAULT_XIDS = {
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row-remapping event",
    64: "ECC page retirement or row-remapping failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
    140: "unrecovered ECC error",
}
# Usually the running program's fault, not the node's: reported with the GPU's telemetry only.
JOB_XIDS = {
    13: "graphics engine exception",
    31: "GPU memory page fault",
    43: "GPU stopped processing",
    45: "preemptive cleanup",
}

Log = logging.Logger | logging.LoggerAdapter  # type: ignore[type-arg]


def describe(xid: int) -> str:
    return NODE_FAULT_XIDS.get(xid) or JOB_XIDS.get(xid) or "see NVIDIA's Xid catalogue"


def fault_report(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The failed health check that the node-fault Xids among `events` (each {"gpu", "xid",
    "at"}) amount to, or None if there are none."""
    faults = [e for e in events if e["xid"] in NODE_FAULT_XIDS]
    if not faults:
        return None
    checks = [
        {
            "name": f"xid gpu {e['gpu']}",
            "ok": False,
            "detail": f"GPU {e['gpu']}: Xid {e['xid']} ({describe(e['xid'])})",
        }
        for e in faults
    ]
    return {
        "kind": "quick",
        "ok": False,
        "checks": checks,
        "reason": "; ".join(c["detail"] for c in checks),
    }


class XidWatch:
    """NVML's critical-Xid events of the node's GPUs, read without waiting."""

    def __init__(self, nvml: Any, gpus: int, log: Log):
        self._nvml, self._log = nvml, log
        self._set: Any = None
        self.watched: list[int] = []
        try:
            self._set = nvml.nvmlEventSetCreate()
        except nvml.NVMLError as exc:
            log.info("no Xid events (%s)", exc)
            return
        for index in range(gpus):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, self._set)
                self.watched.append(index)
            except nvml.NVMLError as exc:  # NotSupported on some GPUs and in some containers
                log.info("GPU %d: no Xid events (%s)", index, exc)

    def poll(self, limit: int = 64) -> list[dict[str, Any]]:
        """The events queued since the last poll (at most `limit`; the rest wait)."""
        events: list[dict[str, Any]] = []
        if self._set is None or not self.watched:
            return events
        nvml = self._nvml
        while len(events) < limit:
            try:
                data = nvml.nvmlEventSetWait_v2(self._set, 0)
            except nvml.NVMLError as exc:
                if getattr(exc, "value", None) != nvml.NVML_ERROR_TIMEOUT:
                    self._log.warning("reading Xid events: %s", exc)
                return events
            try:
                gpu = int(nvml.nvmlDeviceGetIndex(data.device))
            except nvml.NVMLError:
                gpu = -1
            events.append({"gpu": gpu, "xid": int(data.eventData), "at": time.time()})
            self._log.warning(
                "GPU %d: Xid %d (%s)", gpu, int(data.eventData), describe(int(data.eventData))
            )
        return events
