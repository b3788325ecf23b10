"""Schemathesis against the API's own OpenAPI schema, in process: every operation, called as a
team member and as a cluster admin with generated valid and invalid input, never answers 5xx
and every documented response matches its schema.

Runs through Django's WSGI handler on the test database (the test's transaction), over data
made through the real actions: a running job with a checkpoint, metrics and logs, a queued
job, a model version and a proposed preemption. Half the generated ids are swapped for ids
that exist, so detail views and actions run on real rows, not only as 404s.
"""

import json
import time
from datetime import timedelta

import hypothesis
import pytest
import schemathesis
from django.core.signals import request_finished, request_started
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections
from django.utils import timezone
from hypothesis import HealthCheck, given
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
)

from jobs import actions
from jobs.models import (
    Attempt,
    Checkpoint,
    Job,
    LogChunk,
    ModelVersion,
    Node,
    PreemptionRequest,
    WhatIfRun,
)
from jobs.scheduling.loop import run_pass
from teams.actions import do_add_member
from teams.models import Team, token_digest
from tests.heartbeats import beat, commit_checkpoint, live_attempt, submit

EXAMPLES_PER_OPERATION = 60  # per role and operation: 1.5-3 minutes in all on 2 cores
CHECKS = [not_a_server_error, response_schema_conformance, content_type_conformance]


@pytest.fixture
def wsgi_app():
    # Django's test client does the same: closing "old" connections at each request would
    # close the test's own, inside its transaction.
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    try:
        yield get_wsgi_application()
    finally:
        request_started.connect(close_old_connections)
        request_finished.connect(close_old_connections)


@pytest.fixture
def world(setup, make_team, make_user, token_for):
    """Rows for every resource the API serves, and a member's and an admin's tokens."""
    team, ann, (a, b), root = setup
    do_add_member(make_team("demo", quota=4), ann)
    admin = make_user("root", staff=True)
    running = submit(team, ann, gpus=4)
    run_pass()
    attempt = live_attempt(running)
    beat(a, attempt, {0: None, 1: None})
    beat(b, attempt, {2: None, 3: None})
    step = {"kind": "step", "rank": 0, "step": 30, "loss": 1.5, "step_time_s": 0.1}
    beat(a, attempt, {0: None, 1: None}, records=[commit_checkpoint(root, running, 30), step])
    LogChunk.objects.create(
        attempt=attempt, rank=0, text="step 30 loss 1.5\n", created_at=timezone.now()
    )
    Node.objects.filter(pk=a.pk).update(
        telemetry=[{"index": 0, "kind": "cpu", "util": 50.0, "mem_used": 1, "mem_total": 2}]
    )
    queued = submit(team, ann, gpus=4)
    checkpoint = Checkpoint.objects.get(job=running)
    actions.do_register_model_version(
        name="gpt-small", checkpoint=checkpoint, actor=ann, now=timezone.now()
    )
    now = timezone.now()
    PreemptionRequest.objects.create(
        victim=running,
        claimant=queued,
        kind=PreemptionRequest.Kind.PRIORITY,
        reason="a higher priority job waits",
        created_at=now,
        auto_approve_at=now + timedelta(minutes=5),
    )
    return {"member": token_for(ann), "admin": token_for(admin)}


def existing_ids() -> dict[str, list[int]]:
    """Ids that exist now, per collection in the URL (/api/v1/<collection>/{id}/...)."""
    return {
        "jobs": list(Job.objects.values_list("id", flat=True)),
        "models": list(ModelVersion.objects.values_list("id", flat=True)),
        "nodes": list(Node.objects.values_list("id", flat=True)),
        "teams": list(Team.objects.values_list("id", flat=True)),
        "preemptions": list(PreemptionRequest.objects.values_list("id", flat=True)),
        "whatif": list(WhatIfRun.objects.values_list("id", flat=True)),
    }


def fuzz_operation(operation, headers: dict, prepare=None) -> set[int]:
    """Call the operation with generated input (passed through `prepare(case, real)` when
    given); the status codes seen."""
    seen = set()

    strategy = st.one_of(
        operation.as_strategy(GenerationMode.POSITIVE),
        operation.as_strategy(GenerationMode.NEGATIVE),
        # The schema's own examples (e.g. a submit to team "demo", which `world` makes).
        *operation.schema.get_strategies_from_examples(operation),
    )
    collection = operation.path.removeprefix("/api/v1/").split("/")[0]

    @hypothesis.settings(
        max_examples=EXAMPLES_PER_OPERATION,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
        phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate, hypothesis.Phase.shrink],
    )
    @given(case=strategy, real=st.booleans(), pick=st.integers(min_value=0, max_value=1000))
    def run(case, real, pick):
        params = case.path_parameters or {}
        ids = existing_ids().get(collection)
        if real and ids and "id" in params:
            params["id"] = ids[pick % len(ids)]
        if prepare is not None:
            prepare(case, real)
        # Our token, not whatever the generator made up for the security scheme.
        case.headers = {**(case.headers or {}), **headers}
        seen.add(case.call_and_validate(headers=headers, checks=CHECKS).status_code)

    run()
    return seen


@pytest.mark.django_db
@pytest.mark.parametrize("role", ["member", "admin"])
def test_every_operation_answers_without_5xx_and_as_its_schema_says(role, world, wsgi_app):
    schema = schemathesis.openapi.from_wsgi("/api/schema/", wsgi_app)
    headers = {"Authorization": f"Bearer {world[role]}"}
    failures, succeeded, operations = [], [], []
    started = time.monotonic()
    for result in schema.get_all_operations():
        operation = result.ok()
        operations.append(operation.label)
        try:
            if any(200 <= code < 300 for code in fuzz_operation(operation, headers)):
                succeeded.append(operation.label)
        except (Exception, BaseExceptionGroup) as exc:  # report every operation's failure
            failures.append(f"{operation.label}: {str(exc)[:4000]}")
    assert len(operations) >= 25, operations
    assert not failures, "\n\n".join(failures)
    # Not only 400s and 404s: most operations ran to a success on real rows at least once
    # (the agent endpoints refuse user tokens, and members are refused the admin actions).
    assert len(succeeded) >= (22 if role == "admin" else 15), sorted(
        set(operations) - set(succeeded)
    )
    assert time.monotonic() - started < 300, "fuzzing should stay a couple of minutes"


@pytest.mark.django_db
def test_agent_endpoints_answer_without_5xx_and_as_their_schema_says(world, wsgi_app, settings):
    """The cluster agent token on register; a node token on heartbeat, with half the bodies
    given that node's boot id and its live attempt, so records and logs are ingested."""
    settings.LOCKSTEP = {**settings.LOCKSTEP, "AGENT_TOKEN": "cluster-secret"}
    attempt = Attempt.objects.get(ended_at__isnull=True)
    node = attempt.allocations.first().node
    Node.objects.filter(pk=node.pk).update(token_digest=token_digest("node_fuzz"))

    def heartbeat_of_that_node(case, real):
        body = case.body
        if not (real and isinstance(body, dict)):
            return
        body["boot_id"] = node.boot_id
        for report in body.get("attempts") or []:
            if isinstance(report, dict):
                report["attempt_id"] = attempt.id
                # Ranks keep running, so the attempt stays live for the next examples.
                report["ranks"] = [{"rank": 0, "pid": 1, "state": "running"}]

    schema = schemathesis.openapi.from_wsgi("/api/schema/", wsgi_app)
    register = schema["/api/v1/agent/register/"]["POST"]
    heartbeat = schema["/api/v1/agent/heartbeat/"]["POST"]
    leaving = schema["/api/v1/agent/leaving/"]["POST"]

    def leaving_of_that_node(case, real):
        if real and isinstance(case.body, dict):
            case.body["boot_id"] = node.boot_id

    failures, seen = [], {}
    # Leaving last: it stops the node's attempt.
    for operation, token, prepare in [
        (register, "cluster-secret", None),
        (heartbeat, "node_fuzz", heartbeat_of_that_node),
        (leaving, "node_fuzz", leaving_of_that_node),
    ]:
        try:
            seen[operation.label] = fuzz_operation(
                operation, {"Authorization": f"Bearer {token}"}, prepare
            )
        except (Exception, BaseExceptionGroup) as exc:
            failures.append(f"{operation.label}: {str(exc)[:4000]}")
    assert not failures, "\n\n".join(failures)
    assert all(200 in codes for codes in seen.values()), seen


@pytest.mark.django_db
def test_the_schema_is_served_as_openapi_3_without_authentication(client):
    response = client.get("/api/schema/", HTTP_ACCEPT="application/json")
    assert response.status_code == 200
    schema = json.loads(response.content)
    assert schema["openapi"].startswith("3.")
    assert schema["components"]["securitySchemes"]["bearerToken"]["scheme"] == "bearer"
    assert "/api/v1/jobs/{id}/cancel/" in schema["paths"]
