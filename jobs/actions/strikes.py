"""Strikes: failures attributed to a node, and the automatic cordon after too many in a window.
The lowest layer of the actions that blame a node; it imports only the shared base.

The rule: a strike counts only a failure the node could have caused. These do: a rank that
exits non-zero after the attempt's first step (the first to die, `failures.record_exits`; moved
when a later report revises the cause), a node lost (its heartbeats stopped, or its agent came
back with a new boot without having said it was leaving), a straggler rank, and a hung gang's
rank that could not dump its stacks. These do not: a failure before the first step (the job's
own command, image or data is the likelier cause), anything during a checkpoint-and-stop
(preemption, drain, cancel, time limit, grow-back), a planned restart (the agent said it was
leaving on SIGTERM/SIGINT: `nodes.do_node_leaving`, and its return), a hang whose stacks name
no node, and the portal's own outage (no node is declared lost for it)."""

from __future__ import annotations

from datetime import datetime, timedelta

from jobs.actions.base import record_event
from jobs.conf import lockstep_setting
from jobs.event_kinds import EventKind
from jobs.models import (
    Attempt,
    Event,
    Node,
)


def node_strikes(node: Node, now: datetime) -> int:
    """Strikes against the node in the window, less those withdrawn (`_move_strike`)."""
    window = now - timedelta(seconds=lockstep_setting("STRIKE_WINDOW_S"))
    withdrawn = {
        int(ref)
        for ref in Event.objects.filter(
            node=node, kind=EventKind.NODE_STRIKE_WITHDRAWN, created_at__gte=window
        ).values_list("data__strike", flat=True)
        if ref is not None
    }
    strikes = Event.objects.filter(node=node, kind=EventKind.NODE_STRIKE, created_at__gte=window)
    return strikes.exclude(id__in=withdrawn).count()


def strike_node(node: Node, reason: str, *, now: datetime, attempt: Attempt | None = None) -> None:
    """Attribute a failure to a node; enough strikes in the window cordon it for admins.
    `attempt`: the attempt whose end is blamed on the node (a strike `_move_strike` can move
    when the cause is revised)."""
    record_event(
        EventKind.NODE_STRIKE,
        f"strike on {node.name}: {reason}",
        node=node,
        attempt=attempt,
        data={"attempt_end": attempt is not None},
    )
    strikes = node_strikes(node, now)
    limit = lockstep_setting("STRIKES_TO_CORDON")
    if strikes < limit:
        return
    hours = lockstep_setting("STRIKE_WINDOW_S") / 3600
    why = f"{strikes} failures in {hours:.0f}h; an admin should check it"
    # Conditional: the caller's Node may be stale (another transaction set it down or
    # draining meanwhile); only a node that is up is cordoned.
    if Node.objects.filter(pk=node.pk, state=Node.State.UP).update(
        state=Node.State.CORDONED, state_reason=why
    ):
        node.state, node.state_reason = Node.State.CORDONED, why
        record_event(
            EventKind.NODE_CORDONED,
            f"node {node.name} cordoned automatically: {node.state_reason}",
            node=node,
            data={"strikes": strikes, "automatic": True},
        )
    elif Node.objects.filter(pk=node.pk, state=Node.State.DOWN, held_state="").update(
        held_state=Node.State.CORDONED, held_reason=why
    ):
        # The strike that lost the node: it is down now, and without this it came back up
        # with its next heartbeat, a node that keeps crashing uncordoned by its own crash.
        node.held_state, node.held_reason = Node.State.CORDONED, why
        record_event(
            EventKind.NODE_CORDONED,
            f"node {node.name} cordoned automatically (down now: from when it is back): {why}",
            node=node,
            data={"strikes": strikes, "automatic": True},
        )
