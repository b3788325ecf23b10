"""The admin console's queue, nodes, reports and event log through Django's test client: each
page shows admins everything and leads their own teams only, every action changes state and
writes an Event, and bad input is a 400 with the error on its field that changes nothing."""

import csv
import io
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from jobs import actions
from jobs.models import GPU, Allocation, Attempt, Checkpoint, Event, Job, Node
from jobs.reports.usage import week_starts
from jobs.scheduling.loop import run_pass
from teams.models import Team
from tests.heartbeats import past_protection, submit

CONSOLE = ("/console/queue/", "/console/nodes/", "/console/reports/", "/console/events/")


def _client(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def shared(make_team, make_user, make_nodes):
    """Two 2-GPU nodes; team lab (quota 2, may borrow 6) runs a 1-GPU and a 2-GPU job and
    waits with a 4-GPU one, which holds a reservation on both nodes; team nlp runs a 1-GPU job.
    lena leads lab, ann is a member of lab, bob leads nlp, sam is in no team, root is staff."""
    nodes = make_nodes(2, 2)
    lab = make_team("lab", quota=2, borrow_limit=6)
    nlp = make_team("nlp", quota=2)
    users = {
        "root": make_user("root", staff=True),
        "lena": make_user("lena", team=lab, role="lead"),
        "ann": make_user("ann", team=lab),
        "bob": make_user("bob", team=nlp, role="lead"),
        "sam": make_user("sam"),
    }
    small = submit(lab, users["ann"], gpus=1)
    pair = submit(lab, users["ann"], gpus=2)
    run_pass()
    other = submit(nlp, users["bob"], gpus=1)
    big = submit(lab, users["ann"], gpus=4)
    run_pass()
    jobs = {"small": small, "pair": pair, "other": other, "big": big}
    for job in jobs.values():
        job.refresh_from_db()
    return {"nodes": nodes, "lab": lab, "nlp": nlp, "users": users, "jobs": jobs}


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


# --- queue -----------------------------------------------------------------------------------


def _rows(html: str, attribute: str) -> set[str]:
    import re

    return set(re.findall(rf'<tr {attribute}="([^"]+)"', html))


@pytest.mark.django_db
def test_the_queue_shows_every_live_and_waiting_job_and_the_reservation(shared):
    jobs = shared["jobs"]
    expected = set(
        Job.objects.filter(
            state__in=["QUEUED", "STARTING", "RUNNING", "RESTARTING", "PREEMPTING"]
        ).values_list("id", flat=True)
    )
    assert expected == {j.id for j in jobs.values()}
    response = _client(shared["users"]["root"]).get("/console/queue/")
    html = response.content.decode()
    assert response.status_code == 200
    queue = html.split('id="queue"')[1]
    assert _rows(queue, "data-job") == {str(i) for i in expected}
    big = jobs["big"]
    assert big.state == "QUEUED" and "holds a reservation on node-0, node-1" in big.reason
    # The pass stored the same reason as data, and the page renders from that.
    assert big.wait["code"] == "reserved" and big.wait["data"]["nodes"] == ["node-0", "node-1"]
    reservations = html.split('id="reservations"')[1].split("</table>")[0]
    assert _rows(reservations, "data-job") == {str(big.id)}
    assert "nodes node-0, node-1" in reservations
    # Each row: team, GPUs, priority, state, reason, estimated start.
    row = queue.split(f'<tr data-job="{big.id}">')[1].split("</tr>")[0]
    assert ">lab<" in row and ">4<" in row and "QUEUED" in row
    assert big.estimated_start_at is not None
    assert big.estimated_start_at.strftime("%b %-d %H:%M") in row
    assert '<option value="normal" selected>' in row
    running = queue.split(f'<tr data-job="{jobs["small"].id}">')[1].split("</tr>")[0]
    assert "STARTING" in running and "submitted" not in running and "ran " in running


@pytest.mark.django_db
def test_a_lead_sees_only_their_teams_jobs_in_the_queue(shared):
    html = _client(shared["users"]["lena"]).get("/console/queue/").content.decode()
    queue = html.split('id="queue"')[1]
    lab = {str(shared["jobs"][k].id) for k in ("small", "pair", "big")}
    assert _rows(queue, "data-job") == lab
    bob = _client(shared["users"]["bob"]).get("/console/queue/").content.decode()
    assert _rows(bob.split('id="queue"')[1], "data-job") == {str(shared["jobs"]["other"].id)}


@pytest.mark.django_db
def test_an_admin_changes_a_priority_and_it_is_recorded(shared):
    root = shared["users"]["root"]
    client = _client(root)
    job = shared["jobs"]["big"]
    response = client.post("/console/queue/", {"job": job.id, "priority": "urgent"})
    assert response.status_code == 302
    job.refresh_from_db()
    assert job.priority == "urgent"
    (event,) = Event.objects.filter(kind="job.priority_changed", job=job)
    assert event.actor == root and event.message == "priority normal -> urgent"
    page = client.get("/console/queue/").content.decode()
    assert f"Job {job.id}: priority normal -&gt; urgent." in page


@pytest.mark.django_db
def test_a_lead_changes_their_teams_priority_but_not_another_teams(shared):
    lena = _client(shared["users"]["lena"])
    own, other = shared["jobs"]["pair"], shared["jobs"]["other"]
    assert lena.post("/console/queue/", {"job": own.id, "priority": "high"}).status_code == 302
    own.refresh_from_db()
    assert own.priority == "high"
    response = lena.post("/console/queue/", {"job": other.id, "priority": "urgent"})
    assert response.status_code == 400
    assert "No such job in your teams." in response.content.decode()
    other.refresh_from_db()
    assert other.priority == "normal"
    assert not Event.objects.filter(kind="job.priority_changed", job=other).exists()


@pytest.mark.django_db
@pytest.mark.parametrize(
    "body, message",
    [
        (
            {"priority": "ultra"},
            "Select a valid choice. ultra is not one of the available choices.",
        ),
        ({"priority": ""}, "This field is required."),
        ({"priority": "normal"}, "already has priority normal"),
    ],
)
def test_a_bad_priority_is_refused_next_to_its_field_and_changes_nothing(shared, body, message):
    job = shared["jobs"]["big"]
    response = _client(shared["users"]["root"]).post("/console/queue/", {"job": job.id, **body})
    assert response.status_code == 400
    queue = response.content.decode().split('id="queue"')[1]
    row = queue.split(f'<tr data-job="{job.id}">')[1].split("</tr>")[0]
    assert message in row and "field-errors" in row
    job.refresh_from_db()
    assert job.priority == "normal"
    assert not Event.objects.filter(kind="job.priority_changed").exists()


@pytest.mark.django_db
def test_a_finished_or_unknown_job_cannot_get_a_priority(shared):
    root = _client(shared["users"]["root"])
    job = shared["jobs"]["small"]
    actions.do_cancel_job(job, actor=shared["users"]["root"], now=timezone.now())
    for job_id, message in (
        (job.id, f"Job {job.id} has ended (CANCELLED)."),
        (99999, "No such job in your teams."),
    ):
        response = root.post("/console/queue/", {"job": job_id, "priority": "high"})
        assert response.status_code == 400
        assert message in response.content.decode()
    job.refresh_from_db()
    assert job.priority == "normal"
    assert not Event.objects.filter(kind="job.priority_changed").exists()


# --- nodes -----------------------------------------------------------------------------------


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
    assert "rejoins when its agent returns" in row1


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


# --- reports ---------------------------------------------------------------------------------


@pytest.fixture
def history(make_team, make_user, make_nodes, make_recorded_job):
    """Last week: lab held 2 GPUs for 3 h on an attempt that failed an hour after its last
    checkpoint; nlp held 1 GPU for an hour on an attempt preempted without a checkpoint. nlp
    has held another GPU since two hours before this week began. Every GPU (4) registered a
    day before last week."""
    now = timezone.now()
    previous, this = week_starts(now, 2)
    nodes = make_nodes(2, 2)
    Node.objects.update(registered_at=previous - timedelta(days=1))
    gpus = list(GPU.objects.order_by("node__name", "index"))
    lab, nlp = make_team("lab", quota=2), make_team("nlp", quota=2)
    ann, bob = make_user("ann", team=lab), make_user("bob", team=nlp)
    lead = make_user("lena", team=lab, role="lead")

    def held(job, state, start, end, on, checkpoint_at=None):
        attempt = job.attempts.get()
        Attempt.objects.filter(pk=attempt.pk).update(state=state)
        for rank, gpu in enumerate(on):
            Allocation.objects.create(
                attempt=attempt,
                gpu=gpu,
                node=gpu.node,
                rank=rank,
                local_rank=rank,
                group_rank=0,
                claimed_at=start,
                released_at=end,
            )
        if checkpoint_at:
            Checkpoint.objects.create(
                job=job, attempt=attempt, step=10, path=f"/c/{job.id}", created_at=checkpoint_at
            )

    t1 = previous + timedelta(days=1)
    failed = make_recorded_job(lab, ann, submitted=t1, gpus=2, runs=[(t1, t1 + timedelta(hours=3))])
    held(failed, "failed", t1, t1 + timedelta(hours=3), gpus[:2], t1 + timedelta(hours=2))
    t2 = previous + timedelta(days=2)
    preempted = make_recorded_job(nlp, bob, submitted=t2, runs=[(t2, t2 + timedelta(hours=1))])
    held(preempted, "preempted", t2, t2 + timedelta(hours=1), gpus[2:3])
    t3 = this - timedelta(hours=2)
    running = make_recorded_job(nlp, bob, submitted=t3, runs=[(t3, None)])
    held(running, "running", t3, None, gpus[3:4])
    return {"now": now, "weeks": (previous, this), "nodes": nodes, "lead": lead, "lab": lab}


def _expected(history):
    """The figures worked out by hand from the fixture's story (GPU-hours)."""
    previous, this = history["weeks"]
    now = timezone.now()
    this_week_h = (now - this).total_seconds() / 3600
    return {
        (str(previous.date()), "lab"): (6.0, 2.0, 0.0, 4 / 6),
        (str(previous.date()), "nlp"): (3.0, 0.0, 1.0, 2 / 3),
        (str(this.date()), "lab"): (0.0, 0.0, 0.0, None),
        (str(this.date()), "nlp"): (this_week_h, 0.0, 0.0, 1.0),
    }, {
        str(previous.date()): (4 * 168.0, 9.0),
        str(this.date()): (4 * this_week_h, this_week_h),
    }


@pytest.mark.django_db
def test_the_csv_export_has_the_hours_used_lost_and_goodput_per_team_and_week(history, make_user):
    root = _client(make_user("root", staff=True))
    response = root.get("/console/reports/?weeks=2&format=csv")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(response.content.decode())))
    teams, cluster = _expected(history)
    by_key = {(r["week"], r["team"]): r for r in rows if r["team"] != "*"}
    assert set(by_key) == set(teams)
    for key, (used, failure, preemption, goodput) in teams.items():
        row = by_key[key]
        assert float(row["gpu_hours_used"]) == pytest.approx(used, abs=0.02), key
        assert float(row["gpu_hours_lost_failures"]) == pytest.approx(failure, abs=0.01), key
        assert float(row["gpu_hours_lost_preemption"]) == pytest.approx(preemption, abs=0.01)
        if goodput is None:
            assert row["goodput"] == ""
        else:
            assert float(row["goodput"]) == pytest.approx(goodput, abs=0.001), key
    totals = {r["week"]: r for r in rows if r["team"] == "*"}
    for week, (capacity, allocated) in cluster.items():
        assert float(totals[week]["cluster_gpu_hours"]) == pytest.approx(capacity, abs=0.05)
        assert float(totals[week]["gpu_hours_used"]) == pytest.approx(allocated, abs=0.02)
        assert float(totals[week]["cluster_gpu_hours_idle"]) == pytest.approx(
            capacity - allocated, abs=0.05
        )


@pytest.mark.django_db
def test_the_report_page_shows_totals_and_charts_and_a_lead_sees_their_team_only(history):
    lead = _client(history["lead"])
    html = lead.get("/console/reports/?weeks=2").content.decode()
    totals = html.split('id="report-totals"')[1].split("</table>")[0]
    assert _rows(totals, "data-team") == {"lab"}
    lab = totals.split('<tr data-team="lab">')[1]
    assert ">6.0<" in lab and ">2.0<" in lab and ">66.7%<" in lab
    assert 'id="report-cluster"' not in html  # the cluster's capacity is the admins' business
    assert "/vendor/plotly.min.js" in html and 'id="report-figures"' in html
    rows = list(
        csv.DictReader(io.StringIO(lead.get("/console/reports/?format=csv").content.decode()))
    )
    assert {r["team"] for r in rows} == {"lab"}
    # Without a window, the last 4 weeks; a bad one is an error next to the field.
    html = lead.get("/console/reports/").content.decode()
    weekly = html.split('id="report-weeks"')[1]
    assert weekly.count('<td data-label="Team">lab</td>') == 4
    for bad, message in (("abc", "Enter a whole number."), ("0", "greater than or equal to 1")):
        response = lead.get(f"/console/reports/?weeks={bad}")
        assert response.status_code == 400
        form = response.content.decode().split('id="report-form"')[1].split("</form>")[0]
        assert message in form and "field-errors" in form
        response = lead.get(f"/console/reports/?weeks={bad}&format=csv")
        assert response.status_code == 400 and message in response.content.decode()


# --- event log -------------------------------------------------------------------------------


@pytest.mark.django_db
def test_the_event_log_filters_by_kind_team_job_node_and_time_and_pages(shared):
    root = shared["users"]["root"]
    client = _client(root)
    big = shared["jobs"]["big"]
    for n in range(55):
        actions.do_set_job_priority(big, priority="high" if n % 2 == 0 else "normal", actor=root)
    actions.do_cordon_node(shared["nodes"][1], actor=root, reason="fans", now=timezone.now())

    def count(html):
        return html.count("<tr data-kind=")

    html = client.get("/console/events/?kind=job.priority_changed").content.decode()
    assert count(html) == 50 and "55 events" in html and "page 1 of 2" in html
    html = client.get("/console/events/?kind=job.priority_changed&page=2").content.decode()
    assert count(html) == 5
    assert 'href="?kind=job.priority_changed&amp;page=1"' in html

    html = client.get(f"/console/events/?job={big.id}").content.decode()
    assert count(html) == min(50, Event.objects.filter(job=big).count())
    html = client.get("/console/events/?node=node-1").content.decode()
    expected = Event.objects.filter(node__name="node-1").count()
    assert count(html) == expected and "node node-1 cordoned by root: fans" in html
    html = client.get("/console/events/?team=nlp").content.decode()
    nlp = shared["nlp"]
    assert (
        count(html)
        == Event.objects.filter(team=nlp).count()
        + Event.objects.filter(team__isnull=True, job__team=nlp).count()
    )

    # A time range: move three events into yesterday.
    old = list(Event.objects.order_by("id").values_list("id", flat=True)[:3])
    yesterday = timezone.now() - timedelta(days=1)
    Event.objects.filter(id__in=old).update(created_at=yesterday)
    since = (yesterday - timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M")
    until = (yesterday + timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M")
    html = client.get(f"/console/events/?since={since}&until={until}").content.decode()
    assert count(html) == 3


@pytest.mark.django_db
def test_a_lead_sees_only_their_teams_events(shared):
    lena = _client(shared["users"]["lena"])
    html = lena.get("/console/events/").content.decode()
    lab = shared["lab"]
    from django.db.models import Q

    expected = Event.objects.filter(Q(team=lab) | Q(job__team=lab)).count()
    assert html.count("<tr data-kind=") == min(expected, 50) and expected > 0
    assert "node.registered" not in html
    other = shared["jobs"]["other"]
    response = lena.get(f"/console/events/?job={other.id}")
    assert response.status_code == 400 and "No such job in your teams." in response.content.decode()
    response = lena.get("/console/events/?team=nlp")
    assert response.status_code == 400 and "Select a valid choice" in response.content.decode()


@pytest.mark.django_db
def test_bad_event_filters_are_400s_with_the_error_next_to_the_field(shared):
    client = _client(shared["users"]["root"])
    for query, message in (
        ("node=node-9", "No such node."),
        ("job=abc", "Enter a whole number."),
        ("since=yesterday", "Enter a valid date/time."),
        ("since=2026-01-02T00:00&until=2026-01-01T00:00", "Must be after the start."),
    ):
        response = client.get(f"/console/events/?{query}")
        assert response.status_code == 400, query
        html = response.content.decode()
        assert message in html and "field-errors" in html, query
        assert "No events match." in html


def test_reservations_are_read_from_the_wait_data_the_scheduler_writes():
    """The queue page renders what a job holds from Job.wait (the plan's WaitReason as data),
    not by parsing the sentence."""
    import dataclasses

    from jobs.scheduling.policy import plan
    from jobs.scheduling.vocab import WaitReason
    from portal.console.queue import reservation_of
    from tests.builders import job, node, running, snapshot, team

    held = WaitReason("reserved", {"gpus": 16, "free": 3, "nodes": ["n1", "n2"], "ahead": 2})
    assert reservation_of(held.to_json()) == "nodes n1, n2"
    assert "holds a reservation on n1, n2" in held.text()  # the sentence says the same
    assert reservation_of({}) is None
    assert reservation_of(WaitReason("too_large", {"gpus": 64, "capacity": 16}).to_json()) is None
    # The waits the policy writes today, for a priority claim inside a team and for a
    # claimant waiting on its victims.
    lab = team("lab", quota=8, used=8)
    n1 = node("n1", 8, busy=8)
    low = running(10, n1, range(8), team_id=lab.id, prio=0)
    decided = plan(snapshot([n1], [job(1, 8, team_id=lab.id, prio=2)], [lab], [low]))
    assert decided.waits[1].text() == decided.reasons[1]
    assert reservation_of(decided.waits[1].to_json()).startswith("the GPUs of job 10")
    claimant = dataclasses.replace(job(2, 8, team_id=lab.id), claim_nodes=(n1.id,))
    stopping = dataclasses.replace(low, stopping=True, claimant_id=2)
    wait = plan(snapshot([n1], [claimant], [lab], [stopping])).waits[2]
    assert reservation_of(wait.to_json()).startswith("the GPUs of job 10"), wait


# --- preemptions -----------------------------------------------------------------------------


@pytest.mark.django_db
def test_a_priority_raised_in_the_queue_becomes_a_preemption_an_admin_approves(shared, settings):
    """The preemptions page shows claimant, victim, the victim's work at risk and when the
    request approves itself, with Approve / Reject; approving writes an Event."""
    from jobs.models import PreemptionRequest

    root = shared["users"]["root"]
    client = _client(root)
    big = shared["jobs"]["big"]
    # The running jobs are past their minimum run (never reported up: no start timeout here).
    settings.LOCKSTEP = {**settings.LOCKSTEP, "START_TIMEOUT_S": 1e9}
    past_protection()
    # Within lab's quota: a borrowing claimant may not stop nlp's job, which is within nlp's
    # quota (DESIGN: guaranteed work is never preempted for another team's borrowing).
    big.team.__class__.objects.filter(pk=big.team_id).update(quota=8)
    assert client.post("/console/queue/", {"job": big.id, "priority": "urgent"}).status_code == 302
    run_pass()
    requests = list(PreemptionRequest.objects.filter(claimant=big, state="proposed"))
    assert requests and all(r.auto_approve_at for r in requests)
    html = client.get("/console/preemptions/").content.decode()
    table = html.split('id="preemptions"')[1]
    for request in requests:
        row = table.split(f'data-request="{request.id}"')[1].split("</tr>")[0]
        assert f"job {big.id}</a> (lab, urgent)" in row
        victim = request.victim
        assert f"job {victim.id}</a> ({victim.team.name}, {victim.priority})" in row
        assert f"{request.work_at_risk_s:.0f}s since its last checkpoint" in row
        assert request.auto_approve_at.strftime("%H:%M:%S") in row
        assert 'value="approve"' in row and 'value="reject"' in row
    # Only an explicit decision decides; bad ids are not found (nothing changes either way).
    last = requests[-1]
    for bad in ({"request_id": last.id}, {"request_id": last.id, "decision": "aprove"}):
        assert client.post("/console/preemptions/", bad).status_code == 400
    for bad_id in ("x", "", "-1"):
        response = client.post(
            "/console/preemptions/", {"request_id": bad_id, "decision": "reject"}
        )
        assert response.status_code == 404
    last.refresh_from_db()
    assert last.state == "proposed"
    if len(requests) > 1:
        response = client.post(
            "/console/preemptions/", {"request_id": last.id, "decision": "reject"}
        )
        assert response.status_code == 302
        last.refresh_from_db()
        assert last.state == "rejected" and last.decided_by == root
    first = requests[0]
    response = client.post("/console/preemptions/", {"request_id": first.id, "decision": "approve"})
    assert response.status_code == 302
    first.refresh_from_db()
    assert first.state in ("approved", "executed") and first.decided_by == root
    assert Event.objects.filter(kind="preemption.approved", actor=root).exists()


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
