"""API tokens managed by their owners (API and portal page), and throttling of failed
credentials per client address (API tokens, agent tokens, the sign-in form)."""

import itertools
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone
from rest_framework.test import APIClient

from jobs.models import Event
from teams.models import ApiToken
from teams.throttle import parse_rate, record_failure, retry_after

_addresses = (
    f"10.77.{i // 250}.{i % 250 + 1}"
    for i in itertools.count(int(timezone.now().timestamp()) % 5000)
)


def fresh_address() -> str:
    """A client address no earlier test (or run: the counters live in Redis) has used."""
    return next(_addresses)


def api(raw: str | None = None, address: str = "127.0.0.1") -> APIClient:
    client = APIClient(REMOTE_ADDR=address)
    if raw:
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    return client


@pytest.mark.django_db
def test_a_created_token_is_shown_once_and_works_until_revoked(make_user, token_for):
    owner = make_user("olga")
    me = api(token_for(owner))
    created = me.post("/api/v1/tokens/", {"name": "sweep", "expires_in_days": 30}, format="json")
    assert created.status_code == 201, created.content
    body = created.json()
    raw = body["token"]
    assert raw.startswith(body["prefix"]) and body["state"] == "active"
    expires = ApiToken.objects.get(pk=body["id"]).expires_at
    assert timedelta(days=29, hours=23) < expires - timezone.now() <= timedelta(days=30)
    # Never again: neither the list nor the detail carries the secret, and only its digest
    # is stored.
    listed = me.get("/api/v1/tokens/").json()["results"]
    assert {t["name"] for t in listed} == {"default", "sweep"}
    assert all("token" not in t for t in listed)
    assert "token" not in me.get(f"/api/v1/tokens/{body['id']}/").json()
    assert not ApiToken.objects.filter(digest=raw).exists()

    new = api(raw)
    assert new.get("/api/v1/jobs/").status_code == 200
    assert me.delete(f"/api/v1/tokens/{body['id']}/").status_code == 204
    assert new.get("/api/v1/jobs/").status_code == 401
    assert me.get(f"/api/v1/tokens/{body['id']}/").json()["state"] == "revoked"
    # Revoking again is a no-op: no second Event.
    assert me.delete(f"/api/v1/tokens/{body['id']}/").status_code == 204
    assert Event.objects.filter(kind="token.revoked").count() == 1
    assert Event.objects.filter(kind="token.issued").count() == 2


@pytest.mark.django_db
def test_an_expired_token_no_longer_works(make_user, token_for):
    owner = make_user("eve")
    raw = token_for(owner)
    assert api(raw).get("/api/v1/jobs/").status_code == 200
    ApiToken.objects.filter(user=owner).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert api(raw).get("/api/v1/jobs/").status_code == 401


@pytest.mark.django_db
def test_somebody_elses_token_is_a_404_like_one_that_does_not_exist(make_user, token_for):
    mine = api(token_for(make_user("mo")))
    theirs_raw = token_for(make_user("ty"))
    theirs = ApiToken.objects.get(user__username="ty")
    missing = mine.get("/api/v1/tokens/999999/")
    for method in ("get", "delete"):
        answer = getattr(mine, method)(f"/api/v1/tokens/{theirs.id}/")
        assert (answer.status_code, answer.json()) == (404, missing.json())
    assert {t["id"] for t in mine.get("/api/v1/tokens/").json()["results"]} != {theirs.id}
    assert api(theirs_raw).get("/api/v1/jobs/").status_code == 200
    assert ApiToken.objects.get(pk=theirs.id).revoked_at is None


@pytest.mark.parametrize(
    "body, field",
    [
        ({}, "name"),
        ({"name": "   "}, "name"),
        ({"name": "x" * 101}, "name"),
        ({"name": "bad\nname"}, "name"),
        ({"name": "default"}, "name"),  # an active token of mine already has it
        ({"name": "ok", "expires_in_days": 0}, "expires_in_days"),
        ({"name": "ok", "expires_in_days": 367}, "expires_in_days"),
        ({"name": "ok", "expires_in_days": "soon"}, "expires_in_days"),
    ],
)
@pytest.mark.django_db
def test_a_bad_token_request_names_the_field_and_creates_nothing(make_user, token_for, body, field):
    me = api(token_for(make_user("val")))
    before = (ApiToken.objects.count(), Event.objects.count())
    answer = me.post("/api/v1/tokens/", body, format="json")
    assert answer.status_code == 400
    assert list(answer.json()) == [field], answer.json()
    assert (ApiToken.objects.count(), Event.objects.count()) == before


@pytest.mark.django_db
def test_anonymous_cannot_list_or_create_tokens():
    assert APIClient().get("/api/v1/tokens/").status_code in (401, 403)
    assert APIClient().post("/api/v1/tokens/", {"name": "x"}, format="json").status_code in (
        401,
        403,
    )
    assert ApiToken.objects.count() == 0


@pytest.mark.django_db
def test_the_tokens_page_shows_a_new_secret_once_and_revokes(make_user):
    owner = make_user("pia")
    browser = Client()
    assert browser.login(username="pia", password="pw-pia")
    page = browser.post("/tokens/", {"name": "notebook", "expires_in_days": "90"})
    assert page.status_code == 200
    raw = page.context["created"]["raw"]
    assert raw in page.content.decode()
    token = ApiToken.objects.get(user=owner, name="notebook")
    assert token.expires_at is not None and api(raw).get("/api/v1/jobs/").status_code == 200
    again = browser.get("/tokens/").content.decode()
    assert raw not in again and token.prefix in again
    # The same name again: an error next to the field, nothing created.
    dup = browser.post("/tokens/", {"name": "notebook", "expires_in_days": ""})
    assert dup.status_code == 400 and "already have an active token" in dup.content.decode()
    assert ApiToken.objects.filter(user=owner).count() == 1
    # Somebody else cannot revoke it; its owner can.
    make_user("rex")
    other = Client()
    assert other.login(username="rex", password="pw-rex")
    assert other.post(f"/tokens/{token.id}/revoke/").status_code == 404
    assert api(raw).get("/api/v1/jobs/").status_code == 200
    assert browser.post(f"/tokens/{token.id}/revoke/").status_code == 302
    assert api(raw).get("/api/v1/jobs/").status_code == 401
    assert "revoked" in browser.get("/tokens/").content.decode()


def test_rates_parse_and_bad_ones_say_what_is_expected():
    assert parse_rate("20/min") == (20, 60)
    assert parse_rate("5/h") == (5, 3600)
    with pytest.raises(ValueError, match="expected like '20/min'"):
        parse_rate("often")


def test_failures_that_straddle_a_window_edge_still_block(settings):
    """Two failures just before a minute's edge and a third try just after it: a fixed
    window would forget the first two; the sliding window still counts them."""
    settings.LOCKSTEP_THROTTLE_AUTH_FAILURES = "2/min"
    address = fresh_address()
    edge = (int(timezone.now().timestamp()) // 60 + 1) * 60.0  # a minute boundary to come
    record_failure(address, now=edge - 0.5)
    assert retry_after(address, now=edge - 0.4) is None  # one failure: under the limit
    record_failure(address, now=edge - 0.3)
    # Blocked until their bucket (ending at the edge) leaves the view, a period later:
    assert retry_after(address, now=edge - 0.2) == 61  # 60.2 s, rounded up
    assert retry_after(address, now=edge + 0.1) == 60  # the edge forgets nothing
    assert retry_after(address, now=edge + 30) == 30
    assert retry_after(address, now=edge + 60.5) is None  # a period after their bucket ended


def test_failures_leave_the_view_oldest_first(settings):
    settings.LOCKSTEP_THROTTLE_AUTH_FAILURES = "2/min"
    address = fresh_address()
    start = int(timezone.now().timestamp()) // 60 * 60.0 + 120
    record_failure(address, now=start + 1)
    record_failure(address, now=start + 31)
    # The first failure's bucket ends at +6 and leaves the view at +66; one left: free.
    assert retry_after(address, now=start + 40) == 26
    assert retry_after(address, now=start + 66.5) is None


@pytest.mark.django_db
def test_wrong_tokens_past_the_limit_block_the_address_even_with_a_good_token(
    make_user, token_for, settings
):
    settings.LOCKSTEP_THROTTLE_AUTH_FAILURES = "3/min"
    good = token_for(make_user("gus"))
    guesser, neighbour = fresh_address(), fresh_address()
    codes = [api(f"lst_guess{i}", guesser).get("/api/v1/jobs/").status_code for i in range(4)]
    assert codes == [401, 401, 401, 429]
    blocked = api(good, guesser).get("/api/v1/jobs/")
    assert blocked.status_code == 429
    assert 1 <= int(blocked["Retry-After"]) <= 66  # a period and at most one bucket (6 s)
    assert "Too many failed" in blocked.json()["detail"]
    # Another address is not affected; good tokens never count.
    for _ in range(5):
        assert api(good, neighbour).get("/api/v1/jobs/").status_code == 200


@pytest.mark.django_db
def test_wrong_passwords_past_the_limit_block_the_sign_in_form(make_user, settings):
    settings.LOCKSTEP_THROTTLE_AUTH_FAILURES = "2/min"
    make_user("hal")
    address = fresh_address()
    browser = Client(REMOTE_ADDR=address)
    wrong = [browser.post("/login/", {"username": "hal", "password": "nope"}) for _ in range(2)]
    assert [r.status_code for r in wrong] == [200, 200]  # the form again, with its error
    right = browser.post("/login/", {"username": "hal", "password": "pw-hal"})
    assert right.status_code == 429 and "Too many failed sign-ins" in right.content.decode()
    assert "_auth_user_id" not in browser.session
    # From elsewhere the right password works.
    elsewhere = Client(REMOTE_ADDR=fresh_address())
    assert elsewhere.post("/login/", {"username": "hal", "password": "pw-hal"}).status_code == 302


@pytest.mark.django_db
def test_wrong_agent_tokens_past_the_limit_block_the_address(settings):
    settings.LOCKSTEP_THROTTLE_AUTH_FAILURES = "2/min"
    address = fresh_address()
    body = {"name": "n1", "gpus": 1, "address": "127.0.0.1", "boot_id": "b"}
    codes = [
        api("wrong-agent-token", address)
        .post("/api/v1/agent/register/", body, format="json")
        .status_code
        for _ in range(3)
    ]
    assert codes == [401, 401, 429]
    beat = api("node_wrong", address).post("/api/v1/agent/heartbeat/", {}, format="json")
    assert beat.status_code == 429
