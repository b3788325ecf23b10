"""Nodes: registration (an agent's restart included), a planned restart (the agent says it is
leaving), lost, cordon, drain and uncordon, and the release of an automatic (strike) cordon by
the operator tool that runs the node."""

from __future__ import annotations

import secrets
from datetime import datetime

from django.db import transaction

from jobs.actions.attempts import LEAVING_REASON, do_end_attempt
from jobs.actions.base import lock_job_for_stop, record_event, wake
from jobs.actions.preemption import stop_to_requeue
from jobs.event_kinds import EventKind
from jobs.models import (
    GPU,
    Attempt,
    Event,
    Node,
)
from jobs.queries import stopped_state
from teams.models import token_digest


@transaction.atomic
def do_register_node(
    *,
    name: str,
    gpus: int,
    address: str,
    hostname: str = "",
    rack: str = "default",
    gpu_kind: str = "cpu",
    boot_id: str = "",
    killed_orphans: int = 0,
    runtime: str = "process",
    engine: str = "",
    now: datetime,
) -> tuple[Node, str]:
    """Create or re-bind a node; returns it with a fresh node token (shown once)."""
    raw = "node_" + secrets.token_urlsafe(32)
    node = Node.objects.select_for_update(no_key=True).filter(name=name).first()
    if node is None:
        node = Node.objects.create(
            name=name,
            address=address,
            hostname=hostname,
            rack=rack,
            gpu_kind=gpu_kind,
            runtime=runtime,
            engine=engine,
            token_digest=token_digest(raw),
            boot_id=boot_id,
            registered_at=now,
            last_heartbeat_at=now,
        )
        record_event(
            EventKind.NODE_REGISTERED,
            f"node {name} registered with {gpus} {gpu_kind} GPUs",
            node=node,
        )
    else:
        # A new boot means the agent restarted: any workers it had are gone (it kills them on
        # exit, and fencing kills leftovers), so attempts placed here cannot go on. After a
        # planned restart (its previous process said it was leaving) they were checkpoint-
        # stopped, and any still open end as stopped, requeued without a strike; otherwise the
        # agent crashed or was killed, which the node may have caused: lost, and a strike.
        new_boot = node.boot_id != boot_id
        planned = node.leaving_at is not None
        if new_boot:
            for attempt in (
                Attempt.objects.filter(ended_at__isnull=True, allocations__node=node)
                .distinct()
                .select_related("job")
            ):
                if planned:
                    do_end_attempt(
                        attempt,
                        state=stopped_state(attempt.job),
                        now=now,
                        reason=f"{LEAVING_REASON} {name}'s agent: it is back, and its workers "
                        "were stopped when it left",
                    )
                    continue
                do_end_attempt(
                    attempt,
                    state=Attempt.State.LOST,
                    now=now,
                    failed_at=node.last_heartbeat_at,
                    blame_node=node,
                    reason=f"agent on {name} restarted; it killed {killed_orphans} worker(s) "
                    "left by its previous process (workers are not re-adopted)",
                )
        # The leaving process itself registering again (it lost its token) is still leaving.
        was_down = node.state == Node.State.DOWN and (new_boot or not planned)
        node.address, node.hostname, node.rack, node.gpu_kind = address, hostname, rack, gpu_kind
        node.runtime, node.engine = runtime, engine
        node.token_digest, node.boot_id = token_digest(raw), boot_id
        node.registered_at = node.last_heartbeat_at = now
        held = back_from_down(node) if was_down else ""
        if new_boot:
            node.leaving_at = None
        node.save()
        record_event(
            EventKind.NODE_REREGISTERED,
            f"node {name} re-registered ({gpus} GPUs)"
            + (" after a planned restart" if new_boot and planned else "")
            + (f"; back, still {held}: {node.state_reason}" if held else "")
            + ("; back up" if was_down and not held else "")
            + (
                f"; its agent killed {killed_orphans} orphaned worker(s) on start"
                if killed_orphans
                else ""
            ),
            node=node,
            data={"killed_orphans": killed_orphans, "planned": new_boot and planned},
        )
    existing = set(node.gpus.values_list("index", flat=True))
    GPU.objects.bulk_create([GPU(node=node, index=i) for i in range(gpus) if i not in existing])
    # GPUs the node no longer reports are removed only when free.
    node.gpus.filter(index__gte=gpus).exclude(allocations__released_at__isnull=True).delete()
    wake("node registered")
    return node, raw


@transaction.atomic
def do_node_leaving(
    node: Node, *, reason: str, now: datetime, grace_s: float | None = None
) -> list[int]:
    """The node's agent is stopping on purpose (an upgrade, Ctrl-C: SIGTERM or SIGINT) and said
    so first: a planned restart, not a failure. The node takes no new work until an agent
    registers again (it is down meanwhile; a cordon or drain is held, and put back then), and every
    live attempt on it checkpoints and stops within STOP_GRACE_S (or the agent's `grace_s`,
    if shorter): the whole gang, its ranks on other nodes included. Each ends as stopped
    (`do_end_attempt`): the job is requeued from that checkpoint with no strike on any node
    and no restart used. Repeats (the agent retries until it hears back) change nothing more.
    Returns the ids of the attempts stopping."""
    node = Node.objects.select_for_update(no_key=True).get(pk=node.pk)
    if node.leaving_at is None:
        node.leaving_at = now
        if node.state != Node.State.DOWN:
            # Down at once, so its silence is not taken for a loss; a cordon or drain is
            # held and put back when an agent registers again.
            hold_cordon(node)
            node.state = Node.State.DOWN
            node.state_reason = f"agent restarting (planned: {reason})"
        node.save(
            update_fields=["leaving_at", "state", "state_reason", "held_state", "held_reason"]
        )
    stopping = _stop_attempts_on(
        node,
        why=f"{LEAVING_REASON} {node.name}'s agent ({reason})",
        now=now,
        kind=EventKind.NODE_LEAVING,
        data={"node": node.name},
        grace_s=grace_s,
    )
    record_event(
        EventKind.NODE_LEAVING,
        f"node {node.name}: its agent is stopping ({reason}), a planned restart; "
        f"{len(stopping)} attempt(s) checkpoint and stop, to be requeued without a strike",
        node=node,
        data={"attempts": stopping, "grace_s": grace_s},
    )
    wake("node leaving")
    return stopping


def _stop_attempts_on(
    node: Node, *, why: str, now: datetime, kind: str, data: dict, grace_s: float | None = None
) -> list[int]:
    """Checkpoint-and-stop every live attempt on the node (the whole gang, its ranks on other
    nodes included), each to be requeued; the ids of the attempts stopping, those already
    stopping included. Each is locked as every stop is (attempt, then job): read unlocked,
    an attempt another node's heartbeat had just ended was set stopping again over its end."""
    live = list(
        Attempt.objects.filter(ended_at__isnull=True, allocations__node=node)
        .distinct()
        .order_by("id")
        .values_list("id", "job_id")
    )
    stopping = []
    for attempt_id, job_id in live:
        job, attempt = lock_job_for_stop(job_id)
        if attempt is None or attempt.id != attempt_id:
            continue
        stopping.append(attempt.id)
        if attempt.state == Attempt.State.STOPPING or job.is_terminal:
            continue  # already stopping (preempted, cancelled, drained): that stop goes on
        stop_to_requeue(
            job,
            attempt,
            why=why,
            now=now,
            kind=kind,
            data={**data, "attempt": attempt.id},
            grace_s=grace_s,
        )
    return stopping


@transaction.atomic
def do_mark_node_lost(node: Node, *, now: datetime, reason: str) -> None:
    node = Node.objects.select_for_update(no_key=True).get(pk=node.pk)
    if node.state == Node.State.DOWN:
        return
    hold_cordon(node)
    node.state, node.state_reason = Node.State.DOWN, reason
    node.save(update_fields=["state", "state_reason", "held_state", "held_reason"])
    record_event(EventKind.NODE_DOWN, f"node {node.name} down: {reason}", node=node)
    # A node whose agent said it is leaving never gets here: the leave took it down at once.
    for attempt in Attempt.objects.filter(ended_at__isnull=True, allocations__node=node).distinct():
        do_end_attempt(
            attempt,
            state=Attempt.State.LOST,
            now=now,
            reason=f"node {node.name} lost ({reason})",
            failed_at=node.last_heartbeat_at,
            blame_node=node,
        )
    wake("node down")


def hold_cordon(node: Node) -> None:
    """Going down: keep the node's cordon or drain to put back when it is heard again."""
    if node.state in (Node.State.CORDONED, Node.State.DRAINING):
        node.held_state, node.held_reason = node.state, node.state_reason


def back_from_down(node: Node) -> str:
    """A down node heard again: up, or back under the cordon or drain it had (an admin's, the
    strikes', a health check's). Returns what it is held under, "" when it is up."""
    held = node.held_state
    node.state = held or Node.State.UP
    node.state_reason = node.held_reason if held else ""
    node.held_state = node.held_reason = ""
    return held


@transaction.atomic
def do_cordon_node(node: Node, *, actor, reason: str, drain: bool = False, now: datetime) -> Node:
    """No new work on the node; with `drain`, its attempts also checkpoint, stop and requeue."""
    node = Node.objects.select_for_update(no_key=True).get(pk=node.pk)
    wanted = Node.State.DRAINING if drain else Node.State.CORDONED
    if node.state == Node.State.DOWN:
        # Down stays down (its heartbeats decide that); the cordon applies when it is back.
        node.held_state, node.held_reason = wanted, reason
    else:
        node.state, node.state_reason = wanted, reason
    node.save(update_fields=["state", "state_reason", "held_state", "held_reason"])
    record_event(
        EventKind(f"node.{wanted}"),
        f"node {node.name} {wanted} by {actor}: {reason}"
        + (" (it is down: from when it is back)" if node.state == Node.State.DOWN else ""),
        node=node,
        actor=actor,
    )
    if drain:
        _stop_attempts_on(
            node,
            why=f"node {node.name} draining: {reason}",
            now=now,
            kind=EventKind.JOB_PREEMPTING,
            data={"node": node.name, "drain": True},
        )
    wake("node cordoned")
    return node


@transaction.atomic
def do_uncordon_node(node: Node, *, actor, reason: str = "") -> Node:
    node = Node.objects.select_for_update(no_key=True).get(pk=node.pk)
    if node.state == Node.State.DOWN:
        if not node.held_state:
            return node  # it comes back up with its next heartbeat
        # Down under a cordon: it comes back up, not cordoned.
        node.held_state = node.held_reason = ""
    else:
        node.state, node.state_reason = Node.State.UP, ""
    node.save(update_fields=["state", "state_reason", "held_state", "held_reason"])
    record_event(
        EventKind.NODE_UNCORDONED,
        f"node {node.name} uncordoned by {actor}" + (f": {reason}" if reason else ""),
        node=node,
        actor=actor,
    )
    wake("node uncordoned")
    return node


def last_cordon(node: Node) -> Event | None:
    """The event that put the node in its cordon, if it is cordoned: who did it, and why."""
    if node.state != Node.State.CORDONED:
        return None
    return (
        Event.objects.filter(node=node, kind__in=[EventKind.NODE_CORDONED, EventKind.NODE_DRAINING])
        .order_by("-id")
        .first()
    )


def cordoned_automatically(node: Node) -> bool:
    """Whether the node's cordon is the platform's own (the strikes', strikes.strike_node, or a
    health check's), not an admin's: its cordon event says `automatic`."""
    last = last_cordon(node)
    return last is not None and bool(last.data.get("automatic"))


@transaction.atomic
def do_release_automatic_cordon(node: Node, *, by: str, reason: str) -> bool:
    """Uncordon a node that the strikes cordoned automatically (never one an admin cordoned or
    is draining); `by` names the tool that asks (`lockstep up` for its local demo nodes, whose
    strikes come from its own earlier runs). Returns whether the node was released."""
    node = Node.objects.select_for_update(no_key=True).get(pk=node.pk)
    if not cordoned_automatically(node):
        return False
    was = node.state_reason
    node.state, node.state_reason = Node.State.UP, ""
    node.save(update_fields=["state", "state_reason"])
    record_event(
        EventKind.NODE_UNCORDONED,
        f"node {node.name} uncordoned by {by}: {reason} (it was cordoned automatically: {was})",
        node=node,
        data={"automatic_cordon_released": True, "by": by, "was": was},
    )
    wake("node uncordoned")
    return True
