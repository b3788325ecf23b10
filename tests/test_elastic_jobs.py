"""Elastic jobs through the real actions and scheduler pass: a job with min_gpus restarts on
fewer nodes when one is lost, says so in its events, and launches its ranks with the smaller
world size and the job's full size (for the global batch); the applier refuses sizes the job
did not allow; bad min_gpus is refused and creates nothing."""

import json
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone
from rest_framework.test import APIClient

from jobs import actions
from jobs.models import Event, Job
from jobs.scheduling.loop import run_pass
from jobs.scheduling.vocab import Placement, Slot
from tests.heartbeats import beat, commit_checkpoint, launch_of, live_attempt, submit


@pytest.mark.django_db
def test_a_lost_node_restarts_an_elastic_job_on_the_nodes_left(setup):
    team, user, (a, b), root = setup
    job = submit(team, user, gpus=4, min_gpus=2, max_restarts=3)
    run_pass()
    first = live_attempt(job)
    assert first.world_size == 4
    beat(a, first, {0: None, 1: None})
    beat(b, first, {2: None, 3: None}, records=[commit_checkpoint(root, job, 40)])
    actions.do_mark_node_lost(b, now=timezone.now(), reason="heartbeat timeout")
    job.refresh_from_db()
    assert job.state == "RESTARTING"

    run_pass(now=timezone.now() + timedelta(seconds=11))
    second = live_attempt(job)
    assert (second.number, second.world_size, second.resumed_from_step) == (2, 2, 40)
    assert {al.node_id for al in second.allocations.all()} == {a.id}
    shrunk = Event.objects.get(kind="attempt.shrunk", attempt=second)
    assert "runs on 2 of the job's 4 GPUs" in shrunk.message
    assert "resuming step 40 resharded" in shrunk.message
    job.refresh_from_db()
    assert "on 2 of its 4 GPUs (elastic)" in job.reason
    launch = launch_of(a, second)
    beat(a, second, {0: None, 1: None})
    assert (launch["world_size"], launch["job_gpus"], launch["local_world_size"]) == (2, 4, 2)
    assert launch["resume_from"].endswith("step-000040")
    job.refresh_from_db()
    assert job.state == "RUNNING" and "all 2 ranks up" in job.reason


@pytest.mark.django_db
def test_a_shrunk_job_grows_back_to_its_full_size_when_the_gpus_return(setup, settings):
    settings.LOCKSTEP = {**settings.LOCKSTEP, "ELASTIC_GROW_AFTER_S": 300.0}
    team, user, (a, b), root = setup
    job = submit(team, user, gpus=4, min_gpus=2, max_restarts=3)
    run_pass()
    first = live_attempt(job)
    beat(a, first, {0: None, 1: None})
    beat(b, first, {2: None, 3: None}, records=[commit_checkpoint(root, job, 40)])
    t0 = timezone.now()
    actions.do_mark_node_lost(b, now=t0, reason="heartbeat timeout")
    run_pass(now=t0 + timedelta(seconds=11))
    second = live_attempt(job)
    assert second.world_size == 2
    step = {"kind": "step", "rank": 0, "step": 41, "loss": 1.0, "step_time_s": 0.1}
    beat(a, second, {0: None, 1: None}, records=[step], now=t0 + timedelta(seconds=12))
    actions.do_heartbeat(b, {"boot_id": b.boot_id}, now=t0 + timedelta(seconds=20))  # b is back

    # Not yet: the attempt has run less than ELASTIC_GROW_AFTER_S at its smaller size.
    run_pass(now=t0 + timedelta(seconds=60))
    second.refresh_from_db()
    assert second.state == "running"
    # Then b's 2 idle GPUs and nothing queued: checkpoint-and-stop, to restart on all 4.
    run_pass(now=second.created_at + timedelta(seconds=301))
    second.refresh_from_db()
    job.refresh_from_db()
    assert second.state == "stopping"
    assert job.state == "PREEMPTING" and "growing back to 4 GPUs" in job.reason
    growing = Event.objects.get(kind="job.growing", job=job)
    assert "runs on 2 of 4 GPUs" in growing.message and "2 GPUs are idle" in growing.message
    launch = beat(a, second, {0: None, 1: None}, now=t0 + timedelta(seconds=400))["desired"]
    assert launch[0]["action"] == "stop"
    beat(
        a,
        second,
        {0: 0, 1: 0},
        records=[commit_checkpoint(root, job, 90)],
        now=t0 + timedelta(seconds=401),
    )
    second.refresh_from_db()
    job.refresh_from_db()
    assert second.state == "preempted"
    assert job.state == "QUEUED" and job.reason.startswith("requeued: growing back to 4 GPUs")
    assert job.restart_count == 1  # the grow is not a failure: only the lost node counted

    run_pass(now=t0 + timedelta(seconds=402))
    third = live_attempt(job)
    assert (third.number, third.world_size, third.resumed_from_step) == (3, 4, 90)
    assert {al.node_id for al in third.allocations.all()} == {a.id, b.id}
    assert not Event.objects.filter(kind="attempt.shrunk", attempt=third).exists()
    # The job page's timeline marks the shrink and the grow as restarts, not as preemptions.
    client = Client()
    client.force_login(user)
    html = client.get(f"/jobs/{job.id}/").content.decode()
    page = json.loads(html.split('id="job-data" type="application/json">')[1].split("</script>")[0])
    groups = {e["kind"]: e["group"] for e in page["timeline"]["events"]}
    assert groups["attempt.shrunk"] == groups["job.growing"] == "restart"


@pytest.mark.django_db
def test_a_rigid_job_waits_for_all_its_gpus_instead(setup):
    team, user, (a, b), root = setup
    job = submit(team, user, gpus=4, max_restarts=3)
    run_pass()
    actions.do_mark_node_lost(b, now=timezone.now(), reason="heartbeat timeout")
    run_pass(now=timezone.now() + timedelta(seconds=11))
    job.refresh_from_db()
    assert job.state == "QUEUED" and "only 2 GPUs are on schedulable nodes" in job.reason
    assert not Event.objects.filter(kind="attempt.shrunk").exists()


@pytest.mark.django_db
def test_the_applier_refuses_a_size_the_job_did_not_allow(setup):
    from django.db import transaction

    team, user, (a, b), root = setup
    job = submit(team, user, gpus=4, min_gpus=2)
    gpus = list(a.gpus.order_by("index")) + list(b.gpus.order_by("index"))

    def slots(n):
        return tuple(
            Slot(g.node_id, g.id, g.index, rank, rank % 2, rank // 2)
            for rank, g in enumerate(gpus[:n])
        )

    with transaction.atomic():
        started, rejected = actions.do_start_attempts(
            [Placement(job.id, team.id, slots(3))], now=timezone.now()
        )
    assert started == {} and "a divisor of it down to 2" in rejected[job.id]
    with transaction.atomic():
        started, rejected = actions.do_start_attempts(
            [Placement(job.id, team.id, slots(2))], now=timezone.now()
        )
    assert rejected == {} and started[job.id].world_size == 2


@pytest.mark.parametrize(
    "min_gpus, message",
    [(0, "greater than or equal to 1"), (5, "must not exceed gpus (4)"), ("x", "valid integer")],
)
@pytest.mark.django_db
def test_a_bad_min_gpus_is_refused_and_creates_nothing(setup, token_for, min_gpus, message):
    team, user, _, _ = setup
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {token_for(user)}")
    before = (Job.objects.count(), Event.objects.count())
    answer = api.post(
        "/api/v1/jobs/",
        {"name": "e", "team": team.name, "image": "lockstep/trainer:latest",
         "command": ["python", "-m", "trainer"], "gpus": 4, "min_gpus": min_gpus},
        format="json",
    )  # fmt: skip
    assert answer.status_code == 400
    assert list(answer.json()) == ["min_gpus"] and message in answer.json()["min_gpus"][0]
    assert (Job.objects.count(), Event.objects.count()) == before


@pytest.mark.django_db
def test_min_gpus_round_trips_through_the_api(setup, token_for):
    team, user, _, _ = setup
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {token_for(user)}")
    answer = api.post(
        "/api/v1/jobs/",
        {"name": "e", "team": team.name, "image": "lockstep/trainer:latest",
         "command": ["python", "-m", "trainer"], "gpus": 4, "min_gpus": 2},
        format="json",
    )  # fmt: skip
    assert answer.status_code == 201, answer.content
    assert answer.json()["min_gpus"] == 2
    assert Job.objects.get(pk=answer.json()["id"]).min_gpus == 2


def test_a_shrunk_attempt_sizes_its_global_batch_for_the_jobs_full_size(monkeypatch):
    from trainer.train import batch_dp

    monkeypatch.setenv("LOCKSTEP_JOB_GPUS", "8")
    assert batch_dp(2, 2) == 8  # 2 of 8 GPUs: the batch of 8 data-parallel ranks
    assert batch_dp(1, 4) == 2  # tensor parallel 4 on 4 of 8 GPUs: 2 data-parallel groups
    assert batch_dp(8, 8) == 8  # full size: unchanged
    monkeypatch.setenv("LOCKSTEP_JOB_GPUS", "6")
    assert batch_dp(4, 4) == 4  # not a divisor (not an elastic size): unchanged
    monkeypatch.delenv("LOCKSTEP_JOB_GPUS")
    assert batch_dp(2, 2) == 2
