"""Shared fixtures: database objects made through the real actions."""

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone

from jobs import actions
from teams.actions import do_add_member, do_create_team, do_issue_token


@pytest.fixture
def setup(make_team, make_user, make_nodes, settings, tmp_path):
    settings.LOCKSTEP = {
        **settings.LOCKSTEP,
        "CHECKPOINT_ROOT": str(tmp_path / "ckpt"),
        "RESTART_BACKOFF_S": 10.0,
    }
    team = make_team("lab", quota=8)
    user = make_user("ann", team=team)
    nodes = make_nodes(2, 2)
    return team, user, nodes, tmp_path / "ckpt"


@pytest.fixture
def make_user():
    def make(username: str, *, team=None, role: str = "member", staff: bool = False):
        user = get_user_model().objects.create_user(
            username=username, password="pw-" + username, is_staff=staff
        )
        if team is not None:
            do_add_member(team, user, role=role)
        return user

    return make


@pytest.fixture
def make_team():
    def make(name: str, quota: int = 8, borrow_limit: int = 0):
        return do_create_team(name, quota=quota, borrow_limit=borrow_limit)

    return make


@pytest.fixture
def make_nodes():
    def make(count: int, gpus: int, prefix: str = "node"):
        return [
            actions.do_register_node(
                name=f"{prefix}-{i}",
                gpus=gpus,
                address="127.0.0.1",
                boot_id=f"boot-{i}",
                now=timezone.now(),
            )[0]
            for i in range(count)
        ]

    return make


@pytest.fixture
def token_for():
    def make(user) -> str:
        return do_issue_token(user)[1]

    return make
