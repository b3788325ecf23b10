"""The layout as a job setting on the platform: submitted (auto by default, checked), given to
every rank as LOCKSTEP_LAYOUT, and the trainer's `layout` records shown on the attempt (API)
and the job page beside what the ranks measured, bounded whatever a worker sends."""

from __future__ import annotations

from pathlib import Path

import pytest

from jobs.models import Attempt, Event, Job
from jobs.queries import launch_spec
from jobs.scheduling.loop import run_pass
from nodeagent.contract import build_worker_env
from tests.heartbeats import beat, live_attempt, submit

MiB = 1 << 20


def _layout_record(rank: int, weights: int, **extra) -> dict:
    return {
        "kind": "layout",
        "rank": rank,
        "step": 1,
        "layout": {
            "how": "auto",
            "pp": 2,
            "dp": 2,
            "tp": 1,
            "zero": 0,
            "mode": "ddp",
            "pp_schedule": "1f1b",
            "micro_batches": 4,
            "global_batch": 32,
            "predicted_bytes": {"weights": 4 * MiB, "total": 20 * MiB},
            "predicted_resident_bytes": {
                "weights": 4 * MiB,
                "grads": 4 * MiB,
                "optimizer": 8 * MiB,
            },
            "predicted_time": {
                "compute_s": 0.02,
                "exposed_comm_s": 0.004,
                "bubble_s": 0.005,
                "comm_s": 0.01,
                "total_s": 0.029,
            },  # fmt: skip
            "hardware": "CPU (2 cores, 4 ranks), gloo",
            "reasons": ["pp 2 x dp 2 x tp 1 fits", "x" * 5000],
            **extra,
        },
        "measured_bytes": {"weights": weights, "grads": 4 * MiB, "optimizer": 8 * MiB},
    }


@pytest.mark.django_db
def test_layout_is_a_checked_job_setting_given_to_every_rank(setup, client):
    team, user, (a, _), _ = setup
    client.force_login(user)
    body = {"name": "l", "team": "lab", "image": "lockstep/trainer:latest",
            "command": ["python", "-m", "trainer"], "gpus": 2}  # fmt: skip
    bad = client.post(
        "/api/v1/jobs/", {**body, "layout": "fastest"}, content_type="application/json"
    )
    assert bad.status_code == 400 and "layout" in bad.json(), bad.content
    assert not Job.objects.exists()
    default = client.post("/api/v1/jobs/", body, content_type="application/json").json()
    assert default["layout"] == "auto"
    flags = client.post(
        "/api/v1/jobs/", {**body, "layout": "flags"}, content_type="application/json"
    )
    assert flags.json()["layout"] == "flags"

    run_pass()
    for job in Job.objects.all():
        attempt = live_attempt(job)
        node = attempt.allocations.first().node
        spec = launch_spec(attempt, node)
        assert spec["layout"] == job.layout
        env = build_worker_env(spec, spec["ranks"][0], attempt_id=attempt.id,
                         metrics_path=Path("/tmp/m.jsonl"), gpu_kind="cpu",
                         base_env={"LOCKSTEP_LAYOUT": "flags"})  # fmt: skip
        # A contract variable: what the portal says, not what the agent's environment had.
        assert env["LOCKSTEP_LAYOUT"] == job.layout


@pytest.mark.django_db
def test_the_trainers_layout_record_shows_on_the_attempt_and_the_job_page(setup, client):
    team, user, (a, b), _ = setup
    job = submit(team, user)
    run_pass()
    attempt = live_attempt(job)
    beat(a, attempt, {0: None, 1: None}, records=[_layout_record(0, 4 * MiB)])
    # Rank 3 holds more (the last stage's head): the largest is what is compared.
    beat(b, attempt, {2: None, 3: None}, records=[_layout_record(3, 5 * MiB)])
    attempt = Attempt.objects.get(pk=attempt.pk)
    chosen = attempt.layout["chosen"]
    assert (chosen["pp"], chosen["dp"], chosen["mode"]) == (2, 2, "ddp")
    assert attempt.layout["measured_max"]["weights"] == 5 * MiB
    assert attempt.layout["ranks"] == 2
    # A worker's text is cut, not stored whole.
    assert max(len(r) for r in chosen["reasons"]) <= 300
    (event,) = Event.objects.filter(job=job, kind="attempt.layout")
    assert event.message.startswith("layout (auto): pp 2 x dp 2 x tp 1, ddp; predicted 20.0 MiB")

    client.force_login(user)
    api = client.get(f"/api/v1/jobs/{job.id}/").json()
    assert api["attempts"][0]["layout"]["chosen"]["pp_schedule"] == "1f1b"
    page = client.get(f"/jobs/{job.id}/").content.decode()
    assert 'id="layout"' in page and "pp 2 × dp 2 × tp 1" in page
    # Weights: predicted 4 MiB, the largest rank 5 MiB: the ratio is shown.
    assert "4.00 MiB" in page and "5.00 MiB" in page and "1.25" in page
    assert "1f1b schedule, 4 micro-batches" in page


@pytest.mark.django_db
def test_an_interleaved_layout_shows_its_stages_per_rank(setup, client):
    team, user, (a, b), _ = setup
    job = submit(team, user)
    run_pass()
    attempt = live_attempt(job)
    interleaved = {"pp_schedule": "interleaved", "stages_per_rank": 2}
    beat(a, attempt, {0: None, 1: None}, records=[_layout_record(0, 4 * MiB, **interleaved)])
    chosen = Attempt.objects.get(pk=attempt.pk).layout["chosen"]
    assert (chosen["pp_schedule"], chosen["stages_per_rank"]) == ("interleaved", 2)
    client.force_login(user)
    page = client.get(f"/jobs/{job.id}/").content.decode()
    assert "interleaved (2 stages per rank) schedule, 4 micro-batches" in page


@pytest.mark.django_db
def test_a_script_without_layout_records_has_no_layout_section(setup, client):
    team, user, (a, _), _ = setup
    job = submit(team, user, gpus=2)
    run_pass()
    beat(a, live_attempt(job), {0: None, 1: None},
         records=[{"kind": "layout", "rank": 0, "layout": "not an object"}])  # fmt: skip
    client.force_login(user)
    page = client.get(f"/jobs/{job.id}/").content.decode()
    assert 'id="layout"' not in page
