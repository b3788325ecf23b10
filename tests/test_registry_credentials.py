"""Registry credentials per team: set by cluster admins, never shown back, handed to an agent
only in the launch spec of that team's attempt whose image is on that registry, and kept by the
agent in a file of its own for the pull (docs/runtime.md)."""

import base64
import json
import logging
import stat

import pytest
from rest_framework.test import APIClient

from jobs import queries
from jobs.models import Event
from jobs.scheduling.loop import run_pass
from nodeagent.container import Engine
from nodeagent.container_launch import ContainerLaunch
from teams.models import RegistryCredential
from tests.heartbeats import live_attempt, submit

SECRET = "s3cr3t-registry-password"


@pytest.fixture
def teams(make_team, make_user, make_nodes, token_for):
    vision, audio = make_team("vision", quota=4), make_team("audio", quota=4)
    admin = make_user("root", staff=True)
    ann = make_user("ann", team=vision)
    make_nodes(1, 4)

    def client(user):
        c = APIClient()
        c.credentials(HTTP_AUTHORIZATION=f"Bearer {token_for(user)}")
        return c

    return vision, audio, client(admin), client(ann), ann


def _url(team):
    return f"/api/v1/teams/{team.id}/registry-credentials/"


@pytest.mark.django_db
def test_admins_set_credentials_that_no_one_is_shown_back(teams):
    vision, _, admin, ann, _ = teams
    body = {"registry": "registry.example.org:5000", "username": "bot", "password": SECRET}
    refused = ann.post(_url(vision), body, format="json")
    assert refused.status_code == 403 and not RegistryCredential.objects.exists()
    created = admin.post(_url(vision), body, format="json")
    assert created.status_code == 201, created.content
    assert SECRET not in created.content.decode()
    listed = ann.get(_url(vision))  # a member sees which registries, not the secret
    assert listed.status_code == 200
    assert [(c["registry"], c["username"]) for c in listed.json()] == [
        ("registry.example.org:5000", "bot")
    ]
    assert SECRET not in listed.content.decode()
    event = Event.objects.get(kind="team.registry_credential_set")
    assert SECRET not in json.dumps([event.message, event.data])
    # Bad input: a 400 naming the field, nothing changed.
    bad = admin.post(_url(vision), {**body, "registry": "not a host!"}, format="json")
    assert bad.status_code == 400 and "registry" in bad.json()
    assert RegistryCredential.objects.get().secret == SECRET
    # Replaced, then removed.
    admin.post(_url(vision), {**body, "password": "new"}, format="json")
    assert RegistryCredential.objects.get().secret == "new"
    gone = admin.delete(_url(vision) + "?registry=registry.example.org:5000")
    assert gone.status_code == 204 and not RegistryCredential.objects.exists()
    assert admin.delete(_url(vision) + "?registry=registry.example.org:5000").status_code == 404


@pytest.mark.django_db
def test_only_the_teams_attempt_on_that_registry_carries_the_credential(teams, settings):
    vision, audio, admin, _, ann = teams
    for team in (vision, audio):
        admin.post(
            _url(team),
            {"registry": "registry.example.org", "username": team.name, "password": SECRET},
            format="json",
        )
    private = submit(vision, ann, gpus=1, image="registry.example.org/vision/trainer:3")
    public = submit(vision, ann, gpus=1, image="lockstep/trainer:latest")
    run_pass()
    node = live_attempt(private).allocations.first().node
    auth = queries.launch_spec(live_attempt(private), node)["registry_auth"]
    assert auth == {"registry": "registry.example.org", "username": "vision", "password": SECRET}
    assert "registry_auth" not in queries.launch_spec(live_attempt(public), node)
    # Nothing a researcher can read holds it: the job, its attempts and its events.
    job_json = APIClient()
    job_json.force_authenticate(ann)
    for path in (f"/api/v1/jobs/{private.id}/", f"/api/v1/jobs/{private.id}/events/"):
        assert SECRET not in job_json.get(path).content.decode()


def test_the_agent_keeps_the_credential_in_a_file_of_its_own_for_the_pull_only(tmp_path):
    launcher = ContainerLaunch(
        Engine("podman", "/usr/bin/podman"),
        node="n",
        gpu_kind="cpu",
        pull_policy="if-not-present",
        agent_env={},
        log=logging.getLogger("test"),
        auth_dir=tmp_path / "registry-auth",
    )
    auth = {"registry": "registry.example.org", "username": "bot", "password": SECRET}
    path = launcher._auth_file(7, auth)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    entry = json.loads(path.read_text())["auths"]["registry.example.org"]["auth"]
    assert base64.b64decode(entry).decode() == f"bot:{SECRET}"
    # Outside the attempt's directory, the only agent directory a container mounts.
    assert not path.is_relative_to(tmp_path / "attempt-7")
    assert launcher._auth_file(8, None) is None
