"""Job submission is throttled per user (LOCKSTEP_THROTTLE_SUBMIT): the request past the rate
is a 429 and creates nothing."""

import pytest
from django.core.cache import cache
from rest_framework.test import APIClient
from rest_framework.throttling import ScopedRateThrottle

from jobs.models import Job

SPEC = {
    "name": "t",
    "team": "nlp",
    "image": "lockstep/trainer:latest",
    "command": ["python", "-m", "trainer"],
    "gpus": 1,
}


@pytest.mark.django_db
def test_the_submit_past_the_rate_is_a_429(
    make_team, make_user, make_nodes, token_for, monkeypatch
):
    monkeypatch.setattr(ScopedRateThrottle, "THROTTLE_RATES", {"submit": "3/min"})
    cache.clear()
    user = make_user("tess", team=make_team("nlp", quota=4))
    make_nodes(1, 4)
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {token_for(user)}")
    codes = [api.post("/api/v1/jobs/", SPEC, format="json").status_code for _ in range(4)]
    assert codes == [201, 201, 201, 429]
    assert Job.objects.count() == 3
    # Reads are not throttled by the submit rate.
    assert api.get("/api/v1/jobs/").status_code == 200
