"""The researcher's pages through Django's test client: each shows its user's data and hides
other teams', resubmit and saved specs prefill the form with errors next to fields, and the
metrics API serves step ranges and min/max-preserving downsamples."""

import json
from datetime import timedelta

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.utils import timezone
from rest_framework.test import APIClient

from jobs import actions
from jobs.metrics_query import metric_series
from jobs.models import Attempt, Checkpoint, Event, Job, MetricPoint, ModelVersion

pytestmark = pytest.mark.django_db


def _job(team, owner, *, name="run", gpus=1, state=None, **fields):
    job = actions.do_submit_job(
        owner=owner,
        team=team,
        now=timezone.now(),
        name=name,
        image="lockstep/trainer:latest",
        command=["python", "-m", "trainer", "--steps", "300"],
        dataset="synthetic://addition",
        gpus=gpus,
        **fields,
    )
    if state:
        Job.objects.filter(pk=job.pk).update(state=state)
        job.refresh_from_db()
    return job


def _attempt(job, number=1, *, start=None, end=None, state="running", last_step=0):
    start = start or timezone.now() - timedelta(minutes=10)
    return Attempt.objects.create(
        job=job,
        number=number,
        state=state,
        master_addr="127.0.0.1",
        master_port=29400 + number,
        created_at=start,
        running_at=start,
        ended_at=end,
        last_step=last_step,
    )


def _points(job, attempt, values, *, name="loss", rank=0, first_step=0):
    now = timezone.now()
    MetricPoint.objects.bulk_create(
        [
            MetricPoint(
                job=job,
                attempt=attempt,
                rank=rank,
                step=first_step + i,
                name=name,
                value=v,
                time=now,
            )
            for i, v in enumerate(values)
        ],
        batch_size=5000,
    )


@pytest.fixture
def two_teams(make_team, make_user):
    lab, other = make_team("lab", quota=4, borrow_limit=2), make_team("other", quota=4)
    ann, bob = make_user("ann", team=lab), make_user("bob", team=other)
    return lab, ann, other, bob


def _client(client, user):
    client.force_login(user)
    return client


def test_home_lists_my_teams_jobs_with_reason_queue_position_and_quota_use(client, two_teams):
    lab, ann, other, bob = two_teams
    soon = timezone.now() + timedelta(minutes=20)
    mine = _job(lab, ann, name="mine-queued", gpus=2)
    Job.objects.filter(pk=mine.pk).update(
        reason="team lab at quota 4/4; 1 job(s) ahead", estimated_start_at=soon
    )
    earlier = _job(other, bob, name="theirs-queued")
    Job.objects.filter(pk=earlier.pk).update(estimated_start_at=soon - timedelta(minutes=5))
    running = _job(lab, ann, name="mine-running", state="RUNNING")
    Job.objects.filter(pk=running.pk).update(first_started_at=timezone.now() - timedelta(hours=1))
    _attempt(running, start=timezone.now() - timedelta(hours=1), last_step=10)

    html = _client(client, ann).get("/").content.decode()
    assert "mine-queued" in html and "mine-running" in html
    assert "theirs-queued" not in html
    assert "team lab at quota 4/4; 1 job(s) ahead" in html
    # Second in the cluster's estimated start order: the other team's job starts first.
    assert f'<tr data-job="{mine.id}">' in html
    row = html.split(f'<tr data-job="{mine.id}">')[1].split("</tr>")[0]
    assert '<td data-label="Queue" class="position">#2</td>' in row
    assert "(in 1" in row  # estimated start, "in 19 minutes"
    running_row = html.split(f'<tr data-job="{running.id}">')[1].split("</tr>")[0]
    assert "1.0 h" in running_row or "60.0 min" in running_row
    assert 'data-team="lab"' in html and 'data-team="other"' not in html


def test_another_teams_job_its_spec_and_weights_are_404(client, two_teams):
    lab, ann, other, bob = two_teams
    theirs = _job(other, bob, name="secret")
    c = _client(client, ann)
    assert c.get(f"/jobs/{theirs.id}/").status_code == 404
    assert c.get(f"/jobs/{theirs.id}/spec/").status_code == 404
    assert c.get("/jobs/999999/").status_code == 404
    assert c.get(f"/api/v1/jobs/{theirs.id}/gpus/").status_code == 404
    assert c.get(f"/api/v1/jobs/{theirs.id}/metrics/?name=loss").status_code == 404
    # Resubmitting from it prefills nothing of it.
    html = c.get(f"/jobs/new/?from={theirs.id}").content.decode()
    assert "secret" not in html


def test_resubmit_prefills_every_field_from_the_previous_job(client, two_teams):
    lab, ann, _, _ = two_teams
    job = _job(
        lab,
        ann,
        name="sweep-7",
        gpus=2,
        priority="high",
        max_restarts=5,
        checkpoint_interval_s=600,
        time_limit_s=7200,
        env={"WANDB_MODE": "offline"},
    )
    page = _client(client, ann).get(f"/jobs/new/?from={job.id}")
    form = page.context["form"]
    assert form["name"].value() == "sweep-7"
    assert form["command"].value() == "python -m trainer --steps 300"
    assert form["gpus"].value() == "2"
    assert form["priority"].value() == "high"
    assert form["checkpoint_interval_s"].value() == "600"
    assert json.loads(form["env"].value()) == {"WANDB_MODE": "offline"}
    assert "Prefilled from" in page.content.decode()
    # The job page links to it and offers the spec as a file.
    assert f'href="/jobs/new/?from={job.id}"' in client.get(f"/jobs/{job.id}/").content.decode()
    spec = client.get(f"/jobs/{job.id}/spec/")
    assert spec["Content-Disposition"].startswith("attachment")
    assert json.loads(spec.content)["command"] == ["python", "-m", "trainer", "--steps", "300"]


def test_submit_form_takes_every_job_field(client, two_teams, make_nodes):
    lab, ann, _, _ = two_teams
    make_nodes(1, 4)
    response = _client(client, ann).post(
        "/jobs/new/",
        {
            "name": "full",
            "team": "lab",
            "image": "lockstep/trainer:latest",
            "command": "python -m trainer --steps 10",
            "dataset": "synthetic://addition",
            "gpus": "2",
            "priority": "low",
            "max_restarts": "1",
            "checkpoint_interval_s": "120",
            "time_limit_s": "600",
            "env": '{"A": "1"}',
            "image_pull_policy": "always",
        },
    )
    assert response.status_code == 302
    job = Job.objects.get(name="full")
    assert (job.checkpoint_interval_s, job.time_limit_s, job.env) == (120, 600, {"A": "1"})
    assert job.image_pull_policy == "always"


def test_a_pasted_or_uploaded_spec_prefills_the_form_without_submitting(
    client, two_teams, make_nodes
):
    lab, ann, _, _ = two_teams
    make_nodes(1, 4)
    c = _client(client, ann)
    spec = {
        "name": "from-spec",
        "team": "lab",
        "image": "lockstep/trainer:latest",
        "command": ["python", "-m", "trainer", "--steps", "50"],
        "gpus": 2,
        "env": {"X": "y"},
    }
    page = c.post("/jobs/new/", {"load_spec": "1", "spec_text": json.dumps(spec)})
    assert page.status_code == 200
    form = page.context["form"]
    assert form["name"].value() == "from-spec"
    assert form["command"].value() == "python -m trainer --steps 50"
    assert not Job.objects.filter(name="from-spec").exists()

    yaml_spec = (
        b"name: yaml-run\nteam: lab\nimage: lockstep/trainer:latest\n"
        b"command: python -m trainer\ngpus: 1\n"
    )
    page = c.post(
        "/jobs/new/",
        {"load_spec": "1", "spec_file": SimpleUploadedFile("run.yaml", yaml_spec)},
    )
    assert page.context["form"]["name"].value() == "yaml-run"
    assert not Job.objects.filter(name="yaml-run").exists()


def test_spec_errors_are_shown_next_to_their_fields(client, two_teams):
    lab, ann, _, _ = two_teams
    c = _client(client, ann)
    # Not JSON or YAML: the error sits with the spec field.
    page = c.post("/jobs/new/", {"load_spec": "1", "spec_text": "{name: [unclosed"})
    assert page.status_code == 400
    html = page.content.decode()
    spec_block = html.split('data-field="spec_text"')[1].split("</div>")[0]
    assert "Neither JSON" in spec_block
    # Unknown fields are named.
    page = c.post("/jobs/new/", {"load_spec": "1", "spec_text": '{"name": "x", "gpu": 2}'})
    assert "Unknown field: gpu." in page.content.decode().split('data-field="spec_text"')[1]
    # A valid spec with a bad value: the job form shows the error next to that field.
    spec = {"name": "bad", "team": "lab", "image": "img", "command": "python", "gpus": 0}
    page = c.post("/jobs/new/", {"load_spec": "1", "spec_text": json.dumps(spec)})
    assert page.status_code == 400
    gpus_block = page.content.decode().split('data-field="gpus"')[1].split("</div>")[0]
    assert "greater than or equal to 1" in gpus_block
    assert Job.objects.count() == 0


def test_metrics_step_range_returns_only_that_range(client, two_teams):
    lab, ann, _, _ = two_teams
    job = _job(lab, ann, state="RUNNING")
    attempt = _attempt(job)
    _points(job, attempt, [float(i) for i in range(1000)])
    _points(job, attempt, [float(i) for i in range(1000)], rank=1)
    data = (
        _client(client, ann)
        .get(f"/api/v1/jobs/{job.id}/metrics/?name=loss&since_step=99&until_step=199&rank=0")
        .json()
    )
    assert list(data["ranks"]) == ["0"]
    assert data["ranks"]["0"]["step"] == list(range(100, 200))
    assert data["downsampled"] == {"0": False}
    bad = client.get(f"/api/v1/jobs/{job.id}/metrics/?name=loss&until_step=x")
    assert bad.status_code == 400 and "until_step" in bad.json()


def test_downsampling_keeps_each_buckets_min_and_max_in_step_order(two_teams):
    lab, ann, _, _ = two_teams
    job = _job(lab, ann, state="RUNNING")
    attempt = _attempt(job)
    values = [1.0 + (i % 7) * 0.01 for i in range(20_000)]
    values[12_345] = 50.0  # a spike
    values[4_321] = -3.0  # a dip
    _points(job, attempt, values)
    series = metric_series(job.id, "loss", max_points=200)["ranks"]["0"]
    assert len(series["step"]) <= 200
    assert 50.0 in series["value"] and -3.0 in series["value"]
    # Each extreme sits in its own bucket (256 steps wide here: about a pixel on a chart).
    assert abs(series["step"][series["value"].index(50.0)] - 12_345) < 256
    assert abs(series["step"][series["value"].index(-3.0)] - 4_321) < 256
    assert series["step"] == sorted(series["step"])
    # A falling curve stays a falling line (no zigzag from the min/max pairs).
    _points(job, attempt, [1000.0 - i * 0.01 for i in range(20_000)], name="falling")
    falling = metric_series(job.id, "falling", max_points=200)["ranks"]["0"]["value"]
    assert falling == sorted(falling, reverse=True) and len(falling) <= 200
    # A short rank beside the long one comes back whole, not bucketed.
    _points(job, attempt, [2.0, 3.0, 2.5], rank=1)
    both = metric_series(job.id, "loss", max_points=200)
    assert both["ranks"]["1"] == {"step": [0, 1, 2], "value": [2.0, 3.0, 2.5]}
    assert both["downsampled"] == {"0": True, "1": False}
    assert both["ranks"]["0"] == series
    # Within a zoomed range the points come back raw when they fit.
    zoomed = metric_series(job.id, "loss", since_step=12_300, until_step=12_399, max_points=200)
    assert zoomed["ranks"]["0"]["step"] == list(range(12_301, 12_400))
    assert zoomed["downsampled"]["0"] is False


def test_a_job_wider_than_the_live_cap_tells_its_page_to_fetch_the_other_ranks(
    client, two_teams, settings
):
    lab, ann, _, _ = two_teams
    settings.LOCKSTEP = {**settings.LOCKSTEP, "LIVE_RANKS_MAX": 1, "LIVE_REFRESH_S": 5.0}
    job = _job(lab, ann, name="wide", gpus=2, state="RUNNING")
    _attempt(job, 1, start=timezone.now() - timedelta(minutes=5))
    html = _client(client, ann).get(f"/jobs/{job.id}/").content.decode()
    data = json.loads(html.split('id="job-data" type="application/json">')[1].split("</script>")[0])
    assert data["ranks"] == 2
    assert data["live_all_ranks"] is False and data["live_refresh_s"] == 5.0


def test_job_page_has_timeline_checkpoints_logs_and_goodput(client, two_teams, tmp_path):
    lab, ann, _, _ = two_teams
    job = _job(lab, ann, name="tl", gpus=2, state="RUNNING")
    now = timezone.now()
    first = _attempt(
        job, 1, start=now - timedelta(minutes=30), end=now - timedelta(minutes=20), state="failed"
    )
    Attempt.objects.filter(pk=first.pk).update(end_reason="rank 1 exited with code 1")
    second = _attempt(job, 2, start=now - timedelta(minutes=19), last_step=120)
    Checkpoint.objects.create(
        job=job,
        attempt=second,
        step=100,
        path=str(tmp_path / "c100"),
        bytes=5_000_000,
        save_s=0.4,
        created_at=now,
    )
    # A failed attempt is a failure on the timeline; a straggler is a warning (the attempt
    # goes on), not a red mark on a healthy job.
    Event.objects.create(job=job, attempt=first, kind="attempt.failed", message="rank 1 exited")
    Event.objects.create(job=job, attempt=second, kind="attempt.straggler", message="rank 0 slow")
    html = _client(client, ann).get(f"/jobs/{job.id}/").content.decode()
    data = json.loads(html.split('id="job-data" type="application/json">')[1].split("</script>")[0])
    groups = {e["kind"]: e["group"] for e in data["timeline"]["events"]}
    assert groups["attempt.failed"] == "failure" and groups["attempt.straggler"] == "warning"
    assert [a["number"] for a in data["timeline"]["attempts"]] == [1, 2]
    assert data["timeline"]["attempts"][0]["reason"] == "rank 1 exited with code 1"
    assert data["ranks"] == 2 and data["max_points"] == 2000
    # Two ranks are under LIVE_RANKS_MAX: every rank comes live, nothing is fetched on a timer.
    assert data["live_all_ranks"] is True and data["live_refresh_s"] == 15.0
    assert 'id="timeline-chart"' in html and 'id="step-time-chart"' in html
    assert 'id="gpu-util-chart"' in html and 'id="gpu-mem-chart"' in html
    assert "4.8\xa0MB" in html and 'name="notes"' in html
    assert '<option value="1">1</option>' in html  # logs: one choice per rank
    assert 'id="cancel"' in html and "Effective training time" in html


def test_job_page_says_which_signals_judge_an_attempts_progress(client, two_teams):
    lab, ann, _, _ = two_teams
    job = _job(lab, ann, name="plain", gpus=2, state="RUNNING")
    now = timezone.now()
    stepping = _attempt(job, 1, start=now - timedelta(minutes=30), last_step=42)
    Attempt.objects.filter(pk=stepping.pk).update(
        first_step_at=now - timedelta(minutes=29), ended_at=now - timedelta(minutes=20)
    )
    silent = _attempt(job, 2, start=now - timedelta(minutes=19))
    seen = now.replace(hour=13, minute=14, second=15)
    Attempt.objects.filter(pk=silent.pk).update(last_activity_at=seen)
    html = _client(client, ann).get(f"/jobs/{job.id}/").content.decode()
    rows = html.split('<table id="attempts"')[1].split("</table>")[0].split("<tr>")[1:]
    assert '<td data-label="Last step">42</td>' in rows[0]
    judged = "judged by output, logged scalars, CPU use and stack changes, last seen 13:14:15"
    assert judged in rows[1]
    assert html.count("no steps reported") == 1


def test_gpu_telemetry_api_lists_the_live_attempts_gpus(client, two_teams, make_nodes):
    lab, ann, _, _ = two_teams
    node = make_nodes(1, 2, prefix="tele")[0]
    node.telemetry = [{"index": 1, "kind": "cuda", "util": 87.0, "mem_used": 5, "mem_total": 10}]
    node.save()
    job = _job(lab, ann, state="RUNNING")
    attempt = _attempt(job)
    gpu = node.gpus.get(index=1)
    attempt.allocations.create(
        gpu=gpu, node=node, rank=0, local_rank=0, group_rank=0, claimed_at=timezone.now()
    )
    data = _client(client, ann).get(f"/api/v1/jobs/{job.id}/gpus/").json()
    assert data["attempt"] == 1
    assert data["gpus"][0] | {"at": None} == {
        "rank": 0,
        "node": "tele-0",
        "gpu": 1,
        "kind": "cuda",
        "util": 87.0,
        "mem_used": 5,
        "mem_total": 10,
        "at": None,
    }


def test_model_registry_shows_lineage_notes_and_serves_exported_weights(
    client, two_teams, tmp_path
):
    lab, ann, other, bob = two_teams
    job = _job(lab, ann, name="gpt-small", state="SUCCEEDED")
    attempt = _attempt(job, state="succeeded", end=timezone.now(), last_step=300)
    # What the attempt ran, as the agent reported it: the lineage names it.
    digest = "sha256:" + "ab" * 32
    Attempt.objects.filter(pk=attempt.pk).update(image_digest=digest)
    _points(job, attempt, [0.5], first_step=300)
    ckpt = Checkpoint.objects.create(
        job=job, attempt=attempt, step=300, path=str(tmp_path / "c"), created_at=timezone.now()
    )
    c = _client(client, ann)
    response = c.post(
        f"/checkpoints/{ckpt.id}/register/", {"name": "adder", "notes": "best so far"}
    )
    assert response.status_code == 302
    version = ModelVersion.objects.get(name="adder")
    html = c.get("/models/").content.decode()
    for text in ("adder", "v1", "job", "gpt-small", "synthetic://addition", "python -m trainer"):
        assert text in html
    assert "best so far" in html and "loss = 0.5000" in html and digest in html
    api = APIClient()
    api.force_authenticate(ann)
    (listed,) = api.get("/api/v1/models/").json()["results"]
    assert listed["lineage"]["image_digest"] == digest
    assert listed["lineage"]["dataset_location"] == attempt.dataset_location
    assert c.get(f"/models/{version.id}/weights/").status_code == 404  # not exported yet
    weights = tmp_path / "state_dict.pt"
    weights.write_bytes(b"weights")
    actions.do_finish_model_export(version, path=str(weights))
    download = c.get(f"/models/{version.id}/weights/")
    assert download.status_code == 200 and b"".join(download.streaming_content) == b"weights"
    assert "adder-v1-state_dict.pt" in download["Content-Disposition"]
    client.force_login(bob)
    assert client.get(f"/models/{version.id}/weights/").status_code == 404
    assert "adder" not in client.get("/models/").content.decode()


def test_register_with_a_bad_name_says_why_on_the_job_page(client, two_teams, tmp_path):
    lab, ann, _, _ = two_teams
    job = _job(lab, ann, state="RUNNING")
    attempt = _attempt(job)
    ckpt = Checkpoint.objects.create(
        job=job, attempt=attempt, step=10, path=str(tmp_path / "c"), created_at=timezone.now()
    )
    response = _client(client, ann).post(
        f"/checkpoints/{ckpt.id}/register/", {"name": "bad name!"}, follow=True
    )
    assert "not registered: Use letters, digits" in response.content.decode()
    assert not ModelVersion.objects.exists()


def test_cluster_grid_colours_gpus_by_team_and_names_only_visible_jobs(
    client, two_teams, make_nodes
):
    lab, ann, other, bob = two_teams
    node = make_nodes(1, 4, prefix="grid")[0]
    for team, owner, name, index in ((lab, ann, "ours", 0), (other, bob, "theirs", 1)):
        job = _job(team, owner, name=name, state="RUNNING")
        attempt = _attempt(job)
        attempt.allocations.create(
            gpu=node.gpus.get(index=index),
            node=node,
            rank=0,
            local_rank=0,
            group_rank=0,
            claimed_at=timezone.now(),
        )
    html = _client(client, ann).get("/cluster/").content.decode()
    assert "job " in html and "ours (lab), rank 0" in html
    assert "theirs" not in html and "in use by another team" in html
    assert html.count('class="gpu busy') == 2 and "2 of 4 GPUs busy" in html
    assert 'data-node="grid-0"' in html


def test_the_cached_overview_follows_a_growing_run_and_a_restart(two_teams):
    from django.core.cache import cache
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    lab, ann, _, _ = two_teams
    job = _job(lab, ann, state="RUNNING")
    now = timezone.now()
    first = _attempt(job, 1, start=now - timedelta(hours=1), end=now - timedelta(minutes=30))
    _points(job, first, [float(i % 50) for i in range(10_000)])
    metric_series(job.id, "loss", max_points=200)
    # The run grows: only the open buckets are read again, and the answer is the same as
    # one computed from scratch.
    _points(job, first, [float(i % 50) for i in range(2_000)], first_step=10_000)
    MetricPoint.objects.filter(job=job, step=11_000).update(value=999.0)
    grown = metric_series(job.id, "loss", max_points=200)
    assert 999.0 in grown["ranks"]["0"]["value"] and max(grown["ranks"]["0"]["step"]) == 11_999
    cache.clear()
    assert metric_series(job.id, "loss", max_points=200) == grown
    # The span doubles: the cached buckets merge in pairs into the wider grid.
    _points(job, first, [float(i % 30) for i in range(8_000)], first_step=12_000)
    with CaptureQueriesContext(connection) as queries:
        doubled = metric_series(job.id, "loss", max_points=200)
    grouped = [q["sql"] for q in queries if "GROUP BY" in q["sql"] and "metricpoint" in q["sql"]]
    assert len(grouped) == 1 and '"step" >= 11' in grouped[0]  # only the open buckets
    cache.clear()
    assert metric_series(job.id, "loss", max_points=200) == doubled
    assert 999.0 in doubled["ranks"]["0"]["value"]
    # A new attempt writes steps again from its checkpoint: the cache starts afresh.
    second = _attempt(job, 2, start=now)
    _points(job, second, [-50.0], first_step=500)
    restarted = metric_series(job.id, "loss", max_points=200)
    assert -50.0 in restarted["ranks"]["0"]["value"]
