"""The console's nodes page (admins): GPUs, health, strikes, and cordon, drain and uncordon."""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime, timedelta

from django import forms
from django.contrib import messages
from django.db.models import Count
from django.shortcuts import redirect, render
from django.utils import timezone

from jobs import actions
from jobs.conf import lockstep_setting
from jobs.event_kinds import EventKind
from jobs.models import (
    Allocation,
    Event,
    Node,
)
from portal.console.access import console_view
from portal.formatting import duration


class NodeActionForm(forms.Form):
    ACTIONS = (("cordon", "Cordon"), ("drain", "Drain"), ("uncordon", "Uncordon"))

    node = forms.CharField(max_length=128, widget=forms.HiddenInput)
    action = forms.ChoiceField(choices=ACTIONS)
    reason = forms.CharField(
        max_length=500,
        error_messages={"required": "Say why (it goes into the node's event log)."},
    )

    def clean_node(self):
        node = Node.objects.filter(name=self.cleaned_data["node"]).first()
        if node is None:
            raise forms.ValidationError("No such node.")
        return node

    def clean(self):
        data = super().clean()
        node, action = data.get("node"), data.get("action")
        if not node or not action:
            return data
        wanted = {
            "cordon": Node.State.CORDONED,
            "drain": Node.State.DRAINING,
            "uncordon": Node.State.UP,
        }.get(action)
        if node.state == Node.State.DOWN:
            # What an admin sets on a down node applies when it is back (Node.held_state).
            back_as = node.held_state or Node.State.UP
            if back_as == wanted:
                self.add_error(
                    "action",
                    f"{node.name} is down (no heartbeat); it rejoins as {back_as} when its agent "
                    "returns.",
                )
        elif node.state == wanted:
            self.add_error("action", f"{node.name} is {node.state} already.")
        return data


FAILURE_KINDS = (
    EventKind.ATTEMPT_FAILED,
    EventKind.ATTEMPT_LOST,
    EventKind.NODE_DOWN,
    EventKind.NODE_STRIKE,
)


def node_rows(now: datetime, failed: NodeActionForm | None = None) -> list[dict]:
    window = now - timedelta(seconds=lockstep_setting("STRIKE_WINDOW_S"))
    timeout = lockstep_setting("HEARTBEAT_TIMEOUT_S")
    nodes = list(Node.objects.annotate(gpu_count=Count("gpus", distinct=True)).order_by("name"))
    busy: dict[int, set[int]] = defaultdict(set)
    jobs_on: dict[int, set[int]] = defaultdict(set)
    for node_id, gpu_id, job_id in Allocation.objects.filter(released_at__isnull=True).values_list(
        "node_id", "gpu_id", "attempt__job_id"
    ):
        busy[node_id].add(gpu_id)
        jobs_on[node_id].add(job_id)
    strikes: dict[int, int] = defaultdict(int)
    recent: dict[int, list[Event]] = defaultdict(list)
    # Strikes moved to another node when a failure's cause was revised (jobs.actions).
    withdrawn = {
        int(ref)
        for ref in Event.objects.filter(
            kind=EventKind.NODE_STRIKE_WITHDRAWN, created_at__gte=window
        ).values_list("data__strike", flat=True)
        if ref is not None
    }
    for event in Event.objects.filter(
        node__isnull=False, kind__in=FAILURE_KINDS, created_at__gte=window
    ).order_by("-id"):
        if event.kind == EventKind.NODE_STRIKE:
            strikes[event.node_id] += event.id not in withdrawn
        elif len(recent[event.node_id]) < 3:
            recent[event.node_id].append(event)
    posted = failed.data.get("node") if failed is not None else None
    rows = []
    for node in nodes:
        age = (now - node.last_heartbeat_at).total_seconds()
        utils = [t.get("util") for t in node.telemetry or [] if isinstance(t, dict)]
        utils = [u for u in utils if isinstance(u, int | float)]
        if node.state == Node.State.DOWN:
            health = "down"
        elif age > timeout / 2:
            health = f"heartbeat late ({duration(age)})"
        elif node.health and not node.health.get("ok", True):
            health = f"check failed: {node.health.get('reason') or 'see the node API'}"
        elif strikes[node.id]:
            health = f"{strikes[node.id]} strike(s) in the window"
        else:
            health = "ok"
        # The agent's last health check (nodeagent/health_check.py), when there is one.
        checked = ""
        if node.health_at is not None and node.health:
            ago = duration((now - node.health_at).total_seconds())
            checked = f"{node.health.get('kind', '')} check {ago} ago"
            if isinstance(node.health.get("compute_ms"), int | float):
                checked += f", matmul {node.health['compute_ms']:.1f} ms"
        rows.append(
            {
                "node": node,
                "busy": len(busy[node.id]),
                "jobs": sorted(jobs_on[node.id]),
                "age": duration(age),
                "health": health,
                "healthy": health == "ok",
                "checked": checked,
                "util": round(sum(utils) / len(utils)) if utils else None,
                "strikes": strikes[node.id],
                "recent": recent[node.id],
                "drained": node.state == Node.State.DRAINING and not jobs_on[node.id],
                "form": failed
                if posted == node.name
                else NodeActionForm(initial={"node": node.name}),
            }
        )
    return rows


@console_view(admin_only=True)
def nodes(request, scope):
    failed, status = None, 200
    if request.method == "POST":
        form = NodeActionForm(request.POST)
        if form.is_valid():
            node, action, reason = (
                form.cleaned_data["node"],
                form.cleaned_data["action"],
                form.cleaned_data["reason"],
            )
            if action == "uncordon":
                node = actions.do_uncordon_node(node, actor=request.user, reason=reason)
            else:
                node = actions.do_cordon_node(
                    node,
                    actor=request.user,
                    reason=reason,
                    drain=action == "drain",
                    now=timezone.now(),
                )
            messages.success(request, f"Node {node.name}: {node.state} ({reason}).")
            return redirect("console_nodes")
        failed, status = form, 400
    now = timezone.now()
    rows = node_rows(now, failed)
    orphan = failed if failed is not None and not any(r["form"] is failed for r in rows) else None
    summary = {
        state: sum(1 for r in rows if r["node"].state == state) for state in Node.State.values
    }
    return render(
        request,
        "console_nodes.html",
        {
            "rows": rows,
            "orphan": orphan,
            "summary": summary,
            "gpus": sum(r["node"].gpu_count for r in rows),
            "busy": sum(r["busy"] for r in rows),
            "strike_limit": lockstep_setting("STRIKES_TO_CORDON"),
            "strike_window": duration(lockstep_setting("STRIKE_WINDOW_S")),
        },
        status=status,
    )
