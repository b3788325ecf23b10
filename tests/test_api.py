"""REST API v1: submit, bad input, tenancy, tokens, and the management command."""

import io

import pytest
from django.core.management import call_command
from rest_framework.test import APIClient

from jobs.models import Event, Job, Node
from jobs.scheduling.loop import run_pass
from teams.actions import do_add_member
from teams.models import ApiToken, Team
from tests.heartbeats import beat, live_attempt

GOOD = {
    "name": "gpt-small",
    "team": "nlp",
    "image": "lockstep/trainer:latest",
    "command": ["python", "-m", "trainer"],
    "dataset": "synthetic://addition",
    "gpus": 4,
}


@pytest.fixture
def nlp(make_team, make_user, make_nodes, token_for):
    team = make_team("nlp", quota=8)
    user = make_user("alice", team=team)
    make_nodes(2, 4)  # 8 GPUs in the cluster
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token_for(user)}")
    return team, user, client


@pytest.mark.django_db
def test_submit_creates_a_queued_job_with_an_event(nlp):
    team, user, client = nlp
    response = client.post("/api/v1/jobs/", GOOD, format="json")
    assert response.status_code == 201, response.content
    job = Job.objects.get(pk=response.json()["id"])
    assert (job.state, job.team, job.owner, job.command) == (
        "QUEUED",
        team,
        user,
        ["python", "-m", "trainer"],
    )
    assert Event.objects.filter(job=job, kind="job.submitted").count() == 1
    listed = client.get("/api/v1/jobs/?state=queued").json()
    assert [j["id"] for j in listed["results"]] == [job.id]


@pytest.mark.django_db
def test_the_job_list_filters_by_owner_and_mine(nlp, make_user, token_for):
    team, alice, client = nlp
    bob = make_user("bob", team=team)
    bobs = APIClient()
    bobs.credentials(HTTP_AUTHORIZATION=f"Bearer {token_for(bob)}")
    ids = {}
    for who, api in (("alice", client), ("bob", bobs), ("alice2", client)):
        ids[who] = api.post("/api/v1/jobs/", GOOD, format="json").json()["id"]

    def listed(api, query):
        return {j["id"] for j in api.get(f"/api/v1/jobs/?{query}").json()["results"]}

    assert listed(client, "") == set(ids.values())  # the whole team's
    assert listed(client, "owner=@me") == {ids["alice"], ids["alice2"]}
    assert listed(bobs, "owner=@me") == {ids["bob"]}
    assert listed(client, "owner=bob") == {ids["bob"]}
    assert listed(client, "owner=nobody") == set()


@pytest.mark.django_db
def test_a_member_of_one_team_may_leave_the_team_out_and_a_member_of_two_may_not(
    nlp, make_team, make_user, token_for
):
    team, _, client = nlp
    without = {k: v for k, v in GOOD.items() if k != "team"}
    response = client.post("/api/v1/jobs/", without, format="json")
    assert response.status_code == 201, response.content
    assert response.json()["team"] == "nlp" and Job.objects.get().team == team

    vision = make_team("vision", quota=8)
    both = make_user("bob", team=team)
    do_add_member(vision, both, role="member")  # bob joins a second team
    other = APIClient()
    other.credentials(HTTP_AUTHORIZATION=f"Bearer {token_for(both)}")
    response = other.post("/api/v1/jobs/", without, format="json")
    assert response.status_code == 400
    assert response.json()["team"] == ["This field is required: you are in teams nlp, vision."]
    loner = APIClient()
    loner.credentials(HTTP_AUTHORIZATION=f"Bearer {token_for(make_user('carol'))}")
    response = loner.post("/api/v1/jobs/", without, format="json")
    assert response.status_code == 400
    assert response.json()["team"] == ["This field is required: you are a member of no team."]
    assert Job.objects.count() == 1


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("change", "field", "message"),
    [
        ({"gpus": 0}, "gpus", "greater than or equal to 1"),
        ({"gpus": 9}, "gpus", "The cluster has 8 GPUs; this job asks for 9."),
        ({"command": "python train.py"}, "command", "non-empty list of strings"),
        ({"command": ["python", 3]}, "command", "Command item 1 is int, not a string."),
        ({"command": []}, "command", "non-empty list of strings"),
        ({"team": "nope"}, "team", "Unknown team 'nope'."),
        ({"image": "Not An Image!"}, "image", "container image reference"),
        ({"dataset": "ftp://x/y"}, "dataset", "does not serve ftp:// datasets"),
        # Schemes no node reads are refused at submit, not failed three times at start.
        ({"dataset": "s3://bucket/corpus"}, "dataset", "does not serve s3:// datasets"),
        ({"dataset": "hf://org/set"}, "dataset", "use one of synthetic://, file://"),
        ({"dataset": "nfs://filer/x"}, "dataset", "does not serve nfs://"),
        ({"dataset": "file://../etc/passwd"}, "dataset", "absolute path without '..'"),
        ({"dataset": "file:///data/../etc/shadow"}, "dataset", "absolute path without '..'"),
        ({"env": {"RANK": "3"}}, "env", "set by Lockstep's launch contract"),
        ({"env": {"1BAD": "x"}}, "env", "not a valid environment variable name"),
        ({"name": ""}, "name", "may not be blank"),
        ({"priority": "whenever"}, "priority", "not a valid choice"),
    ],
)
def test_bad_input_is_a_400_with_a_message_on_the_field_and_creates_nothing(
    nlp, change, field, message
):
    _, _, client = nlp
    events_before = Event.objects.count()
    response = client.post("/api/v1/jobs/", {**GOOD, **change}, format="json")
    assert response.status_code == 400
    errors = response.json()
    assert field in errors, errors
    assert any(message in m for m in errors[field]), errors[field]
    assert Job.objects.count() == 0
    assert Event.objects.count() == events_before


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("change", "field", "message"),
    [
        ({"image": "docker.io/library/python:3.11"}, "image", "docker.io are not allowed"),
        ({"image": "python:3.11"}, "image", "docker.io are not allowed"),  # Docker Hub's
        ({"image": "evil.example.com/x:1"}, "image", "use one of the registries"),
        (
            {"dataset": "file:///home/alice/corpus.txt", "image": "localhost/trainer:1"},
            "dataset",
            "not on shared storage",
        ),
    ],
)
def test_what_the_cluster_does_not_serve_is_refused_at_submit(
    nlp, settings, change, field, message
):
    _, _, client = nlp
    settings.LOCKSTEP = {
        **settings.LOCKSTEP,
        "IMAGE_REGISTRIES": ["registry.example.org", "localhost"],
        "DATASET_ROOTS": ["/shared/datasets"],
    }
    response = client.post("/api/v1/jobs/", {**GOOD, **change}, format="json")
    assert response.status_code == 400, response.content
    assert any(message in m for m in response.json()[field]), response.json()
    assert Job.objects.count() == 0
    accepted = {
        **GOOD,
        "image": "registry.example.org/nlp/trainer:2",
        "dataset": "file:///shared/datasets/corpus.txt",
    }
    assert client.post("/api/v1/jobs/", accepted, format="json").status_code == 201


@pytest.mark.django_db
def test_several_bad_fields_are_reported_together(nlp):
    _, _, client = nlp
    bad = {**GOOD, "gpus": 0, "command": "rm -rf /", "team": "ghosts"}
    errors = client.post("/api/v1/jobs/", bad, format="json").json()
    assert {"gpus", "command", "team"} <= set(errors)
    assert Job.objects.count() == 0


@pytest.mark.django_db
def test_gpus_above_the_team_cap_is_refused(nlp, make_team, make_user, token_for):
    small = make_team("small", quota=2)
    bob = make_user("bob", team=small)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token_for(bob)}")
    response = client.post("/api/v1/jobs/", {**GOOD, "team": "small", "gpus": 4}, format="json")
    assert response.status_code == 400
    assert "Team small may use at most 2 GPUs" in response.json()["gpus"][0]


@pytest.mark.django_db
def test_other_teams_jobs_are_404_everywhere_and_not_listed(nlp, make_team, make_user, token_for):
    _, _, alice = nlp
    job_id = alice.post("/api/v1/jobs/", GOOD, format="json").json()["id"]
    mallory = make_user("mallory", team=make_team("other", quota=4))
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token_for(mallory)}")
    for path in ("", "metrics/", "checkpoints/", "events/", "logs/"):
        theirs = client.get(f"/api/v1/jobs/{job_id}/{path}")
        missing = client.get(f"/api/v1/jobs/999999/{path}")
        assert theirs.status_code == missing.status_code == 404
        assert theirs.json() == missing.json()
    assert client.post(f"/api/v1/jobs/{job_id}/cancel/").status_code == 404
    assert client.get("/api/v1/jobs/").json()["count"] == 0
    assert Job.objects.get(pk=job_id).state == "QUEUED"
    # Nor can mallory submit into alice's team.
    response = client.post("/api/v1/jobs/", GOOD, format="json")
    assert response.status_code == 400 and "Unknown team 'nlp'." in response.json()["team"]


@pytest.mark.django_db
def test_tokens_are_stored_hashed_and_revoked_tokens_fail(nlp, make_user, token_for):
    user = make_user("carol")
    raw = token_for(user)
    stored = ApiToken.objects.get(user=user)
    assert raw not in (stored.digest, stored.prefix) and len(stored.digest) == 64
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    assert client.get("/api/v1/jobs/").status_code == 200
    stored.revoked_at = stored.created_at
    stored.save()
    assert client.get("/api/v1/jobs/").status_code == 401
    client.credentials(HTTP_AUTHORIZATION="Bearer lst_made_up")
    assert client.get("/api/v1/jobs/").status_code == 401
    assert APIClient().get("/api/v1/jobs/").status_code in (401, 403)


@pytest.mark.django_db
def test_cancel_a_queued_job(nlp):
    _, _, client = nlp
    job_id = client.post("/api/v1/jobs/", GOOD, format="json").json()["id"]
    response = client.post(f"/api/v1/jobs/{job_id}/cancel/")
    assert response.status_code == 200 and response.json()["state"] == "CANCELLED"
    assert Event.objects.filter(job_id=job_id, kind="job.cancelled").exists()


@pytest.mark.django_db
def test_only_leads_and_admins_change_priority(nlp, make_user, token_for):
    team, _, member = nlp
    job_id = member.post("/api/v1/jobs/", GOOD, format="json").json()["id"]
    assert (
        member.patch(f"/api/v1/jobs/{job_id}/", {"priority": "high"}, format="json").status_code
        == 403
    )
    lead = APIClient()
    lee = make_user("lee", team=team, role="lead")
    lead.credentials(HTTP_AUTHORIZATION=f"Bearer {token_for(lee)}")
    response = lead.patch(f"/api/v1/jobs/{job_id}/", {"priority": "high"}, format="json")
    assert response.status_code == 200 and response.json()["priority"] == "high"


@pytest.mark.django_db
def test_issue_token_creates_user_team_membership_and_prints_the_token_last():
    out = io.StringIO()
    call_command("issue_token", "dana", "--team", "robotics", stdout=out)
    raw = out.getvalue().strip().splitlines()[-1]
    assert raw.startswith("lst_")
    team = Team.objects.get(name="robotics")
    assert team.memberships.get().user.username == "dana"
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    assert client.get("/api/v1/jobs/").status_code == 200
    # Running it again adds a token, not a second user or membership.
    call_command("issue_token", "dana", "--team", "robotics", stdout=io.StringIO())
    assert team.memberships.count() == 1 and ApiToken.objects.count() == 2


@pytest.mark.django_db
def test_agent_endpoints_refuse_user_tokens_and_user_endpoints_refuse_node_tokens(
    nlp, settings, client
):
    _, _, alice = nlp
    settings.LOCKSTEP = {**settings.LOCKSTEP, "AGENT_TOKEN": "cluster-secret"}
    user_token = alice._credentials["HTTP_AUTHORIZATION"]
    body = {"name": "n9", "gpus": 2, "address": "127.0.0.1", "boot_id": "b"}
    assert (
        client.post(
            "/api/v1/agent/register/",
            body,
            content_type="application/json",
            HTTP_AUTHORIZATION=user_token,
        ).status_code
        == 401
    )
    registered = client.post(
        "/api/v1/agent/register/",
        body,
        content_type="application/json",
        HTTP_AUTHORIZATION="Bearer cluster-secret",
    )
    assert registered.status_code == 200
    node_token = registered.json()["node_token"]
    beat = client.post(
        "/api/v1/agent/heartbeat/",
        {"boot_id": "b", "attempts": []},
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {node_token}",
    )
    assert beat.status_code == 200 and beat.json()["desired"] == []
    stale = client.post(
        "/api/v1/agent/heartbeat/",
        {"boot_id": "old", "attempts": []},
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {node_token}",
    )
    assert stale.status_code == 409
    assert client.get("/api/v1/jobs/", HTTP_AUTHORIZATION=f"Bearer {node_token}").status_code == 401


@pytest.mark.django_db
def test_logs_give_a_cursor_to_follow_from_without_rereading(nlp):
    from django.utils import timezone

    from jobs.models import Attempt, LogChunk

    _, _, alice = nlp
    job = Job.objects.get(pk=alice.post("/api/v1/jobs/", GOOD, format="json").json()["id"])
    attempt = Attempt.objects.create(
        job=job, number=1, master_port=29500, created_at=timezone.now()
    )

    def chunk(text):
        return LogChunk.objects.create(
            attempt=attempt, rank=0, text=text, created_at=timezone.now()
        ).id

    first = chunk("a\nb")  # a chunk may end mid-line
    chunk("c\n")
    last = chunk("d")
    tail = alice.get(f"/api/v1/jobs/{job.id}/logs/?tail=2").json()
    assert (tail["lines"], tail["partial"], tail["cursor"]) == (["bc", "d"], "d", last)
    after = alice.get(f"/api/v1/jobs/{job.id}/logs/?after={first}").json()
    assert (after["text"], after["cursor"], after["lines"]) == ("c\nd", last, [])
    caught_up = alice.get(f"/api/v1/jobs/{job.id}/logs/?after={last}").json()
    assert (caught_up["text"], caught_up["cursor"]) == ("", last)
    bad = alice.get(f"/api/v1/jobs/{job.id}/logs/?after=-1")
    assert bad.status_code == 400 and "after" in bad.json()


@pytest.mark.django_db
def test_a_start_estimate_is_shown_only_while_the_job_waits(nlp):
    team, user, client = nlp
    first = client.post("/api/v1/jobs/", {**GOOD, "gpus": 8}, format="json").json()["id"]
    run_pass()
    second = client.post("/api/v1/jobs/", GOOD, format="json").json()["id"]
    run_pass()
    waiting = client.get(f"/api/v1/jobs/{second}/").json()
    assert waiting["state"] == "QUEUED" and waiting["estimated_start_at"] is not None
    attempt = live_attempt(Job.objects.get(pk=first))
    for node in Node.objects.all():
        ranks = attempt.allocations.filter(node=node).values_list("rank", flat=True)
        beat(node, attempt, dict.fromkeys(ranks, 0))
    run_pass()
    # The scheduler leaves its last estimate on the row; the API does not show it any more.
    assert Job.objects.get(pk=second).estimated_start_at is not None
    started = client.get(f"/api/v1/jobs/{second}/").json()
    listed = {j["id"]: j for j in client.get("/api/v1/jobs/").json()["results"]}
    assert started["state"] == "STARTING" and started["estimated_start_at"] is None
    assert listed[second]["estimated_start_at"] is None


@pytest.mark.django_db
def test_a_cluster_that_refuses_process_nodes_refuses_their_registration(settings, client):
    settings.LOCKSTEP = {
        **settings.LOCKSTEP,
        "AGENT_TOKEN": "cluster-secret",
        "ALLOW_PROCESS_NODES": False,
    }
    body = {"name": "laptop", "gpus": 2, "address": "127.0.0.1", "boot_id": "b"}

    def register(**extra):
        return client.post(
            "/api/v1/agent/register/",
            {**body, **extra},
            content_type="application/json",
            HTTP_AUTHORIZATION="Bearer cluster-secret",
        )

    refused = register(runtime="process")
    assert refused.status_code == 400
    assert "plain processes (not isolated)" in refused.json()["runtime"][0]
    assert not Node.objects.exists() and not Event.objects.exists()  # nothing written
    assert register().status_code == 400  # an agent that does not say is a process node
    accepted = register(runtime="container", engine="podman")
    assert accepted.status_code == 200
    node = Node.objects.get(name="laptop")
    assert (node.runtime, node.engine, node.isolated) == ("container", "podman", True)


@pytest.mark.django_db
def test_a_teams_dataset_paths_are_its_own(nlp, make_team, make_user, token_for, settings):
    team, _, alice = nlp
    settings.LOCKSTEP = {**settings.LOCKSTEP, "DATASET_ROOTS": ["/shared/datasets"]}
    admin = APIClient()
    admin.credentials(HTTP_AUTHORIZATION=f"Bearer {token_for(make_user('root', staff=True))}")
    url = f"/api/v1/teams/{team.id}/"
    bad = admin.patch(url, {"dataset_paths": ["relative/dir"]}, format="json")
    assert bad.status_code == 400 and "absolute directory path" in bad.json()["dataset_paths"][0]
    assert alice.patch(url, {"dataset_paths": ["/nlp"]}, format="json").status_code == 403
    done = admin.patch(url, {"dataset_paths": ["/nlp/corpora", "/nlp/corpora"]}, format="json")
    assert done.status_code == 200 and done.json()["dataset_paths"] == ["/nlp/corpora"]
    team.refresh_from_db()
    assert team.quota == 8  # a paths-only change leaves the quota alone
    assert Event.objects.filter(kind="team.dataset_paths_changed").count() == 1
    assert not Event.objects.filter(kind="team.quota_changed").exists()

    def submit(client, team_name, dataset):
        body = {**GOOD, "team": team_name, "gpus": 1, "dataset": dataset}
        return client.post("/api/v1/jobs/", body, format="json")

    assert submit(alice, "nlp", "file:///nlp/corpora/wiki.txt").status_code == 201
    assert submit(alice, "nlp", "file:///shared/datasets/a.txt").status_code == 201
    other = make_team("vision", quota=4)
    bob = APIClient()
    bob.credentials(HTTP_AUTHORIZATION=f"Bearer {token_for(make_user('bob', team=other))}")
    refused = submit(bob, "vision", "file:///nlp/corpora/wiki.txt")
    assert refused.status_code == 400, refused.content
    assert "under /shared/datasets" in refused.json()["dataset"][0]


@pytest.mark.django_db
def test_an_admin_can_refuse_process_runtime_nodes_for_a_team(nlp, make_user, token_for):
    team, _, alice = nlp  # nlp's two 4-GPU nodes run the process runtime (not isolated)
    admin = APIClient()
    admin.credentials(HTTP_AUTHORIZATION=f"Bearer {token_for(make_user('root', staff=True))}")
    url = f"/api/v1/teams/{team.id}/"
    assert alice.patch(url, {"isolated_only": True}, format="json").status_code == 403
    bad = admin.patch(url, {"isolated_only": "perhaps"}, format="json")
    assert bad.status_code == 400 and "isolated_only" in bad.json()
    assert not Event.objects.filter(kind="team.isolation_changed").exists()
    done = admin.patch(url, {"isolated_only": True}, format="json")
    assert done.status_code == 200 and done.json()["isolated_only"] is True
    assert done.json()["quota"] == 8  # an isolation-only change leaves the quota alone
    (event,) = Event.objects.filter(kind="team.isolation_changed")
    assert event.data == {"before": False, "after": True} and event.actor.username == "root"
    assert not Event.objects.filter(kind="team.quota_changed").exists()

    job_id = alice.post("/api/v1/jobs/", {**GOOD, "gpus": 4}, format="json").json()["id"]
    run_pass()
    job = Job.objects.get(pk=job_id)
    assert job.state == Job.State.QUEUED and job.wait["code"] == "isolation"
    assert (
        "runs on isolated (container) nodes only"
        in alice.get(f"/api/v1/jobs/{job_id}/").json()["reason"]
    )
    Node.objects.filter(name="node-1").update(runtime="container", engine="podman")
    run_pass()
    job.refresh_from_db()
    assert job.state == Job.State.STARTING
    assert set(live_attempt(job).allocations.values_list("node__name", flat=True)) == {"node-1"}
