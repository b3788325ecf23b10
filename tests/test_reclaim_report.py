"""Reclaim times per team, as measured on PreemptionRequest rows, against their bound: the
numbers, the breach flag, and where admins and the team API see them."""

import re
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone
from rest_framework.test import APIClient

from jobs.models import Job, PreemptionRequest
from jobs.reports.reclaim import reclaim_bound_s, reclaim_summary
from tests.heartbeats import submit

GRACE, TICK, APPROVAL = 60.0, 5.0, 300.0


@pytest.fixture
def claims(make_team, make_user, settings):
    """Team owner's claims: 30 s; 50 s (two victims, proposed 10 s apart); 100 s (over its
    65 s bound); a priority claim of 200 s (bound 365 s). Team guest: one claimant still
    queued 400 s after its reclaim was executed. Rejected, withdrawn, abandoned and too-old
    requests, which do not count."""
    settings.LOCKSTEP = {
        **settings.LOCKSTEP,
        "STOP_GRACE_S": GRACE,
        "SCHEDULER_TICK_S": TICK,
        "PREEMPTION_APPROVAL_DELAY_S": APPROVAL,
    }
    now = timezone.now()
    owner, guest, quiet = (
        make_team("owner", quota=4),
        make_team("guest", quota=2, borrow_limit=2),
        make_team("quiet", quota=1),
    )
    olga, gus = make_user("olga", team=owner), make_user("gus", team=guest)

    def job(team, user, state):
        made = submit(team, user, gpus=1)
        Job.objects.filter(pk=made.pk).update(state=state)
        return made

    def request(claimant, *, ago, took=None, kind="reclaim", state="executed"):
        created = now - timedelta(seconds=ago)
        return PreemptionRequest.objects.create(
            victim=job(guest, gus, "PREEMPTING"),
            claimant=claimant,
            kind=kind,
            state=state,
            reason="test",
            created_at=created,
            executed_at=created,
            claimant_started_at=None if took is None else created + timedelta(seconds=took),
        )

    request(job(owner, olga, "RUNNING"), ago=3600, took=30)
    two_victims = job(owner, olga, "RUNNING")
    first = request(two_victims, ago=3000, took=50)
    request(two_victims, ago=2990, took=40)  # the same start: one claim, from the first
    assert first.reclaim_s == 50
    request(job(owner, olga, "RUNNING"), ago=2000, took=100)
    request(job(owner, olga, "RUNNING"), ago=1000, took=200, kind="priority")
    request(job(guest, gus, "QUEUED"), ago=400)  # still waiting, past its bound
    request(job(owner, olga, "QUEUED"), ago=900, kind="priority", state="rejected")
    request(job(owner, olga, "RUNNING"), ago=800, kind="priority", state="withdrawn")
    request(job(owner, olga, "CANCELLED"), ago=700)  # gave up without starting
    request(job(owner, olga, "RUNNING"), ago=8 * 86400, took=5000)  # before the window
    return now, owner, guest, quiet, olga


@pytest.mark.django_db
def test_the_summary_counts_claims_per_team_against_their_bound(claims):
    now, owner, guest, quiet, _ = claims
    assert reclaim_bound_s("reclaim") == GRACE + TICK
    assert reclaim_bound_s("priority") == GRACE + TICK + APPROVAL

    summary = reclaim_summary(
        since=now - timedelta(days=7),
        now=now,
        teams={t.id: t.name for t in (owner, guest, quiet)},
    )

    mine = summary[owner.id]
    assert (mine["claims"], mine["median_s"], mine["max_s"]) == (4, 75.0, 200.0)
    assert mine["by_kind"] == {"reclaim": 3, "priority": 1, "starvation": 0, "backfill": 0}
    assert (mine["breaches"], mine["waiting"], mine["breached"]) == (1, 0, True)
    assert mine["bound_s"] == {
        "reclaim": 65.0,
        "priority": 365.0,
        "starvation": 65.0,
        "backfill": 65.0,
    }
    theirs = summary[guest.id]
    assert (theirs["claims"], theirs["median_s"], theirs["breaches"]) == (0, None, 0)
    assert (theirs["waiting"], theirs["waiting_over_bound"], theirs["breached"]) == (1, 1, True)
    assert theirs["oldest_waiting_s"] == pytest.approx(400, abs=1)
    assert summary[quiet.id]["claims"] == 0 and summary[quiet.id]["breached"] is False


@pytest.mark.django_db
def test_a_team_within_its_bound_is_not_flagged(claims):
    now, owner, *_ = claims
    PreemptionRequest.objects.filter(claimant_started_at__isnull=False).exclude(
        kind="priority"
    ).update(claimant_started_at=None, state="withdrawn")
    summary = reclaim_summary(since=now - timedelta(days=7), now=now, team_ids=[owner.id])
    assert set(summary) == {owner.id}
    assert (summary[owner.id]["claims"], summary[owner.id]["breached"]) == (1, False)


@pytest.mark.django_db
def test_the_console_shows_reclaim_times_with_breaches_highlighted(claims, make_user):
    *_, olga = claims
    admin = Client()
    admin.force_login(make_user("root", staff=True))
    html = admin.get("/console/preemptions/").content.decode()
    rows = {
        team: (css, cells)
        for css, team, cells in re.findall(
            r'<tr class="([^"]*)" data-team="([^"]+)">(.*?)</tr>', html, flags=re.DOTALL
        )
    }
    assert set(rows) == {"owner", "guest"}  # teams that claimed or wait
    css, cells = rows["owner"]
    assert css == "breach"
    assert "75 s" in cells and "3.3 min" in cells and "<strong>1</strong>" in cells
    css, cells = rows["guest"]
    assert css == "breach" and "1 over the bound" in cells
    assert "reclaim 65 s, priority 6.1 min, starvation 65 s" in html
    member = Client()
    member.force_login(olga)
    assert member.get("/console/preemptions/").status_code == 404  # admins only, leaks nothing


@pytest.mark.django_db
def test_the_team_api_includes_the_same_summary(claims, make_user):
    now, owner, guest, quiet, olga = claims
    admin = APIClient()
    admin.force_authenticate(make_user("root", staff=True))
    teams = {t["name"]: t for t in admin.get("/api/v1/teams/").json()["results"]}
    expected = reclaim_summary(
        since=now - timedelta(days=7), now=now, teams={t.id: t.name for t in (owner, guest, quiet)}
    )
    for team in (owner, guest, quiet):
        got = teams[team.name]["reclaim"]
        want = expected[team.id]
        for key in ("claims", "median_s", "max_s", "breaches", "waiting", "breached", "by_kind"):
            assert got[key] == want[key], (team.name, key)
        assert got["bound_s"] == {
            "reclaim": 65.0,
            "priority": 365.0,
            "starvation": 65.0,
            "backfill": 65.0,
        }
    member = APIClient()
    member.force_authenticate(olga)
    (mine,) = member.get("/api/v1/teams/").json()["results"]
    assert mine["name"] == "owner" and mine["reclaim"]["breaches"] == 1
    assert member.get(f"/api/v1/teams/{owner.id}/").json()["reclaim"]["claims"] == 4
    changed = admin.patch(f"/api/v1/teams/{owner.id}/", {"quota": 5}, format="json")
    assert changed.status_code == 200 and changed.json()["reclaim"]["claims"] == 4


@pytest.mark.django_db
def test_a_starvation_claim_in_the_window_is_counted_on_the_console_and_the_team_api(
    claims, make_user
):
    """Starvation claims (scheduling rule 4) are automatic like reclaims: they count with the
    reclaim bound. The report once listed only reclaim and priority, and a starvation claim in
    the window made the summary raise KeyError (console page and team API answered 500)."""
    now, owner, guest, quiet, olga = claims
    made = submit(owner, olga, gpus=1)
    Job.objects.filter(pk=made.pk).update(state="RUNNING")
    victim = submit(guest, make_user("gwen", team=guest), gpus=1)
    Job.objects.filter(pk=victim.pk).update(state="PREEMPTING")
    created = now - timedelta(seconds=500)
    PreemptionRequest.objects.create(
        victim=victim,
        claimant=made,
        kind="starvation",
        state="executed",
        reason="test",
        created_at=created,
        executed_at=created,
        claimant_started_at=created + timedelta(seconds=20),
    )
    summary = reclaim_summary(since=now - timedelta(days=7), now=now, team_ids=[owner.id])
    mine = summary[owner.id]
    assert mine["by_kind"] == {"reclaim": 3, "priority": 1, "starvation": 1, "backfill": 0}
    assert mine["bound_s"]["starvation"] == GRACE + TICK  # automatic: no approval delay
    assert mine["claims"] == 5

    admin = Client()
    admin.force_login(make_user("root", staff=True))
    page = admin.get("/console/preemptions/")
    assert page.status_code == 200
    assert "starvation 65 s" in page.content.decode()
    api = APIClient()
    api.force_authenticate(olga)
    answer = api.get("/api/v1/teams/")
    assert answer.status_code == 200
    (team,) = answer.json()["results"]
    assert team["reclaim"]["by_kind"]["starvation"] == 1
