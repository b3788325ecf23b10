"""`manage.py seed_demo --keep FILE`, as `lockstep up` runs it at every start: the second start
hands out what the first did, so a restart logs nobody out of the portal and adds no token; a
password the user changed and a token they revoked are not handed out again."""

import json
import stat

import pytest
from django.core.management import call_command
from django.utils import timezone

from teams.actions import do_revoke_token
from teams.auth import user_for_token
from teams.models import ApiToken


def _seed(capsys, *args) -> dict:
    call_command("seed_demo", *args)
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.django_db
def test_a_second_start_hands_out_the_same_and_logs_nobody_out(client, capsys, tmp_path):
    keep = tmp_path / "demo-credentials.json"
    first = _seed(capsys, "--keep", str(keep))
    assert stat.S_IMODE(keep.stat().st_mode) == 0o600  # secrets: the owner's only
    assert client.login(username="alice", password=first["alice_password"])
    assert client.get("/").status_code == 200

    second = _seed(capsys, "--keep", str(keep))
    assert second == first
    # Her portal session outlived the restart: the password (and so the session hash) is kept.
    assert client.get("/").status_code == 200
    assert ApiToken.objects.filter(user__username="alice", name="demo").count() == 1
    assert user_for_token(first["alice_token"]).username == "alice"


@pytest.mark.django_db
def test_a_changed_password_is_left_alone_and_a_revoked_token_replaced(capsys, tmp_path):
    from django.contrib.auth import get_user_model

    keep = tmp_path / "demo-credentials.json"
    first = _seed(capsys, "--keep", str(keep))
    alice = get_user_model().objects.get(username="alice")
    alice.set_password("her own")
    alice.save()
    do_revoke_token(ApiToken.objects.get(user=alice, name="demo"), actor=alice, now=timezone.now())

    again = _seed(capsys, "--keep", str(keep))
    assert again["alice_password"] is None  # hers, not shown and not reset
    alice.refresh_from_db()
    assert alice.check_password("her own")
    assert again["admin_password"] == first["admin_password"]
    assert again["alice_token"] != first["alice_token"]
    assert user_for_token(again["alice_token"]) == alice
    assert user_for_token(first["alice_token"]) is None  # the revoked one stays revoked


@pytest.mark.django_db
def test_without_keep_every_run_hands_out_fresh_ones(capsys):
    # What the browser tests' clusters use: nothing written, nothing reused.
    first, second = _seed(capsys), _seed(capsys)
    assert first["alice_password"] != second["alice_password"]
    assert first["alice_token"] != second["alice_token"]


@pytest.mark.django_db
def test_an_unreadable_keep_file_is_replaced_with_fresh_ones(capsys, tmp_path):
    keep = tmp_path / "demo-credentials.json"
    keep.write_text("{not json")
    keep.chmod(0o644)
    handed = _seed(capsys, "--keep", str(keep))
    assert json.loads(keep.read_text()) == handed
    assert stat.S_IMODE(keep.stat().st_mode) == 0o600  # replaced, not rewritten in place
    assert [p.name for p in tmp_path.iterdir()] == ["demo-credentials.json"]  # no leftover
