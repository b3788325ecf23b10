"""User-supplied strings never become paths outside Lockstep's roots: a model name that tries
to climb out is refused by the API and, were one stored anyway, not exported outside
MODEL_ROOT; a job name past its length is a 400 on the field that creates nothing."""

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from jobs import actions
from jobs.models import Event, Job, ModelVersion
from jobs.tasks import export_model_version
from tests.heartbeats import beat, commit_checkpoint, live_attempt, submit


@pytest.fixture
def checkpoint(setup, token_for):
    from jobs.models import Checkpoint
    from jobs.scheduling.loop import run_pass

    team, ann, (a, b), root = setup
    job = submit(team, ann, gpus=2)
    run_pass()
    attempt = live_attempt(job)
    beat(a, attempt, {0: None, 1: None}, records=[commit_checkpoint(root, job, 10)])
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {token_for(ann)}")
    return Checkpoint.objects.get(job=job), api, ann


@pytest.mark.django_db
@pytest.mark.parametrize("name", ["../../etc", "a/../../b", "..", "/abs", "x" * 101])
def test_a_model_name_that_could_escape_is_a_400_and_registers_nothing(checkpoint, name):
    ckpt, api, _ = checkpoint
    events = Event.objects.count()
    response = api.post("/api/v1/models/", {"name": name, "checkpoint": ckpt.id}, format="json")
    assert response.status_code == 400 and "name" in response.json()
    assert ModelVersion.objects.count() == 0 and Event.objects.count() == events


@pytest.mark.django_db
def test_an_unsafe_stored_model_name_is_not_exported_outside_the_model_root(
    checkpoint, settings, tmp_path
):
    ckpt, _, ann = checkpoint
    settings.LOCKSTEP = {**settings.LOCKSTEP, "MODEL_ROOT": str(tmp_path / "models")}
    version = actions.do_register_model_version(
        name="ok", checkpoint=ckpt, actor=ann, now=timezone.now()
    )
    ModelVersion.objects.filter(pk=version.pk).update(name="../../escaped")
    assert export_model_version(version.pk) is None
    assert not (tmp_path / "escaped").exists()
    assert ModelVersion.objects.get(pk=version.pk).export_state == "failed"


@pytest.mark.django_db
def test_a_job_name_past_100_characters_is_a_400_and_creates_nothing(checkpoint):
    _, api, _ = checkpoint
    jobs, events = Job.objects.count(), Event.objects.count()
    body = {
        "name": "n" * 101,
        "team": "lab",
        "image": "lockstep/trainer:latest",
        "command": ["python", "-m", "trainer"],
        "gpus": 1,
    }
    response = api.post("/api/v1/jobs/", body, format="json")
    assert response.status_code == 400 and "100 characters" in response.json()["name"][0]
    assert (Job.objects.count(), Event.objects.count()) == (jobs, events)
