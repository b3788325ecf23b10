"""`GET /metrics`: the cluster's state in Prometheus text format, computed from the database
(and the scheduler's last pass from the cache) at scrape time.

Every figure is read when scraped rather than counted in process memory: there are several
daphne processes and a separate scheduler, and any of them may answer the scrape.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterator
from datetime import timedelta

from django.db.models import Count, Sum
from django.http import HttpResponse
from django.utils import timezone
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from jobs.conf import lockstep_setting
from jobs.models import GPU, Allocation, Job, Node, PreemptionRequest
from jobs.reports import REPORT_DAYS
from jobs.reports.goodput import team_goodput
from jobs.scheduling.loop import LAST_PASS_KEY
from teams.access import is_cluster_admin
from teams.auth import user_for_token
from teams.models import Team

GOODPUT_WINDOW = timedelta(days=REPORT_DAYS)  # the same window as the teams API's goodput


class LockstepCollector:
    """A custom collector: prometheus_client calls collect() on each scrape."""

    def collect(self) -> Iterator[Metric]:
        now = timezone.now()
        yield from self._jobs()
        yield from self._gpus_and_nodes(now)
        yield from self._preemptions()
        yield from self._scheduler(now)
        yield from self._goodput(now)

    def _jobs(self) -> Iterator[Metric]:
        counts = dict(Job.objects.values_list("state").annotate(n=Count("id")))
        by_state = GaugeMetricFamily("lockstep_jobs", "Jobs by state", labels=["state"])
        for state in Job.State.values:
            by_state.add_metric([state], counts.get(state, 0))
        yield by_state
        queued = Job.objects.filter(state=Job.State.QUEUED).aggregate(
            jobs=Count("id"), gpus=Sum("gpus")
        )
        yield GaugeMetricFamily(
            "lockstep_queue_depth", "Jobs waiting in the queue", value=queued["jobs"]
        )
        yield GaugeMetricFamily(
            "lockstep_queued_gpus", "GPUs asked for by queued jobs", value=queued["gpus"] or 0
        )
        restarts = Job.objects.aggregate(n=Sum("restart_count"))["n"] or 0
        yield CounterMetricFamily(
            "lockstep_job_restarts", "Restarts of jobs after a failure, summed", value=restarts
        )

    def _gpus_and_nodes(self, now) -> Iterator[Metric]:
        total_down = GPU.objects.filter(node__state=Node.State.DOWN).count()
        total = GPU.objects.count()
        allocated = (
            Allocation.objects.filter(released_at__isnull=True)
            .exclude(node__state=Node.State.DOWN)
            .count()
        )
        gpus = GaugeMetricFamily(
            "lockstep_gpus",
            "GPUs by state: allocated (held by a live attempt), idle, down (on a down node)",
            labels=["state"],
        )
        gpus.add_metric(["allocated"], allocated)
        gpus.add_metric(["idle"], max(total - total_down - allocated, 0))
        gpus.add_metric(["down"], total_down)
        yield gpus

        nodes = list(
            Node.objects.order_by("name").values_list("name", "state", "last_heartbeat_at")
        )
        by_state = GaugeMetricFamily("lockstep_nodes", "Nodes by state", labels=["state"])
        for state in Node.State.values:
            by_state.add_metric([state], sum(1 for _, s, _ in nodes if s == state))
        yield by_state
        age = GaugeMetricFamily(
            "lockstep_node_heartbeat_age_seconds",
            "Seconds since each node's last heartbeat",
            labels=["node"],
        )
        for name, _, beat in nodes:
            age.add_metric([name], max((now - beat).total_seconds(), 0.0))
        yield age

    def _preemptions(self) -> Iterator[Metric]:
        rows = PreemptionRequest.objects.values_list("kind", "state").annotate(n=Count("id"))
        counts = {(kind, state): n for kind, state, n in rows}
        requests = GaugeMetricFamily(
            "lockstep_preemption_requests",
            "Preemption requests by kind and state",
            labels=["kind", "state"],
        )
        executed = CounterMetricFamily(
            "lockstep_preemptions",
            "Preemptions carried out (the victim checkpointed and stopped), by kind",
            labels=["kind"],
        )
        for kind in PreemptionRequest.Kind.values:
            for state in PreemptionRequest.State.values:
                requests.add_metric([kind, state], counts.get((kind, state), 0))
            executed.add_metric([kind], counts.get((kind, PreemptionRequest.State.EXECUTED), 0))
        yield requests
        yield executed

    def _scheduler(self, now) -> Iterator[Metric]:
        from django.core.cache import cache

        try:
            last = cache.get(LAST_PASS_KEY)
        except Exception:  # a cache outage leaves the pass metrics out, not the whole scrape
            last = None
        if not last:
            return
        yield GaugeMetricFamily(
            "lockstep_scheduler_last_pass_seconds",
            "How long the scheduler's latest pass took (housekeeping, snapshot, plan, apply)",
            value=last["seconds"],
        )
        yield GaugeMetricFamily(
            "lockstep_scheduler_last_pass_age_seconds",
            "Seconds since the scheduler's latest pass (a stuck or absent scheduler grows this)",
            value=max(now.timestamp() - last["at"], 0.0),
        )

    def _goodput(self, now) -> Iterator[Metric]:
        ratio = GaugeMetricFamily(
            "lockstep_team_goodput_ratio",
            "Productive step time / wall time of each team's jobs that ran in the last 7 days",
            labels=["team"],
        )
        wall = GaugeMetricFamily(
            "lockstep_team_goodput_wall_seconds",
            "Wall time of each team's jobs that ran in the last 7 days",
            labels=["team"],
        )
        productive = GaugeMetricFamily(
            "lockstep_team_goodput_productive_seconds",
            "Productive step time of each team's jobs that ran in the last 7 days",
            labels=["team"],
        )
        total_wall = total_productive = 0.0
        for team in Team.objects.order_by("name"):
            figures = team_goodput(team, since=now - GOODPUT_WINDOW, now=now)
            if figures["effective"] is not None:
                ratio.add_metric([team.name], figures["effective"])
            wall.add_metric([team.name], figures["wall_s"])
            productive.add_metric([team.name], figures["productive_s"])
            total_wall += figures["wall_s"]
            total_productive += figures["productive_s"]
        yield ratio
        yield wall
        yield productive
        if total_wall > 0:
            yield GaugeMetricFamily(
                "lockstep_goodput_ratio",
                "Productive step time / wall time over every job that ran in the last 7 days",
                value=total_productive / total_wall,
            )


registry = CollectorRegistry(auto_describe=False)
registry.register(LockstepCollector())


def _allowed(request) -> bool:
    """A staff user (session or API token) or the dedicated scrape token."""
    if is_cluster_admin(getattr(request, "user", None)):
        return True
    parts = request.META.get("HTTP_AUTHORIZATION", "").split()
    if len(parts) != 2 or parts[0] != "Bearer":
        return False
    expected = lockstep_setting("METRICS_TOKEN")
    if expected and hmac.compare_digest(parts[1].encode(), expected.encode()):
        return True
    return is_cluster_admin(user_for_token(parts[1]))


def metrics_view(request):
    if not _allowed(request):
        # Prometheus sends the token as `authorization: {credentials: ...}` (docs/production.md).
        response = HttpResponse("authentication required\n", status=401, content_type="text/plain")
        response["WWW-Authenticate"] = 'Bearer realm="lockstep-metrics"'
        return response
    return HttpResponse(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)
