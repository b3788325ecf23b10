"""The body of one heartbeat (docs/agent-protocol.md, Heartbeat): every local attempt's report,
the node's telemetry and health, and whether the agent is leaving; with what to acknowledge
once the portal has accepted it (nothing is dropped before)."""

from __future__ import annotations

from typing import Any

from nodeagent.attempt_report import Log, Tracked, attempt_report
from nodeagent.health_check import HealthChecker
from nodeagent.health_check import report as health_report
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
        remembered = tracked_for(tracked, attempt_id)
        try:
            report, attempt_acks, finished = attempt_report(supervisor, attempt_id, remembered, log)
            remembered.report_failures = 0
        except Exception:
            # One attempt whose files cannot be read (a disk error under its tails) must not
            # silence the node: the portal would declare it lost, and its fencing, which
            # rides on heartbeat responses, would reach none of its workers. Its ranks'
            # states still go; its data waits, unacknowledged, for a beat that can read it.
            log.exception("attempt %s: its report failed; sending its ranks only", attempt_id)
            remembered.report_failures += 1
            report = _ranks_only(supervisor, attempt_id, remembered.report_failures, log)
            attempt_acks, finished = [], False
            if report is None:
                continue
        attempts.append(report)
        _cordon_for(report, remembered, health)
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


def _cordon_for(report: dict[str, Any], remembered: Tracked, health: HealthChecker) -> None:
    """An attempt the node refused or broke off (a full disk, an engine that did not answer
    its `image inspect`; `error` of kind "health"), at its launch or later as it polled: the
    node raises a failed check as well, so the portal cordons it as for a failed quick check
    and starts the job elsewhere with no restart used. Without it the scheduler would place
    the job, or the next one, on the same node again. Once per attempt; a failed quick check
    that refused the launch is already pending and is the report."""
    error = report.get("error") or {}
    if error.get("kind") != "health" or remembered.health_told:
        return
    remembered.health_told = True
    if health.pending is None:
        failed = {"name": "launch", "ok": False, "detail": error["message"]}
        health.pending = health_report([failed], "quick")


# Beats a failing report holds its ranks' exits back for (about a heartbeat a second).
HOLD_EXITS_BEATS = 30


def _ranks_only(supervisor: Any, attempt_id: int, failures: int, log: Log) -> dict[str, Any] | None:
    """The attempt's ranks, without its data. An exit goes once its data could be read, or
    after HOLD_EXITS_BEATS failures: the portal ends an attempt on its exits and ignores what
    comes after, so an exit sent ahead of the final checkpoint's record would resume the job
    from an older one (invariant 7); an attempt that never ends would be worse."""
    try:
        ranks = supervisor.status(attempt_id)
    except Exception:
        log.exception("attempt %s: its ranks cannot be read either; left out", attempt_id)
        return None
    if failures <= HOLD_EXITS_BEATS:
        ranks = [
            {**r, "state": "running", "exit_code": None} if r.get("state") == "exited" else r
            for r in ranks
        ]
    return {"attempt_id": attempt_id, "ranks": ranks, "records": []}
