"""Who may do what, for every operation in the OpenAPI schema and every kind of caller.

The matrix is built from the schema itself: each operation is called as each role against
objects owned by team alpha (a running job with its checkpoint, metrics and logs, a queued
job, a model version, the team, a preemption request, a what-if run, nodes), every case in a
fresh world. An operation added to the API without a row in EXPECTATIONS fails ("operation X
has no expectation"), and a row that names an operation the schema lost fails too.

Roles: a cluster admin, alpha's lead, an alpha member, a member of team beta (a stranger to
alpha's objects), a user in no team, no credentials at all, the cluster agent token, and the
node token of the node that runs alpha's job.

What each expectation checks:
- OK: a 2xx; lists include alpha's object; a mutation has its effect.
- BLIND: a 2xx list (or a "seen" read) that does not include alpha's object.
- FORBIDDEN (403), HIDDEN (404), UNKNOWN (400 on the body field naming an object the caller
  may not see), UNAUTH (401).
Every denial changes nothing (every table's rows, Events included, are compared before and
after), and for a caller who may not see alpha's objects the denial is exactly the answer for
an object that does not exist (same status, same body).

The world, the roles and `snapshot` are in tests/role_matrix_world.py; the websocket (not an
operation of the schema) has its matrix in tests/test_role_matrix_stream.py.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import pytest
from django.utils import timezone
from drf_spectacular.generators import SchemaGenerator
from rest_framework.test import APIClient

from jobs import actions
from jobs.models import Job, LogChunk, ModelVersion, Node, PreemptionRequest, WhatIfRun
from teams.models import ApiToken, RegistryCredential
from tests.heartbeats import live_attempt
from tests.role_matrix_world import (
    GHOST_ID,
    NO_USER,
    ROLES,
    SEEING,
    USERS,
    World,
    shared_world_fixture,  # noqa: F401 (fixture)
    snapshot,
    world_fixture,  # noqa: F401 (fixture)
)

GHOST_TEAM = "ghost-team"

OK, BLIND, FORBIDDEN, HIDDEN, UNKNOWN, UNAUTH = (
    "ok",
    "blind",
    "forbidden",
    "hidden",
    "unknown",
    "unauth",
)
DENIED_STATUS = {FORBIDDEN: 403, HIDDEN: 404, UNKNOWN: 400, UNAUTH: 401}


def _schema_operations() -> list[tuple[str, str, str]]:
    """(operationId, METHOD, path) of every operation the schema documents."""
    schema = SchemaGenerator().get_schema(request=None, public=True)
    return sorted(
        (op["operationId"], method.upper(), path)
        for path, ops in schema["paths"].items()
        for method, op in ops.items()
    )


OPERATIONS = _schema_operations()


# --- the expectations --------------------------------------------------------------------------


def _all(users: str, *, seeing: str | None = None, others: str = UNAUTH, **overrides):
    """An expectation row: `users` for every signed-in role, `seeing` (if given) for alpha's
    admin, lead and member, `others` for anonymous, agent and node; then the overrides."""
    row = {role: users for role in USERS}
    if seeing is not None:
        row.update(dict.fromkeys(SEEING, seeing))
    row.update(dict.fromkeys(NO_USER, others))
    row.update(overrides)
    return row


def _spec(team: str) -> dict:
    return {
        "name": "matrix",
        "team": team,
        "image": "lockstep/trainer:latest",
        "command": ["python", "-m", "trainer"],
        "dataset": "synthetic://addition",
        "gpus": 1,
    }


@dataclass
class Row:
    expect: dict[str, str]
    target: str | None = None  # the World attribute whose id fills {id}
    # The body: body(world, ghost) with ghost=True naming an object that does not exist.
    body: Callable[[World, bool], dict] | None = None
    # The value in the body that names alpha's object, and its ghost (for comparing answers).
    ref: Callable[[World], tuple[str, str]] | None = None
    listed: Callable[[World], int] | None = None  # the id a list shows to those who see it
    effect: Callable[[World, dict], None] | None = None  # checks an allowed mutation's effect
    # check(world, body, role): an allowed call's answer is right.
    check: Callable[[World, object, str], bool] | None = None
    status: int | None = None  # the exact success status, where there is one
    # The roles that know the object exists; any other role's denial is compared with the
    # answer for an object that does not exist.
    seeing: set[str] = field(default_factory=lambda: set(SEEING))


def _grew(model, by: int = 1):
    def effect(w, before):
        assert len(before[model.__name__]) + by == model.objects.count()

    return effect


def _field(attr: str, name: str, *values):
    def effect(w, before):
        obj = getattr(w, attr)
        obj.refresh_from_db()
        assert getattr(obj, name) in values, (attr, name, getattr(obj, name))

    return effect


def _ids(body) -> list[int]:
    return [item["id"] for item in (body["results"] if isinstance(body, dict) else body)]


def _heartbeat(w, ghost):
    return {"boot_id": w.node.boot_id, "attempts": []}


def _heartbeat_effect(w, before):
    (row,) = [n for n in before["Node"] if n["id"] == w.node.id]
    w.node.refresh_from_db()
    assert w.node.last_heartbeat_at > row["last_heartbeat_at"]


def _leaving_effect(w, before):
    w.node.refresh_from_db()
    assert w.node.leaving_at is not None and w.node.state == "down"


def _revoked(w, before):
    assert ApiToken.objects.get(pk=w.member_token.id).revoked_at is not None


def _own_tokens(w, body, role) -> bool:
    mine = set(ApiToken.objects.filter(user=w.users[role]).values_list("id", flat=True))
    return (
        bool(_ids(body))
        and set(_ids(body)) == mine
        and all("token" not in t for t in body["results"])
    )


PLAN = {"layers": 4, "hidden": 256, "heads": 4, "vocab": 1000, "seq": 128, "gpus": 2}

# Reads of (and actions on) one of alpha's objects: 404 for whoever may not see it.
JOB_READ = _all(HIDDEN, seeing=OK)

EXPECTATIONS: dict[str, Row] = {
    # Agents: the cluster agent token registers; a node token heartbeats (as its own node).
    "v1_agent_register_create": Row(
        _all(UNAUTH, agent=OK),
        body=lambda w, ghost: {"name": "n-new", "gpus": 2, "address": "127.0.0.1"},
        effect=_grew(Node),
    ),
    "v1_agent_heartbeat_create": Row(
        _all(UNAUTH, node=OK), body=_heartbeat, effect=_heartbeat_effect
    ),
    # A node token says its own node's agent is leaving (a planned restart).
    "v1_agent_leaving_create": Row(
        _all(UNAUTH, node=OK),
        body=lambda w, ghost: {"boot_id": w.node.boot_id, "reason": "upgrade"},
        effect=_leaving_effect,
    ),
    # Jobs: alpha's members, its lead and admins; hidden from everyone else.
    "v1_jobs_list": Row(_all(BLIND, seeing=OK), listed=lambda w: w.job.id),
    "v1_jobs_create": Row(
        _all(UNKNOWN, seeing=OK),
        body=lambda w, ghost: _spec(GHOST_TEAM if ghost else w.alpha.name),
        ref=lambda w: (w.alpha.name, GHOST_TEAM),
        effect=_grew(Job),
        status=201,
    ),
    "v1_jobs_retrieve": Row(
        JOB_READ, target="job", check=lambda w, b, role: b["attempts"][0]["last_step"] == 30
    ),
    "v1_jobs_partial_update": Row(
        _all(HIDDEN, seeing=OK, member=FORBIDDEN),
        target="job",
        body=lambda w, ghost: {"priority": "high"},
        effect=_field("job", "priority", "high"),
    ),
    "v1_jobs_cancel_create": Row(
        JOB_READ, target="queued", effect=_field("queued", "state", Job.State.CANCELLED)
    ),
    "v1_jobs_checkpoints_list": Row(
        JOB_READ, target="job", check=lambda w, b, role: _ids(b) == [w.checkpoint.id]
    ),
    "v1_jobs_events_list": Row(
        JOB_READ, target="job", check=lambda w, b, role: "job.submitted" in {e["kind"] for e in b}
    ),
    "v1_jobs_gpus_retrieve": Row(
        JOB_READ, target="job", check=lambda w, b, role: len(b["gpus"]) == 2
    ),
    "v1_jobs_gpus_history_retrieve": Row(
        JOB_READ,
        target="job",
        check=lambda w, b, role: sorted(s["util"][0] for s in b["series"]) == [55.0, 56.0],
    ),
    "v1_jobs_logs_retrieve": Row(
        JOB_READ, target="job", check=lambda w, b, role: b["lines"] == ["step 30 loss 1.5"]
    ),
    "v1_jobs_metrics_retrieve": Row(
        JOB_READ, target="job", check=lambda w, b, role: "30" in str(b)
    ),
    "v1_jobs_metrics_names_retrieve": Row(
        JOB_READ,
        target="job",
        check=lambda w, b, role: b["names"] == ["loss", "step_time_s"],
    ),
    # Model versions follow their job.
    "v1_models_list": Row(_all(BLIND, seeing=OK), listed=lambda w: w.model.id),
    "v1_models_create": Row(
        _all(UNKNOWN, seeing=OK),
        body=lambda w, ghost: {
            "name": "alpha-next",
            "checkpoint": GHOST_ID if ghost else w.checkpoint.id,
        },
        ref=lambda w: (str(w.checkpoint.id), str(GHOST_ID)),
        effect=_grew(ModelVersion),
        status=201,
    ),
    "v1_models_retrieve": Row(JOB_READ, target="model"),
    # Nodes: the cluster's shape for everyone signed in; admins alone change them.
    "v1_nodes_list": Row(_all(OK), listed=lambda w: w.node.id),
    "v1_nodes_retrieve": Row(_all(OK), target="node"),
    "v1_nodes_cordon_create": Row(
        _all(FORBIDDEN, admin=OK),
        target="spare",
        body=lambda w, ghost: {"reason": "matrix"},
        effect=_field("spare", "state", Node.State.CORDONED),
    ),
    "v1_nodes_drain_create": Row(
        _all(FORBIDDEN, admin=OK),
        target="spare",
        body=lambda w, ghost: {"reason": "matrix"},
        effect=_field("spare", "state", Node.State.DRAINING),
    ),
    "v1_nodes_uncordon_create": Row(
        _all(FORBIDDEN, admin=OK),
        target="cordoned",
        body=lambda w, ghost: {},
        effect=_field("cordoned", "state", Node.State.UP),
    ),
    # The planner is arithmetic: anyone signed in.
    "v1_plan_create": Row(
        _all(OK), body=lambda w, ghost: PLAN, check=lambda w, b, role: b["layouts"] != []
    ),
    # Preemptions: seen with their jobs; admins alone decide.
    "v1_preemptions_list": Row(_all(BLIND, seeing=OK), listed=lambda w: w.preemption.id),
    "v1_preemptions_retrieve": Row(JOB_READ, target="preemption"),
    "v1_preemptions_approve_create": Row(
        _all(FORBIDDEN, admin=OK),
        target="preemption",
        # Approved, and executed at once: the victim is told to stop.
        effect=_field(
            "preemption",
            "state",
            PreemptionRequest.State.APPROVED,
            PreemptionRequest.State.EXECUTED,
        ),
    ),
    "v1_preemptions_reject_create": Row(
        _all(FORBIDDEN, admin=OK),
        target="preemption",
        effect=_field("preemption", "state", PreemptionRequest.State.REJECTED),
    ),
    # Teams: members see theirs; admins alone change quotas.
    "v1_teams_list": Row(_all(BLIND, seeing=OK), listed=lambda w: w.alpha.id),
    "v1_teams_retrieve": Row(JOB_READ, target="alpha"),
    "v1_teams_partial_update": Row(
        _all(HIDDEN, seeing=FORBIDDEN, admin=OK),
        target="alpha",
        body=lambda w, ghost: {"quota": 12},
        effect=_field("alpha", "quota", 12),
    ),
    # Registry credentials: members see which registries (never a secret); admins set them.
    "v1_teams_registry_credentials_list": Row(
        JOB_READ,
        target="alpha",
        check=lambda w, body, role: (
            [c["registry"] for c in body] == ["registry.example.org"]
            and "matrix-secret" not in json.dumps(body)
        ),
    ),
    "v1_teams_registry_credentials_create": Row(
        _all(HIDDEN, seeing=FORBIDDEN, admin=OK),
        target="alpha",
        body=lambda w, ghost: {
            "registry": "other.example.org",
            "username": "u",
            "password": "p",
        },
        effect=_grew(RegistryCredential),
        status=201,
    ),
    "v1_teams_registry_credentials_destroy": Row(
        _all(HIDDEN, seeing=FORBIDDEN, admin=OK),
        target="alpha",
        body=lambda w, ghost: {"registry": "registry.example.org"},
        effect=_grew(RegistryCredential, by=-1),
        status=204,
    ),
    # What-ifs: cluster admins only.
    "v1_whatif_list": Row(_all(FORBIDDEN, admin=OK), listed=lambda w: w.whatif.id),
    "v1_whatif_create": Row(
        _all(FORBIDDEN, admin=OK),
        body=lambda w, ghost: {
            "since": (timezone.now() - timedelta(hours=1)).isoformat(),
            "until": (timezone.now() + timedelta(minutes=1)).isoformat(),
        },
        effect=_grew(WhatIfRun),
    ),
    "v1_whatif_retrieve": Row(_all(FORBIDDEN, admin=OK), target="whatif"),
    # API tokens: everyone signed in manages their own, and nobody else's (admins included:
    # they revoke in the Django admin). The target is a spare token of alpha's member.
    "v1_tokens_list": Row(
        _all(BLIND, member=OK),
        listed=lambda w: w.member_token.id,
        check=lambda w, b, role: _own_tokens(w, b, role),
    ),
    "v1_tokens_create": Row(
        _all(OK),
        body=lambda w, ghost: {"name": "matrix-new", "expires_in_days": 7},
        effect=_grew(ApiToken),
        check=lambda w, b, role: (
            b["token"].startswith("lst_") and ApiToken.objects.get(pk=b["id"]).user == w.users[role]
        ),
        status=201,
    ),
    "v1_tokens_retrieve": Row(
        _all(HIDDEN, member=OK),
        target="member_token",
        seeing={"member"},
        check=lambda w, b, role: b["id"] == w.member_token.id and "token" not in b,
    ),
    "v1_tokens_destroy": Row(
        _all(HIDDEN, member=OK),
        target="member_token",
        seeing={"member"},
        effect=_revoked,
        status=204,
    ),
}


# --- the matrix ------------------------------------------------------------------------------


def _call(w: World, role: str, method: str, path: str, row: Row, *, ghost: bool):
    if row.target is not None:
        path = path.replace("{id}", str(GHOST_ID if ghost else getattr(w, row.target).id))
    assert "{" not in path, f"{path}: a path parameter the matrix does not fill"
    body = row.body(w, ghost) if row.body else None
    return w.client(role).generic(
        method, path, json.dumps(body) if body is not None else "", content_type="application/json"
    )


def _text(response, swap: tuple[str, str] | None) -> str:
    text = response.content.decode()
    if swap:
        # Whole numbers only: a real id of "1" must not match inside the ghost's "100000000".
        text = re.sub(r"\b(" + "|".join(map(re.escape, swap)) + r")\b", "<REF>", text)
    return text


@pytest.mark.django_db
@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize(
    ("operation", "method", "path"), OPERATIONS, ids=[op for op, _, _ in OPERATIONS]
)
def test_matrix(operation, method, path, role, world):
    row = EXPECTATIONS.get(operation)
    if row is None:
        pytest.fail(f"operation {operation} ({method} {path}) has no expectation")
    expect = row.expect.get(role)
    assert expect is not None, f"operation {operation} has no expectation for {role}"
    w = world
    before = snapshot()
    assert before == w.pristine, "the case does not start from the module's world"
    response = _call(w, role, method, path, row, ghost=False)
    body = response.json() if response.content else None

    if expect in (OK, BLIND):
        assert 200 <= response.status_code < 300, (response.status_code, body)
        if row.status is not None:
            assert response.status_code == row.status, (response.status_code, body)
        if row.listed is not None:
            listed = row.listed(w) in _ids(body)
            assert listed == (expect == OK), (expect, _ids(body))
        elif expect == BLIND:
            raise AssertionError(f"{operation}: BLIND is for lists")
        if row.check is not None:
            assert row.check(w, body, role), body
        if row.effect is not None:
            row.effect(w, before)
        else:
            assert snapshot() == before, "a read changed something"
        return

    assert response.status_code == DENIED_STATUS[expect], (response.status_code, body)
    assert snapshot() == before, "a denied request changed something"
    if expect == UNAUTH:
        assert response.status_code == 401 and "detail" in body, body
    if role not in row.seeing and (row.target is not None or row.ref is not None):
        # What a caller who may not see alpha's objects gets is what nothing gets.
        ghost = _call(w, role, method, path, row, ghost=True)
        swap = row.ref(w) if row.ref else None
        assert (ghost.status_code, _text(ghost, swap)) == (
            response.status_code,
            _text(response, swap),
        ), "the denial tells a real object from one that does not exist"
        assert snapshot() == before


def test_every_expectation_row_names_a_schema_operation_and_every_role():
    documented = {op for op, _, _ in OPERATIONS}
    assert len(documented) >= 31, sorted(documented)
    assert not set(EXPECTATIONS) - documented, "rows for operations the schema no longer has"
    for operation, row in EXPECTATIONS.items():
        assert set(row.expect) == set(ROLES), (operation, set(ROLES) ^ set(row.expect))
        assert set(row.expect.values()) <= {OK, BLIND, FORBIDDEN, HIDDEN, UNKNOWN, UNAUTH}


# --- agents: a node token is its own node's only --------------------------------------------


@pytest.mark.django_db
def test_a_node_token_reports_for_its_own_node_only(world):
    """The spare node's token reporting on alpha's attempt (which runs elsewhere): answered,
    but nothing about the attempt changes, and the running node's heartbeat time stays."""
    attempt = live_attempt(world.job)
    spare_raw = actions.do_register_node(
        name=world.spare.name, gpus=2, address="127.0.0.1", boot_id="boot-x", now=timezone.now()
    )[1]
    world.spare.refresh_from_db()
    before = snapshot()
    forged = {
        "boot_id": world.spare.boot_id,
        "attempts": [
            {
                "attempt_id": attempt.id,
                "ranks": [{"rank": 0, "pid": 1, "state": "exited", "exit_code": 1}],
                "records": [{"kind": "step", "rank": 0, "step": 99, "loss": 9.0}],
                "logs": [{"rank": 0, "text": "forged line\n"}],
            }
        ],
    }
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {spare_raw}")
    response = api.post("/api/v1/agent/heartbeat/", forged, format="json")
    assert response.status_code == 200, response.content
    after = snapshot()
    for table in ("Attempt", "Allocation", "Job", "MetricPoint", "LogChunk", "Checkpoint"):
        assert after[table] == before[table], table
    (running_node,) = [n for n in after["Node"] if n["id"] == world.node.id]
    (was,) = [n for n in before["Node"] if n["id"] == world.node.id]
    assert running_node == was
    # The same report from the node that runs the attempt is taken.
    own = APIClient()
    own.credentials(HTTP_AUTHORIZATION=f"Bearer {world.tokens['node']}")
    forged["boot_id"] = world.node.boot_id
    forged["attempts"][0]["ranks"] = [{"rank": 0, "pid": 1, "state": "running"}]
    assert own.post("/api/v1/agent/heartbeat/", forged, format="json").status_code == 200
    assert LogChunk.objects.filter(text="forged line\n").count() == 1
