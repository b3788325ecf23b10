"""The admin console's queue, nodes, reports and event log (issue 6). Cluster admins see and act
on everything; team leads see and act on the teams they lead; anyone else gets a 404."""

from __future__ import annotations

import csv
import re
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from functools import wraps
from urllib.parse import urlencode

from django import forms
from django.contrib import messages
from django.contrib.auth.views import redirect_to_login
from django.core.paginator import Paginator
from django.db.models import Count, F, Max, Q
from django.http import Http404, HttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone

from jobs import actions, queries
from jobs.conf import lockstep_setting
from jobs.models import GPU, PRIORITY_RANK, Allocation, Attempt, Event, Job, Node, Priority
from teams.access import is_cluster_admin
from teams.models import Membership, Team

# --- who may see what ------------------------------------------------------------------------


class Scope:
    """What one console user may see: everything (a cluster admin) or the teams they lead."""

    def __init__(self, user):
        self.admin = is_cluster_admin(user)
        self.team_ids = (
            None
            if self.admin
            else set(
                Membership.objects.filter(user=user, role=Membership.Role.LEAD).values_list(
                    "team_id", flat=True
                )
            )
        )

    def teams(self):
        teams = Team.objects.order_by("name")
        return teams if self.admin else teams.filter(id__in=self.team_ids)

    def jobs(self):
        return Job.objects.all() if self.admin else Job.objects.filter(team_id__in=self.team_ids)

    def events(self):
        if self.admin:
            return Event.objects.all()
        mine = self.team_ids
        return Event.objects.filter(Q(team_id__in=mine) | Q(job__team_id__in=mine))


def is_console_user(user) -> bool:
    """Admins, and leads of at least one team (the nav shows them the console)."""
    if not user.is_authenticated:
        return False
    return (
        is_cluster_admin(user)
        or Membership.objects.filter(user=user, role=Membership.Role.LEAD).exists()
    )


def console_view(*, admin_only: bool = False):
    """Anonymous users are sent to log in; anyone outside the page's audience gets the 404 a
    missing page gets (a denial that leaks nothing, DESIGN.md section 10)."""

    def decorate(view):
        @wraps(view)
        def wrapped(request, *args, **kwargs):
            if not request.user.is_authenticated:
                return redirect_to_login(request.get_full_path())
            scope = Scope(request.user)
            if not scope.admin and (admin_only or not scope.team_ids):
                raise Http404("No such page.")
            return view(request, scope, *args, **kwargs)

        return wrapped

    return decorate


def duration(seconds) -> str:
    """A duration for people: 42 s, 12.5 min, 3.2 h, 2.1 d."""
    if seconds is None:
        return "—"
    seconds = float(seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.1f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


# --- teams: guaranteed versus borrowed ---------------------------------------------------------


def quota_split(used: int, quota: int) -> dict:
    """A team's GPUs in use split as the scheduler sees them: up to its quota guaranteed, the
    rest borrowed (reclaimable by teams under their quota)."""
    guaranteed = min(used, quota)
    return {"guaranteed": guaranteed, "borrowed": used - guaranteed}


# --- queue -----------------------------------------------------------------------------------

QUEUE_STATES = (
    Job.State.QUEUED,
    Job.State.RESTARTING,
    Job.State.STARTING,
    Job.State.RUNNING,
    Job.State.PREEMPTING,
)
_HOLDS = re.compile(r"holds a reservation on ([^;]+)")
_WAITS_FOR_VICTIMS = re.compile(
    r"waiting for (job \d+(?:, job \d+)*)(?: \([^)]*\))? to checkpoint and stop"
)


def reservation_from_reason(reason: str) -> str | None:
    """What a queued job holds, as the scheduler wrote it in the job's reason. The policy's
    reservation lives only for one pass (jobs.scheduling.policy.Plan.reservation); the reason
    text is the only place it is recorded."""
    if match := _HOLDS.search(reason or ""):
        return "nodes " + match.group(1).strip()
    if match := _WAITS_FOR_VICTIMS.search(reason or ""):
        return f"the GPUs of {match.group(1)}, once preempted (checkpoint, then stop)"
    return None


class PriorityForm(forms.Form):
    job = forms.IntegerField(widget=forms.HiddenInput)
    priority = forms.ChoiceField(choices=Priority.choices)

    def __init__(self, *args, jobs, **kwargs):
        super().__init__(*args, **kwargs)
        self.jobs = jobs

    def clean_job(self):
        job = self.jobs.filter(pk=self.cleaned_data["job"]).first()
        if job is None:  # not there, or not a team this user leads: the same answer
            raise forms.ValidationError("No such job in your teams.")
        if job.state not in QUEUE_STATES:
            raise forms.ValidationError(f"Job {job.id} has ended ({job.state}).")
        return job

    def clean(self):
        data = super().clean()
        job, priority = data.get("job"), data.get("priority")
        if job and priority and job.priority == priority:
            self.add_error("priority", f"Job {job.id} already has priority {priority}.")
        return data


@console_view()
def queue(request, scope):
    jobs = scope.jobs().filter(state__in=QUEUE_STATES)
    failed = None
    status = 200
    if request.method == "POST":
        form = PriorityForm(request.POST, jobs=scope.jobs())
        if form.is_valid():
            job = form.cleaned_data["job"]
            before = job.priority
            actions.do_set_job_priority(
                job, priority=form.cleaned_data["priority"], actor=request.user
            )
            messages.success(request, f"Job {job.id}: priority {before} -> {job.priority}.")
            return redirect("console_queue")
        failed, status = form, 400
    now = timezone.now()
    rows = list(jobs.select_related("team", "owner"))
    rows.sort(
        key=lambda j: (
            j.state == Job.State.QUEUED or j.state == Job.State.RESTARTING,
            -PRIORITY_RANK[j.priority],
            j.submitted_at,
            j.id,
        )
    )
    held = queries.run_seconds([j.id for j in rows], now=now)
    posted = failed.data.get("job") if failed is not None else None
    table, reservations = [], []
    for job in rows:
        is_failed = posted is not None and str(job.id) == str(posted)
        form = (
            failed
            if is_failed
            else PriorityForm(initial={"job": job.id, "priority": job.priority}, jobs=jobs)
        )
        waiting = job.state in (Job.State.QUEUED, Job.State.RESTARTING)
        reserved = reservation_from_reason(job.reason) if waiting else None
        if reserved:
            reservations.append({"job": job, "holds": reserved})
        table.append(
            {
                "job": job,
                "form": form,
                "waiting": waiting,
                "wait": duration((now - job.submitted_at).total_seconds()) if waiting else "",
                "runtime": duration(held.get(job.id)) if job.id in held else "—",
            }
        )
    # A refused row that is no longer listed (unknown job) still shows its error.
    orphan = failed if failed is not None and not any(r["form"] is failed for r in table) else None
    return render(
        request,
        "console_queue.html",
        {
            "rows": table,
            "reservations": reservations,
            "orphan": orphan,
            "scope": scope,
            "running": sum(1 for r in table if not r["waiting"]),
            "queued": sum(1 for r in table if r["waiting"]),
        },
        status=status,
    )


# --- nodes -----------------------------------------------------------------------------------


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
        if node.state == Node.State.DOWN:
            self.add_error(
                "action",
                f"{node.name} is down (no heartbeat); it rejoins as up when its agent returns.",
            )
        elif action == "uncordon" and node.state == Node.State.UP:
            self.add_error("action", f"{node.name} is up already.")
        elif action in ("cordon", "drain") and node.state == {
            "cordon": Node.State.CORDONED,
            "drain": Node.State.DRAINING,
        }.get(action):
            self.add_error("action", f"{node.name} is {node.state} already.")
        return data


FAILURE_KINDS = ("attempt.failed", "attempt.lost", "node.down", "node.strike")


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
            kind="node.strike_withdrawn", created_at__gte=window
        ).values_list("data__strike", flat=True)
        if ref is not None
    }
    for event in Event.objects.filter(
        node__isnull=False, kind__in=FAILURE_KINDS, created_at__gte=window
    ).order_by("-id"):
        if event.kind == "node.strike":
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
        elif strikes[node.id]:
            health = f"{strikes[node.id]} strike(s) in the window"
        else:
            health = "ok"
        rows.append(
            {
                "node": node,
                "busy": len(busy[node.id]),
                "jobs": sorted(jobs_on[node.id]),
                "age": duration(age),
                "health": health,
                "healthy": health == "ok",
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


# --- reports ---------------------------------------------------------------------------------

LOST_FAILURE = (Attempt.State.FAILED, Attempt.State.LOST)
LOST_PREEMPTION = (Attempt.State.PREEMPTED,)
MAX_WEEKS = 52
DEFAULT_WEEKS = 4


class ReportForm(forms.Form):
    weeks = forms.IntegerField(min_value=1, max_value=MAX_WEEKS, initial=DEFAULT_WEEKS)


def week_starts(now: datetime, weeks: int) -> list[datetime]:
    """Mondays 00:00 UTC, oldest first, the last one the start of `now`'s week."""
    today = now.astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    monday = today - timedelta(days=today.weekday())
    return [monday - timedelta(weeks=weeks - 1 - i) for i in range(weeks)]


def _split(start: datetime, end: datetime, bounds: list[datetime], add) -> None:
    """Call add(week index, seconds) for each week [bounds[i], bounds[i+1]) the span overlaps."""
    for i, week_start in enumerate(bounds[:-1]):
        seconds = (min(end, bounds[i + 1]) - max(start, week_start)).total_seconds()
        if seconds > 0:
            add(i, seconds)


def _week_of(when: datetime, bounds: list[datetime]) -> int | None:
    for i in range(len(bounds) - 1):
        if bounds[i] <= when < bounds[i + 1]:
            return i
    return None


def usage_report(*, now: datetime, weeks: int, teams) -> dict:
    """GPU-hours per team and week: used (allocations held), lost to failures and to
    preemption, goodput; and per week the cluster's capacity, allocated and idle GPU-hours.

    Lost work of an attempt that failed, was lost with its node, or was preempted = its GPUs x
    the time from its last checkpoint (or, without one, its start) to its end: what the next
    attempt recomputes. It counts in the week the attempt ended. Goodput = (used - lost) / used.
    Capacity counts every registered GPU from its node's registration, down nodes included.
    """
    starts = week_starts(now, weeks)
    bounds = [*starts, now]
    teams = list(teams)
    team_ids = {t.id for t in teams}
    used = defaultdict(float)  # (week, team id) -> GPU-seconds
    lost = defaultdict(float)  # (week, team id, cause) -> GPU-seconds
    begin = starts[0]

    # An attempt's GPUs are claimed together and released together: one row per gang.
    for team_id, claimed, released, count in (
        Allocation.objects.filter(
            Q(released_at__isnull=True) | Q(released_at__gt=begin),
            claimed_at__lt=now,
            attempt__job__team_id__in=team_ids,
        )
        .values_list("attempt__job__team_id", "claimed_at", "released_at")
        .annotate(count=Count("id"))
        .order_by()
    ):

        def add(i, s, team_id=team_id, count=count):
            used[i, team_id] += count * s

        _split(claimed, released or now, bounds, add)

    ended = (
        Attempt.objects.filter(
            state__in=LOST_FAILURE + LOST_PREEMPTION,
            ended_at__gte=begin,
            ended_at__lt=now,
            job__team_id__in=team_ids,
        )
        .annotate(
            last_checkpoint=Max(
                "checkpoints__created_at", filter=Q(checkpoints__created_at__lte=F("ended_at"))
            )
        )
        .values_list(
            "job__team_id", "job__gpus", "state", "created_at", "ended_at", "last_checkpoint"
        )
    )
    for team_id, gpus, state, created, end, checkpoint in ended:
        since = max(checkpoint, created) if checkpoint else created
        week = _week_of(end, bounds)
        if week is not None:
            cause = "failure" if state in LOST_FAILURE else "preemption"
            lost[week, team_id, cause] += gpus * max((end - since).total_seconds(), 0.0)

    capacity = defaultdict(float)
    for registered, count in (
        GPU.objects.values_list("node__registered_at").annotate(count=Count("id")).order_by()
    ):

        def add_capacity(i, s, count=count):
            capacity[i] += count * s

        _split(registered, now, bounds, add_capacity)

    def hours(seconds: float) -> float:
        return round(seconds / 3600, 2)

    def goodput(used_s: float, lost_s: float) -> dict:
        share = max(used_s - lost_s, 0.0) / used_s if used_s else None
        return {
            "goodput": None if share is None else round(share, 4),
            "goodput_pct": "" if share is None else f"{100 * share:.1f}%",
        }

    rows, cluster = [], []
    for i, start in enumerate(starts):
        allocated = sum(used[i, t.id] for t in teams)
        cluster.append(
            {
                "week": start.date(),
                "capacity_h": hours(capacity[i]),
                "allocated_h": hours(allocated),
                "idle_h": hours(max(capacity[i] - allocated, 0.0)),
            }
        )
        for team in teams:
            failure, preemption = lost[i, team.id, "failure"], lost[i, team.id, "preemption"]
            rows.append(
                {
                    "week": start.date(),
                    "team": team.name,
                    "used_h": hours(used[i, team.id]),
                    "lost_failure_h": hours(failure),
                    "lost_preemption_h": hours(preemption),
                    **goodput(used[i, team.id], failure + preemption),
                }
            )
    totals = []
    for team in teams:
        u = sum(used[i, team.id] for i in range(len(starts)))
        f = sum(lost[i, team.id, "failure"] for i in range(len(starts)))
        p = sum(lost[i, team.id, "preemption"] for i in range(len(starts)))
        totals.append(
            {
                "team": team.name,
                "used_h": hours(u),
                "lost_failure_h": hours(f),
                "lost_preemption_h": hours(p),
                **goodput(u, f + p),
            }
        )
    return {"weeks": [s.date() for s in starts], "rows": rows, "cluster": cluster, "totals": totals}


PALETTE = ("#2563eb", "#ea580c", "#16a34a", "#9333ea", "#dc2626", "#0891b2", "#ca8a04", "#db2777")


def report_figures(report: dict, *, with_idle: bool) -> dict:
    """Plotly figures (plain dicts) of a usage report."""
    weeks = [str(w) for w in report["weeks"]]
    by_team: dict[str, dict] = defaultdict(dict)
    for row in report["rows"]:
        by_team[row["team"]][str(row["week"])] = row
    color = {team: PALETTE[i % len(PALETTE)] for i, team in enumerate(by_team)}
    usage = [
        {
            "type": "bar",
            "name": team,
            "x": weeks,
            "y": [cells[w]["used_h"] for w in weeks],
            "marker": {"color": color[team]},
        }
        for team, cells in by_team.items()
    ]
    if with_idle:
        usage.append(
            {
                "type": "bar",
                "name": "idle",
                "x": weeks,
                "y": [c["idle_h"] for c in report["cluster"]],
                "marker": {"color": "#d1d5db"},
            }
        )
    lost = []
    for team, cells in by_team.items():
        for key, cause, pattern in (
            ("lost_failure_h", "failures", ""),
            ("lost_preemption_h", "preemption", "/"),
        ):
            lost.append(
                {
                    "type": "bar",
                    "name": f"{team}: {cause}",
                    "x": weeks,
                    "y": [cells[w][key] for w in weeks],
                    "marker": {"color": color[team], "pattern": {"shape": pattern}},
                }
            )
    layout = {
        "barmode": "stack",
        "margin": {"l": 50, "r": 10, "t": 40, "b": 30},
        "legend": {"orientation": "h", "y": -0.15},
        "xaxis": {"type": "category"},
    }
    return {
        "usage": {
            "data": usage,
            "layout": {
                **layout,
                "title": {
                    "text": "GPU-hours used per week (from Monday, UTC)"
                    + (", and idle" if with_idle else "")
                },
                "yaxis": {"title": {"text": "GPU-hours"}},
            },
        },
        "lost": {
            "data": lost,
            "layout": {
                **layout,
                "title": {"text": "GPU-hours lost to failures and preemption"},
                "yaxis": {"title": {"text": "GPU-hours"}},
            },
        },
    }


CSV_COLUMNS = (
    "week",
    "team",
    "gpu_hours_used",
    "gpu_hours_lost_failures",
    "gpu_hours_lost_preemption",
    "goodput",
    "cluster_gpu_hours",
    "cluster_gpu_hours_idle",
)


def _csv(report: dict, *, with_cluster: bool) -> HttpResponse:
    response = HttpResponse(content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = 'attachment; filename="lockstep-usage.csv"'
    writer = csv.writer(response)
    writer.writerow(CSV_COLUMNS)
    for row in report["rows"]:
        writer.writerow(
            [
                row["week"],
                row["team"],
                row["used_h"],
                row["lost_failure_h"],
                row["lost_preemption_h"],
                "" if row["goodput"] is None else row["goodput"],
                "",
                "",
            ]
        )
    if with_cluster:
        for c in report["cluster"]:
            writer.writerow(
                [c["week"], "*", c["allocated_h"], "", "", "", c["capacity_h"], c["idle_h"]]
            )
    return response


@console_view()
def reports(request, scope):
    form = ReportForm(request.GET if "weeks" in request.GET else None)
    if form.is_bound and not form.is_valid():
        if request.GET.get("format") == "csv":
            return HttpResponse(
                "; ".join(form.errors["weeks"]), status=400, content_type="text/plain"
            )
        weeks, status = DEFAULT_WEEKS, 400
    else:
        weeks, status = (form.cleaned_data["weeks"] if form.is_bound else DEFAULT_WEEKS), 200
    report = usage_report(now=timezone.now(), weeks=weeks, teams=scope.teams())
    if request.GET.get("format") == "csv":
        return _csv(report, with_cluster=scope.admin)
    return render(
        request,
        "console_reports.html",
        {
            "form": form,
            "report": report,
            "weeks": weeks,
            "scope": scope,
            "figures": report_figures(report, with_idle=scope.admin),
            "csv_query": urlencode({"weeks": weeks, "format": "csv"}),
        },
        status=status,
    )


# --- event log -------------------------------------------------------------------------------

EVENTS_PER_PAGE = 50
_LOCAL = forms.DateTimeInput(attrs={"type": "datetime-local"}, format="%Y-%m-%dT%H:%M")


class EventFilterForm(forms.Form):
    kind = forms.ChoiceField(required=False)
    team = forms.ModelChoiceField(
        queryset=Team.objects.none(), to_field_name="name", required=False, empty_label="any"
    )
    job = forms.IntegerField(required=False, min_value=1, label="Job id")
    node = forms.CharField(required=False, max_length=128)
    since = forms.DateTimeField(required=False, label="From (UTC)", widget=_LOCAL)
    until = forms.DateTimeField(required=False, label="To (UTC)", widget=_LOCAL)

    def __init__(self, *args, scope: Scope, **kwargs):
        super().__init__(*args, **kwargs)
        self.scope = scope
        self.fields["team"].queryset = scope.teams()
        kinds = scope.events().order_by("kind").values_list("kind", flat=True).distinct()
        self.fields["kind"].choices = [("", "any"), *((k, k) for k in kinds)]

    def clean_job(self):
        job_id = self.cleaned_data["job"]
        if job_id is not None and not self.scope.jobs().filter(pk=job_id).exists():
            raise forms.ValidationError("No such job in your teams.")
        return job_id

    def clean_node(self):
        name = self.cleaned_data["node"].strip()
        if name and not Node.objects.filter(name=name).exists():
            raise forms.ValidationError("No such node.")
        return name

    def clean(self):
        data = super().clean()
        since, until = data.get("since"), data.get("until")
        if since and until and since >= until:
            self.add_error("until", "Must be after the start.")
        return data

    def filter(self, events):
        data = self.cleaned_data
        if data.get("kind"):
            events = events.filter(kind=data["kind"])
        if data.get("team"):
            team = data["team"]
            events = events.filter(Q(team=team) | Q(job__team=team))
        if data.get("job"):
            events = events.filter(job_id=data["job"])
        if data.get("node"):
            events = events.filter(node__name=data["node"])
        if data.get("since"):
            events = events.filter(created_at__gte=data["since"])
        if data.get("until"):
            events = events.filter(created_at__lt=data["until"])
        return events


@console_view()
def events(request, scope):
    params = request.GET.copy()
    params.pop("page", None)
    form = EventFilterForm(params or None, scope=scope)
    status = 200
    if not params or form.is_valid():
        found = scope.events()
        if params:
            found = form.filter(found)
        found = found.select_related("job__team", "node", "team", "actor").order_by("-id")
    else:
        found, status = Event.objects.none(), 400
    page = Paginator(found, EVENTS_PER_PAGE).get_page(request.GET.get("page"))
    return render(
        request,
        "console_events.html",
        {
            "form": form,
            "page": page,
            "query": params.urlencode(),
            "scope": scope,
        },
        status=status,
    )
