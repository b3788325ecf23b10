"""The admin console as a whole, through Django's test client: who reaches it (admins
everything, leads their own teams only, members and strangers a 404), the teams page, and what
each page costs in queries. Each page's own tests are in tests/test_console_<page>.py: the
queue and preemptions (_queue), nodes (_nodes), reports and the event log (_reports). Every
action changes state and writes an Event, and bad input is a 400 with the error on its field
that changes nothing."""

import pytest
from django.test import Client

from jobs.models import Event
from jobs.scheduling.loop import run_pass
from teams.models import Team
from tests.console_helpers import (
    CONSOLE,
    _client,
    shared_fixture,  # noqa: F401 (fixture)
)
from tests.heartbeats import submit

# --- access ----------------------------------------------------------------------------------


@pytest.mark.django_db
def test_members_and_strangers_get_404_and_anonymous_users_are_sent_to_log_in(shared):
    for name in ("ann", "sam"):
        client = _client(shared["users"][name])
        for url in CONSOLE:
            assert client.get(url).status_code == 404, (name, url)
        assert (
            client.post("/console/queue/", {"job": shared["jobs"]["small"].id}).status_code == 404
        )
    for url in CONSOLE:
        response = Client().get(url)
        assert response.status_code == 302 and "/login/" in response["Location"]


@pytest.mark.django_db
def test_a_lead_reaches_queue_reports_and_events_but_not_nodes(shared):
    lena = _client(shared["users"]["lena"])
    for url in ("/console/queue/", "/console/reports/", "/console/events/"):
        assert lena.get(url).status_code == 200, url
    assert lena.get("/console/nodes/").status_code == 404
    node = shared["nodes"][0]
    response = lena.post("/console/nodes/", {"node": node.name, "action": "cordon", "reason": "x"})
    assert response.status_code == 404
    node.refresh_from_db()
    assert node.state == "up"
    # The nav offers the console to leads, and not to members.
    assert 'href="/console/queue/"' in lena.get("/").content.decode()
    assert 'href="/console/queue/"' not in _client(shared["users"]["ann"]).get("/").content.decode()


# --- teams -----------------------------------------------------------------------------------


@pytest.mark.django_db
def test_the_teams_page_splits_use_into_guaranteed_and_borrowed(shared):
    html = _client(shared["users"]["root"]).get("/console/teams/").content.decode()
    lab = html.split('<tr data-team="lab">')[1].split("</tr>")[0]
    nlp = html.split('<tr data-team="nlp">')[1].split("</tr>")[0]
    # lab holds 3 GPUs against a quota of 2 (borrow limit 6); nlp 1 against 2.
    assert '<td class="guaranteed">2 / 2</td>' in lab and '<td class="borrowed">1 / 6</td>' in lab
    assert '<td class="guaranteed">1 / 2</td>' in nlp and '<td class="borrowed">0 / 0</td>' in nlp


@pytest.mark.django_db
def test_an_admin_refuses_process_runtime_nodes_for_a_team_on_the_teams_page(shared):
    root = _client(shared["users"]["root"])
    lab = Team.objects.get(name="lab")
    form = {"team_id": lab.id, "quota": lab.quota, "borrow_limit": lab.borrow_limit}
    done = root.post("/console/teams/", {**form, "weight": 1, "isolated_only": "on"})
    assert done.status_code == 302
    assert Team.objects.get(name="lab").isolated_only
    (event,) = Event.objects.filter(kind="team.isolation_changed")
    assert event.message == "lab's jobs now run on isolated (container) nodes only"
    html = root.get("/console/teams/").content.decode()
    row = html.split('<tr data-team="lab">')[1].split("</tr>")[0]
    assert 'name="isolated_only"' in row and "checked" in row
    # Bad input elsewhere in the row changes nothing, the box included.
    bad = root.post("/console/teams/", {**form, "weight": "heavy"})
    assert bad.status_code == 200 and Team.objects.get(name="lab").isolated_only
    root.post("/console/teams/", {**form, "weight": 1})  # the box unticked
    assert not Team.objects.get(name="lab").isolated_only
    assert Event.objects.filter(kind="team.isolation_changed").count() == 2


# --- cost ------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_the_console_pages_make_the_same_number_of_queries_for_more_rows(shared, make_nodes):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    client = _client(shared["users"]["root"])

    def queries(url: str) -> int:
        with CaptureQueriesContext(connection) as ctx:
            assert client.get(url).status_code == 200
        return len(ctx.captured_queries)

    before = {url: queries(url) for url in CONSOLE}
    for _ in range(10):
        submit(shared["lab"], shared["users"]["ann"], gpus=1)
    make_nodes(3, 2, prefix="extra")
    run_pass()
    assert {url: queries(url) for url in CONSOLE} == before


@pytest.mark.django_db
def test_a_superuser_who_is_not_staff_is_a_cluster_admin_everywhere(make_user, make_nodes):
    from django.contrib.auth import get_user_model
    from rest_framework.test import APIClient

    from jobs.models import Node

    root = get_user_model().objects.create_user("root2", password="pw", is_superuser=True)
    member = make_user("plain")
    (node,) = make_nodes(1, 2)
    api = APIClient()
    api.force_authenticate(root)
    answer = api.post(f"/api/v1/nodes/{node.id}/cordon/", {"reason": "disk"}, format="json")
    assert answer.status_code == 200, answer.content
    assert Node.objects.get(pk=node.pk).state == "cordoned"
    browser = Client()
    browser.force_login(root)
    for page in ("/console/teams/", "/console/preemptions/"):
        assert browser.get(page).status_code == 200
    # Anyone else: the 404 a missing page gets, not a redirect that says the page exists.
    other = Client()
    other.force_login(member)
    for page in ("/console/teams/", "/console/preemptions/"):
        assert other.get(page).status_code == 404
