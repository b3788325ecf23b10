"""A malformed heartbeat is a 400 naming the field, and odd but well-formed content (NUL
characters in logs, steps and timestamps out of range) is stored safely or skipped: never a
500, which would fail every later heartbeat that re-sends the same data and get a healthy node
declared lost."""

import pytest
from rest_framework.test import APIClient

from jobs.models import Event, LogChunk, MetricPoint, Node
from jobs.scheduling.loop import run_pass
from teams.models import token_digest
from tests.heartbeats import live_attempt, submit


@pytest.fixture
def agent(setup):
    team, user, (a, _), _ = setup
    job = submit(team, user, gpus=2)
    run_pass()
    attempt = live_attempt(job)
    node = attempt.allocations.first().node
    Node.objects.filter(pk=node.pk).update(token_digest=token_digest("node_test"))
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Bearer node_test")

    def beat(report: dict | None = None, **body):
        attempts = [{"attempt_id": attempt.id, **report}] if report is not None else []
        return client.post(
            "/api/v1/agent/heartbeat/",
            {"boot_id": node.boot_id, "attempts": attempts, **body},
            format="json",
        )

    return beat, attempt


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"attempts": [1]}, "attempts"),
        ({"attempts": "x"}, "attempts"),
        ({"telemetry": [3]}, "telemetry"),
        ({"telemetry": [{"name": "gpu\x000"}]}, "telemetry"),
    ],
)
def test_a_malformed_heartbeat_is_a_400_on_its_field(agent, body, field):
    beat, _ = agent
    response = beat(**body)
    assert response.status_code == 400, response.content
    assert field in response.json()


@pytest.mark.django_db
@pytest.mark.parametrize(
    "report",
    [
        {"ranks": ["x"]},
        {"ranks": [{"rank": -1, "state": "running"}]},
        {"logs": [{"rank": "zero", "text": "x"}]},
        {"records": ["not an object"]},
    ],
)
def test_a_malformed_attempt_report_is_a_400(agent, report):
    beat, _ = agent
    response = beat(report)
    assert response.status_code == 400, response.content
    assert "attempts" in response.json()


@pytest.mark.django_db
def test_odd_content_is_stored_safely_or_skipped(agent):
    beat, attempt = agent
    response = beat(
        {
            "ranks": [
                {"rank": 0, "pid": 1, "state": "running"},
                {"rank": 1, "pid": 2, "state": "running", "exited_at": 1e300},
            ],
            "records": [
                {"kind": "step", "rank": 0, "step": 2**40, "loss": 1.0},
                {"kind": "step", "rank": 0, "step": 5, "loss": 10**400},
                {"kind": "step", "rank": 0, "step": 6, "loss": 1.0, "time": 1e300},
                {"kind": "step", "rank": 0, "step": 7, "loss": 0.5},
                {"kind": "end", "rank": 0, "step": 7, "reason": "bye\x00"},
            ],
            "logs": [{"rank": 0, "text": "binary\x00output\n"}],
        }
    )
    assert response.status_code == 200, response.content
    # The out-of-range step and the unrepresentable loss and time were skipped.
    assert list(MetricPoint.objects.values_list("step", "value")) == [(7, 0.5)]
    assert LogChunk.objects.get(attempt=attempt).text == "binary\ufffdoutput\n"
    assert Event.objects.filter(message__contains="bye\ufffd").exists()
