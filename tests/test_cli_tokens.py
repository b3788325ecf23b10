"""`lockstep tokens` against a live portal (pytest-django's live server): create prints the
secret once on stdout, list shows it without the secret, revoke stops it; bad input exits 2
and creates nothing."""

import json

import pytest
from rest_framework.test import APIClient

from lockstep_cli import client
from lockstep_cli.cli import main
from teams.models import ApiToken


def lockstep(capsys, live_server, token, *args):
    code = main(["--url", live_server.url, "--token", token, *args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.django_db(transaction=True)
def test_tokens_create_list_revoke(live_server, make_user, token_for, capsys):
    user = make_user("cora")
    mine = token_for(user)
    code, out, err = lockstep(
        capsys, live_server, mine, "tokens", "create", "ci", "--expires-days", "7"
    )
    assert code == client.EXIT_OK, err
    raw = out.strip()
    assert raw.startswith("lst_") and "shown this once" in err
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    assert api.get("/api/v1/jobs/").status_code == 200

    code, out, _ = lockstep(capsys, live_server, mine, "tokens", "--json")
    listed = json.loads(out)
    assert code == 0 and {t["name"] for t in listed} == {"default", "ci"}
    assert raw not in out
    code, out, _ = lockstep(capsys, live_server, mine, "tokens")
    assert "ci" in out and raw[:10] in out and raw not in out

    ci = ApiToken.objects.get(user=user, name="ci")
    code, out, _ = lockstep(capsys, live_server, mine, "tokens", "revoke", str(ci.id))
    assert code == 0 and f"token {ci.id} revoked" in out
    assert api.get("/api/v1/jobs/").status_code == 401

    # Somebody else's token: not found, nothing revoked.
    token_for(make_user("dov"))
    theirs = ApiToken.objects.get(user__username="dov")
    code, _, err = lockstep(capsys, live_server, mine, "tokens", "revoke", str(theirs.id))
    assert code == client.EXIT_FAILED and "not found" in err
    assert ApiToken.objects.get(pk=theirs.id).revoked_at is None


@pytest.mark.django_db(transaction=True)
def test_a_bad_token_request_exits_2_naming_the_field(live_server, make_user, token_for, capsys):
    mine = token_for(make_user("eli"))
    before = ApiToken.objects.count()
    code, _, err = lockstep(
        capsys, live_server, mine, "tokens", "create", "x", "--expires-days", "999"
    )
    assert code == client.EXIT_USAGE and "expires_in_days" in err
    assert ApiToken.objects.count() == before
