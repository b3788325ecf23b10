"""`GET /metrics`: refused without a staff token or the scrape token; parsable by
prometheus_client; the figures are the database's (queue depth, jobs by state, GPUs
allocated/idle/down, heartbeat ages, restarts, preemptions, goodput, the last scheduler pass)."""

from datetime import timedelta

import pytest
from django.core.cache import cache
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from jobs import actions
from jobs.models import Job, Node, PreemptionRequest
from jobs.scheduling.loop import LAST_PASS_KEY, run_pass
from tests.heartbeats import live_attempt, submit


def scrape(client, token: str):
    response = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {token}")
    assert response.status_code == 200, response.content
    assert response["Content-Type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


@pytest.fixture
def staff_token(make_user, token_for):
    return token_for(make_user("ops", staff=True))


@pytest.mark.django_db
def test_metrics_refuses_anonymous_members_and_node_tokens(client, setup, token_for, settings):
    _, member, _, _ = setup
    settings.LOCKSTEP = {**settings.LOCKSTEP, "METRICS_TOKEN": "scrape-secret"}
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics").headers["WWW-Authenticate"].startswith("Bearer")
    for token in (token_for(member), "scrape-wrong", "node_made_up"):
        assert client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {token}").status_code == 401
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer scrape-secret").status_code == 200
    client.force_login(member)
    assert client.get("/metrics").status_code == 401


@pytest.mark.django_db
def test_metrics_report_the_clusters_state(client, setup, staff_token, make_nodes):
    team, user, (a, b), _ = setup  # 2 nodes x 2 GPUs
    (spare,) = make_nodes(1, 3, prefix="spare")
    running = submit(team, user, gpus=2)
    run_pass()
    assert live_attempt(running).allocations.count() == 2
    submit(team, user, gpus=4)
    submit(team, user, gpus=4)
    actions.do_mark_node_lost(spare, now=timezone.now(), reason="test")
    Job.objects.filter(pk=running.pk).update(restart_count=3)
    now = timezone.now()
    PreemptionRequest.objects.create(
        victim=running,
        claimant=Job.objects.filter(state="QUEUED").first(),
        kind="reclaim",
        state="executed",
        reason="quota",
        created_at=now,
    )
    Node.objects.filter(pk=a.pk).update(last_heartbeat_at=now - timedelta(seconds=42))

    samples = scrape(client, staff_token)

    assert samples[("lockstep_queue_depth", ())] == 2
    assert samples[("lockstep_queued_gpus", ())] == 8
    assert samples[("lockstep_jobs", (("state", "QUEUED"),))] == 2
    assert samples[("lockstep_jobs", (("state", "STARTING"),))] == 1
    assert samples[("lockstep_jobs", (("state", "FAILED"),))] == 0
    assert samples[("lockstep_gpus", (("state", "allocated"),))] == 2
    assert samples[("lockstep_gpus", (("state", "down"),))] == 3  # the spare node's
    assert samples[("lockstep_gpus", (("state", "idle"),))] == 2
    assert samples[("lockstep_nodes", (("state", "down"),))] == 1
    assert samples[("lockstep_nodes", (("state", "up"),))] == 2
    assert 41 <= samples[("lockstep_node_heartbeat_age_seconds", (("node", a.name),))] < 60
    assert samples[("lockstep_job_restarts_total", ())] == 3
    assert samples[("lockstep_preemptions_total", (("kind", "reclaim"),))] == 1
    assert samples[("lockstep_preemptions_total", (("kind", "priority"),))] == 0
    assert (
        samples[("lockstep_preemption_requests", (("kind", "reclaim"), ("state", "executed")))] == 1
    )
    assert ("lockstep_team_goodput_wall_seconds", (("team", team.name),)) in samples


@pytest.mark.django_db
def test_metrics_show_the_scheduler_pass_recorded_in_the_cache(client, setup, staff_token):
    cache.delete(LAST_PASS_KEY)
    assert ("lockstep_scheduler_last_pass_seconds", ()) not in scrape(client, staff_token)
    report, _ = run_pass()
    samples = scrape(client, staff_token)
    assert samples[("lockstep_scheduler_last_pass_seconds", ())] == pytest.approx(report.seconds)
    assert 0 <= samples[("lockstep_scheduler_last_pass_age_seconds", ())] < 30


@pytest.mark.django_db
def test_a_staff_session_may_scrape(client, make_user):
    client.force_login(make_user("admin", staff=True))
    response = client.get("/metrics")
    assert response.status_code == 200
    assert b"lockstep_queue_depth 0.0" in response.content
