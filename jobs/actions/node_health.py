"""A node's health checks (nodeagent/health_check.py) as the portal acts on them.

A failed check cordons the node with the failing checks as the reason, and marks the cordon as
the health checks' own (`held_for_health`); a later check that passes releases exactly such a
cordon, never an admin's or the strikes'. A node can also be held on purpose until a check
passes (a straggler moved off it: `do_hold_node`); while held, its agent is asked for a full
check every HEALTH_RECHECK_S (`wants_check`). A check also fails when its matmul is
HEALTH_SLOW_FACTOR times slower than the fleet's median for the same kind of node.
"""

from __future__ import annotations

import statistics
from datetime import datetime, timedelta

from django.db import transaction

from jobs.actions.attempts import do_end_attempt
from jobs.actions.base import record_event, wake
from jobs.actions.nodes import last_cordon
from jobs.conf import lockstep_setting
from jobs.event_kinds import EventKind
from jobs.models import Attempt, Node

MAX_CHECKS = 64  # a report is the agent's word: kept, but bounded


def held_for_health(node: Node) -> bool:
    """Whether the node's cordon is the health checks' own: the latest cordon event says so."""
    last = last_cordon(node)
    return last is not None and bool(last.data.get("held_for_health"))


def wants_check(node: Node, now: datetime) -> bool:
    """Ask the node's agent for a full check: it is held until one passes, and its last report
    is older than HEALTH_RECHECK_S."""
    recheck = timedelta(seconds=lockstep_setting("HEALTH_RECHECK_S"))
    return held_for_health(node) and (node.health_at is None or now - node.health_at >= recheck)


def _clean(report: dict) -> dict:
    checks = [
        {
            "name": str(c.get("name", ""))[:200],
            "ok": bool(c.get("ok")),
            "detail": str(c.get("detail", ""))[:500],
        }
        for c in (report.get("checks") or [])[:MAX_CHECKS]
        if isinstance(c, dict)
    ]
    compute = report.get("compute_ms")
    device = str(report.get("device", ""))[:200]
    return {
        "kind": "full" if report.get("kind") == "full" else "quick",
        "ok": bool(report.get("ok")) and all(c["ok"] for c in checks),
        "checks": checks,
        "reason": str(report.get("reason", ""))[:1000],
        **({"compute_ms": float(compute)} if isinstance(compute, int | float) else {}),
        **({"device": device} if device else {}),
    }


def _slower_than_fleet(node: Node, compute_ms: float, device: str) -> str:
    """A reason if this node's matmul is HEALTH_SLOW_FACTOR times the median of the other
    nodes with the same device (GPU or CPU model: a mixed fleet is compared like with like;
    at least two to compare with), else ''."""
    others = [
        n.health["compute_ms"]
        for n in Node.objects.filter(gpu_kind=node.gpu_kind).exclude(pk=node.pk)
        if isinstance(n.health, dict)
        and isinstance(n.health.get("compute_ms"), int | float)
        and n.health.get("device", "") == device
    ]
    if len(others) < 2:
        return ""
    median = statistics.median(others)
    factor = lockstep_setting("HEALTH_SLOW_FACTOR")
    if median > 0 and compute_ms > factor * median:
        return (
            f"matmul {compute_ms:.1f} ms, {compute_ms / median:.1f}x the fleet's median "
            f"{median:.1f} ms (over {factor:g}x)"
        )
    return ""


@transaction.atomic
def do_record_health(node: Node, report: dict, *, now: datetime) -> Node:
    """Keep the agent's report; cordon on a failure, release a health cordon on a pass."""
    node = Node.objects.select_for_update(no_key=True).get(pk=node.pk)
    health = _clean(report)
    if health["ok"] and "compute_ms" in health:
        slow = _slower_than_fleet(node, health["compute_ms"], health.get("device", ""))
        if slow:
            health["ok"] = False
            health["checks"].append({"name": "speed", "ok": False, "detail": slow})
            health["reason"] = f"speed: {slow}"
    node.health, node.health_at = health, now
    node.save(update_fields=["health", "health_at"])
    failing = health["reason"] or "a check failed"
    if not health["ok"]:
        record_event(
            EventKind.NODE_HEALTH_FAILED,
            f"node {node.name}: {health['kind']} health check failed: {failing}",
            node=node,
            data=health,
        )
        if node.state == Node.State.UP:
            _hold(node, f"health check failed: {failing}", data={"checks": health["checks"]})
    elif held_for_health(node):
        was = node.state_reason
        node.state, node.state_reason = Node.State.UP, ""
        node.save(update_fields=["state", "state_reason"])
        record_event(
            EventKind.NODE_HEALTH_PASSED,
            f"node {node.name}: health check passed; back in scheduling (it was held: {was})",
            node=node,
            data=health,
        )
        wake("node healthy")
    return node


def _hold(node: Node, reason: str, *, data: dict) -> None:
    node.state, node.state_reason = Node.State.CORDONED, reason[:500]
    node.save(update_fields=["state", "state_reason"])
    record_event(
        EventKind.NODE_CORDONED,
        f"node {node.name} cordoned until a health check passes: {reason}",
        node=node,
        data={**data, "automatic": True, "held_for_health": True},
    )
    wake("node held")


@transaction.atomic
def do_hold_node(
    node: Node, *, reason: str, now: datetime, data: dict | None = None, recheck_later=False
) -> bool:
    """Take an up node out of scheduling until its agent's next full check passes. Returns
    whether it was held (a node already cordoned, draining or down is left as it is).
    `recheck_later`: the first check is asked for HEALTH_RECHECK_S from now, not at once (a
    straggler's node sits out at least that long, so the job it slowed restarts elsewhere
    first); else at the next heartbeat."""
    node = Node.objects.select_for_update(no_key=True).get(pk=node.pk)
    if node.state != Node.State.UP:
        return False
    node.health_at = now if recheck_later else None
    node.save(update_fields=["health_at"])
    _hold(node, reason, data=data or {})
    return True


def requeue_off_unhealthy_node(attempt: Attempt, node: Node, message: str, *, now: datetime):
    """The node's agent refused to start the attempt's ranks: its quick health check failed
    (the report, which cordoned the node, came in the same heartbeat). The attempt ends
    without using a restart or striking any node, and the job is requeued to start elsewhere."""
    return do_end_attempt(
        attempt,
        state=Attempt.State.PREEMPTED,
        now=now,
        reason=f"{node.name} failed its health check before the start ({message})",
        data={"health": True},
    )
