"""The role matrix's world (tests/test_role_matrix*.py): the roles, objects owned by team
alpha (a running job with its checkpoint, metrics and logs, a queued job, a model version, the
team, a preemption request, a what-if run, nodes) and a caller for each role, and `snapshot`,
every table's rows for comparing before and after a call.

The fixtures are named for pytest with `name=`: a test file imports `shared_world_fixture`
and `world_fixture` and its tests ask for `world`. The world is built once per test module,
inside a transaction rolled back at the module's end; each test runs in a savepoint in it.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.apps import apps
from django.conf import settings
from django.contrib.auth import get_user_model
from django.utils import timezone
from rest_framework.test import APIClient
from rest_framework.throttling import ScopedRateThrottle

from jobs import actions
from jobs.models import Checkpoint, LogChunk, PreemptionRequest, WhatIfRun
from jobs.scheduling.loop import run_pass
from teams.actions import do_add_member, do_create_team, do_issue_token
from teams.models import Membership, RegistryCredential
from tests.heartbeats import beat, commit_checkpoint, live_attempt, submit

ROLES = ["admin", "lead", "member", "stranger", "outsider", "anonymous", "agent", "node"]
USERS = ["admin", "lead", "member", "stranger", "outsider"]

# Roles that know alpha's objects exist; for every other role a denial must not tell.
SEEING = {"admin", "lead", "member"}
NO_USER = ["anonymous", "agent", "node"]

GHOST_ID = 2_000_000_000  # an id no row has
AGENT_TOKEN = "matrix-agent-secret"


# Failed credentials count per client address in the shared cache (teams/throttle.py): the
# matrix's hundred or so 401s count against an address of its own, not against 127.0.0.1,
# which live portals started by other tests (with the production limit) serve.
CLIENT_ADDRESS = "203.0.113.77"


class World:
    def client(self, role: str) -> APIClient:
        api = APIClient(REMOTE_ADDR=CLIENT_ADDRESS)
        if role in self.tokens:
            api.credentials(HTTP_AUTHORIZATION=f"Bearer {self.tokens[role]}")
        return api


def _user(username: str, *, team=None, role: str = Membership.Role.MEMBER, staff=False):
    # No password: hashing one per user per case would cost more than the case.
    user = get_user_model().objects.create_user(username=username, is_staff=staff)
    if team is not None:
        do_add_member(team, user, role=role)
    return user


def build_world(tmp_path) -> World:
    w = World()
    now = timezone.now()
    w.alpha = do_create_team("alpha", quota=8)
    w.beta = do_create_team("beta", quota=8)
    w.users = {
        "admin": _user("root", staff=True),
        "lead": _user("lee", team=w.alpha, role=Membership.Role.LEAD),
        "member": _user("ann", team=w.alpha),
        "stranger": _user("sam", team=w.beta),
        "outsider": _user("olga"),
    }
    nodes = {}
    for i in range(3):
        node, raw = actions.do_register_node(
            name=f"n{i}", gpus=2, address="127.0.0.1", boot_id=f"boot-{i}", now=now
        )
        nodes[node.id] = (node, raw)

    ann = w.users["member"]
    w.job = submit(w.alpha, ann, gpus=2)
    run_pass()
    attempt = live_attempt(w.job)
    w.node = attempt.allocations.first().node  # runs alpha's job; the node role's own node
    others = [n for n, _ in nodes.values() if n.id != w.node.id]
    w.spare = others[0]
    w.cordoned = actions.do_cordon_node(others[1], actor=None, reason="matrix", now=now)
    root = tmp_path / "ckpt"
    telemetry = [{"index": i, "kind": "cuda", "util": 55.0 + i} for i in range(2)]
    beat(w.node, attempt, {0: None, 1: None}, telemetry=telemetry)
    step = {"kind": "step", "rank": 0, "step": 30, "loss": 1.5, "step_time_s": 0.1}
    beat(w.node, attempt, {0: None, 1: None}, records=[commit_checkpoint(root, w.job, 30), step])
    LogChunk.objects.create(attempt=attempt, rank=0, text="step 30 loss 1.5\n", created_at=now)
    w.checkpoint = Checkpoint.objects.get(job=w.job)
    w.model = actions.do_register_model_version(
        name="alpha-model", checkpoint=w.checkpoint, actor=ann, now=now
    )
    w.queued = submit(w.alpha, ann, gpus=4)
    w.beta_job = submit(w.beta, w.users["stranger"], gpus=1)
    w.preemption = PreemptionRequest.objects.create(
        victim=w.job,
        claimant=w.queued,
        kind=PreemptionRequest.Kind.PRIORITY,
        reason="a higher priority job waits",
        created_at=now,
        auto_approve_at=now + timedelta(minutes=5),
    )
    w.whatif = WhatIfRun.objects.create(
        created_by=w.users["admin"],
        created_at=now,
        since=now - timedelta(days=1),
        until=now,
        state=WhatIfRun.State.DONE,
    )
    w.credential = RegistryCredential.objects.create(
        team=w.alpha, registry="registry.example.org", username="bot", secret="matrix-secret"
    )
    w.tokens = {role: do_issue_token(user)[1] for role, user in w.users.items()}
    w.member_token = do_issue_token(ann, name="spare")[0]
    w.tokens["agent"] = AGENT_TOKEN
    w.tokens["node"] = nodes[w.node.id][1]
    return w


@pytest.fixture(scope="module", name="shared_world")
def shared_world_fixture(django_db_setup, django_db_blocker, tmp_path_factory):
    """The world, built once for the module inside a transaction that is rolled back at the
    end; each test runs in a savepoint inside it (pytest-django's own transaction), so each
    case still starts from this world, whatever the case before it changed."""
    from django.db import transaction
    from django.test import override_settings

    from jobs.scheduling import loop

    tmp_path = tmp_path_factory.mktemp("matrix")
    lockstep = {
        **settings.LOCKSTEP,
        "CHECKPOINT_ROOT": str(tmp_path / "ckpt"),
        "MODEL_ROOT": str(tmp_path / "models"),
        "AGENT_TOKEN": AGENT_TOKEN,
    }
    with (
        django_db_blocker.unblock(),
        override_settings(LOCKSTEP=lockstep),
        pytest.MonkeyPatch.context() as patch,
    ):
        # The submit throttle counts per user id in the shared cache, where ids repeat from
        # run to run: no case here submits more than once, and this rate keeps old counts away.
        patch.setattr(ScopedRateThrottle, "THROTTLE_RATES", {"submit": "100000/min"})
        patch.setattr(loop, "intake", loop.HeartbeatIntake(timezone.now() - timedelta(hours=1)))
        with transaction.atomic():
            world = build_world(tmp_path)
            world.pristine = snapshot()
            yield world
            transaction.set_rollback(True)


@pytest.fixture(name="world")
def world_fixture(shared_world, db) -> World:
    return shared_world


def snapshot() -> dict:
    """Every row of the jobs and teams tables (the platform's state, Events included), tokens
    without their last use, and the users."""
    rows = {}
    for app in ("jobs", "teams"):
        for model in apps.get_app_config(app).get_models():
            values = model.objects.order_by("pk").values()
            rows[model.__name__] = [
                {k: v for k, v in row.items() if k != "last_used_at"} for row in values
            ]
    rows["User"] = list(get_user_model().objects.order_by("pk").values("id", "is_active"))
    return rows
