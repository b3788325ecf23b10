"""The body of one heartbeat (docs/agent-protocol.md, Heartbeat): every local attempt's report,
the node's telemetry and health, and whether the agent is leaving; with what to acknowledge
once the portal has accepted it (nothing is dropped before)."""

from __future__ import annotations

from typing import Any

from nodeagent.attempt_report import Log, Tracked, attempt_report
from nodeagent.health_check import HealthChecker
from nodeagent.telemetry import Telemetry
from nodeagent.xid import fault_report


def tracked_for(tracked: dict[int, Tracked], attempt_id: int) -> Tracked:
    """What the agent remembers of an attempt the supervisor lists. An attempt whose launch
    broke off before its tails were set up has none: it is reported with its ranks' states
    only, rather than every heartbeat failing on it (the node would go silent, and the
    portal's fencing, which rides on heartbeat responses, would never reach its workers)."""
    return tracked.setdefault(attempt_id, Tracked())


def build_heartbeat(
    supervisor: Any,
    tracked: dict[int, Tracked],
    *,
    boot_id: str,
    telemetry: Telemetry,
    health: HealthChecker,
    leaving: bool,
    log: Log,
) -> tuple[dict[str, Any], list[tuple[Any, Any]], list[int]]:
    """The heartbeat body, the (tail, offset) acks to apply if it is accepted, and the
    attempts whose exit and final data it carries in full."""
    attempts = []
    acks: list[tuple[Any, Any]] = []
    exits = []
    for attempt_id in supervisor.attempt_ids():
        try:
            report, attempt_acks, finished = attempt_report(
                supervisor, attempt_id, tracked_for(tracked, attempt_id), log
            )
        except Exception:
            # One attempt whose files cannot be read (a disk error under its tails) must not
            # silence the node: the portal would declare it lost, and its fencing, which
            # rides on heartbeat responses, would reach none of its workers. Its ranks'
            # states still go; its data waits, unacknowledged, for a beat that can read it.
            log.exception("attempt %s: its report failed; sending its ranks only", attempt_id)
            report, attempt_acks, finished = _ranks_only(supervisor, attempt_id, log), [], False
            if report is None:
                continue
        attempts.append(report)
        acks += attempt_acks
        if finished:
            exits.append(attempt_id)
    body: dict[str, Any] = {"boot_id": boot_id, "telemetry": telemetry.read(), "attempts": attempts}
    if leaving:
        # The exits this beat carries are the ranks' answer to the leave's checkpoint-and-stop
        # (a trainer exits 0 after its save): the portal must apply the leave before it reads
        # them, even if the leaving call never reached it, or it ends the attempt succeeded.
        body["leaving"] = True
    if health.pending is None and telemetry.faults:
        # A GPU's own Xid (fell off the bus, uncorrectable ECC): a failed check, so the
        # portal cordons the node with the Xid as the reason until a full check passes.
        health.pending = fault_report(telemetry.faults)
        telemetry.faults = []
    if health.pending is not None:
        body["health"] = health.pending
        acks.append((health, health.pending))  # held until the portal has it
    return body, acks, exits


def _ranks_only(supervisor: Any, attempt_id: int, log: Log) -> dict[str, Any] | None:
    try:
        return {"attempt_id": attempt_id, "ranks": supervisor.status(attempt_id), "records": []}
    except Exception:
        log.exception("attempt %s: its ranks cannot be read either; left out", attempt_id)
        return None
