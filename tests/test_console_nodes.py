"""The console's nodes page, for admins only: each node's state, GPUs in use, heartbeat,
strikes, recent failures and last health check; cordon, uncordon and drain with a reason, each
an Event, and bad actions refused next to their field, through Django's test client."""

import pytest
from django.utils import timezone

from jobs import actions
from jobs.models import Allocation, Attempt, Event, Node
from tests.console_helpers import (
    _client,
    _rows,
    shared_fixture,  # noqa: F401 (fixture)
)


@pytest.mark.django_db
def test_the_nodes_page_shows_state_gpus_heartbeat_strikes_and_recent_failures(shared):
    node0, node1 = shared["nodes"]
    # node-1 goes silent: its job's attempt is lost, which is a strike against the node.
    actions.do_mark_node_lost(node1, now=timezone.now(), reason="no heartbeat for 31s")
    html = _client(shared["users"]["root"]).get("/console/nodes/").content.decode()
    assert _rows(html, "data-node") == {"node-0", "node-1"}
    row0 = html.split('<tr data-node="node-0">')[1].split("</tr>")[0]
    row1 = html.split('<tr data-node="node-1">')[1].split("</tr>")[0]
    busy0 = Allocation.objects.filter(node=node0, released_at__isnull=True).count()
    assert busy0 == 2  # the 1-GPU jobs of lab and nlp
    assert f"{busy0} / 2" in row0 and "state-up" in row0 and ">ok<" in row0
    assert ">default<" in row0 and " s ago" in row0
    assert Event.objects.filter(node=node1, kind="node.strike").count() == 1
    assert "state-down" in row1 and "no heartbeat for 31s" in row1
    assert "0 / 2" in row1
    assert '<td data-label="Strikes">1</td>' in row1
    assert "node node-1 down" in row1 and "attempt 1 lost" in row1
    assert "rejoins as up when its agent returns" in row1
    # Cordoned while down: it will come back cordoned, and says so.
    client = _client(shared["users"]["root"])
    client.post("/console/nodes/", {"node": "node-1", "action": "cordon", "reason": "check fan"})
    html = client.get("/console/nodes/").content.decode()
    row1 = html.split('<tr data-node="node-1">')[1].split("</tr>")[0]
    assert "state-down" in row1 and "rejoins as cordoned when its agent returns" in row1
    node1.refresh_from_db()
    assert (node1.state, node1.held_state, node1.held_reason) == ("down", "cordoned", "check fan")


@pytest.mark.django_db
def test_the_nodes_page_shows_the_last_health_check_and_why_it_failed(shared):
    node0, node1 = shared["nodes"]
    ok = {"kind": "full", "ok": True, "checks": [], "reason": "", "compute_ms": 4.6}
    actions.do_record_health(node0, ok, now=timezone.now())
    failed = {
        "kind": "full",
        "ok": False,
        "checks": [{"name": "collective", "ok": False, "detail": "no address for nope0"}],
        "reason": "collective: no address for nope0",
    }
    actions.do_record_health(node1, failed, now=timezone.now())
    html = _client(shared["users"]["root"]).get("/console/nodes/").content.decode()
    row0 = html.split('<tr data-node="node-0">')[1].split("</tr>")[0]
    row1 = html.split('<tr data-node="node-1">')[1].split("</tr>")[0]
    assert ">ok<" in row0 and "full check 0 s ago, matmul 4.6 ms" in row0
    assert "check failed: collective: no address for nope0" in row1
    assert "state-cordoned" in row1


@pytest.mark.django_db
def test_an_admin_cordons_and_uncordons_a_node_with_a_reason(shared):
    root = shared["users"]["root"]
    client = _client(root)
    node = shared["nodes"][0]
    response = client.post(
        "/console/nodes/", {"node": "node-0", "action": "cordon", "reason": "ECC errors"}
    )
    assert response.status_code == 302
    node.refresh_from_db()
    assert (node.state, node.state_reason) == ("cordoned", "ECC errors")
    (event,) = Event.objects.filter(kind="node.cordoned", node=node)
    assert event.actor == root and "ECC errors" in event.message
    # Cordoned: running work carries on.
    assert Attempt.objects.filter(allocations__node=node, state="starting").exists()
    response = client.post(
        "/console/nodes/", {"node": "node-0", "action": "uncordon", "reason": "DIMM replaced"}
    )
    assert response.status_code == 302
    node.refresh_from_db()
    assert (node.state, node.state_reason) == ("up", "")
    (event,) = Event.objects.filter(kind="node.uncordoned", node=node)
    assert event.actor == root and "DIMM replaced" in event.message


@pytest.mark.django_db
def test_draining_a_node_checkpoints_and_stops_its_jobs(shared):
    node = shared["nodes"][1]
    live = list(Attempt.objects.filter(allocations__node=node, ended_at__isnull=True).distinct())
    assert live
    response = _client(shared["users"]["root"]).post(
        "/console/nodes/", {"node": "node-1", "action": "drain", "reason": "firmware update"}
    )
    assert response.status_code == 302
    node.refresh_from_db()
    assert node.state == "draining"
    assert Event.objects.filter(kind="node.draining", node=node).count() == 1
    for attempt in live:
        attempt.refresh_from_db()
        assert attempt.state == "stopping" and "firmware update" in attempt.end_reason


@pytest.mark.django_db
@pytest.mark.parametrize(
    "body, field_message",
    [
        ({"node": "node-0", "action": "cordon", "reason": ""}, "Say why"),
        ({"node": "node-0", "action": "cordon", "reason": "   "}, "Say why"),
        ({"node": "node-9", "action": "cordon", "reason": "x"}, "No such node."),
        ({"node": "node-0", "action": "reboot", "reason": "x"}, "Select a valid choice"),
        ({"node": "node-0", "action": "uncordon", "reason": "x"}, "node-0 is up already."),
    ],
)
def test_bad_node_actions_are_refused_with_a_field_error_and_change_nothing(
    shared, body, field_message
):
    before = Event.objects.count()
    response = _client(shared["users"]["root"]).post("/console/nodes/", body)
    assert response.status_code == 400
    html = response.content.decode()
    if body["node"] == "node-0":
        html = html.split('<tr data-node="node-0">')[1].split("</tr>")[0]
    assert field_message in html and "field-errors" in html
    assert set(Node.objects.values_list("state", flat=True)) == {"up"}
    assert Event.objects.count() == before
