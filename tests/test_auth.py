"""Browser sessions and API tokens: an unsafe session request without the CSRF token is refused
(403) and changes nothing, with it it goes through; a token records when it was last used."""

import pytest
from django.test import Client

from jobs.models import Job

SPEC = {
    "name": "t",
    "team": "nlp",
    "image": "lockstep/trainer:latest",
    "command": ["python", "-m", "trainer"],
    "gpus": 1,
}


@pytest.mark.django_db
def test_a_session_post_needs_the_csrf_token(make_team, make_user, make_nodes):
    make_user("sam", team=make_team("nlp", quota=4))
    make_nodes(1, 4)
    browser = Client(enforce_csrf_checks=True)
    assert browser.login(username="sam", password="pw-sam")
    browser.get("/login/")  # the page sets the csrftoken cookie
    refused = browser.post("/api/v1/jobs/", SPEC, content_type="application/json")
    assert refused.status_code == 403 and "CSRF" in refused.json()["detail"]
    assert Job.objects.count() == 0
    token = browser.cookies["csrftoken"].value
    accepted = browser.post(
        "/api/v1/jobs/", SPEC, content_type="application/json", HTTP_X_CSRFTOKEN=token
    )
    assert accepted.status_code == 201, accepted.content
    assert Job.objects.count() == 1


@pytest.mark.django_db
def test_a_token_records_when_it_was_last_used(make_user, token_for):
    from rest_framework.test import APIClient

    from teams.models import ApiToken

    raw = token_for(make_user("uma"))
    assert ApiToken.objects.get().last_used_at is None
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    assert api.get("/api/v1/jobs/").status_code == 200
    assert ApiToken.objects.get().last_used_at is not None
