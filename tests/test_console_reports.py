"""The console's reports (GPU-hours used and lost, goodput, per team and week, as a page with
charts and as CSV) and its event log (filters, pages, a lead's own teams only), through Django's
test client."""

import csv
import io
from datetime import timedelta

import pytest
from django.utils import timezone

from jobs import actions
from jobs.models import GPU, Allocation, Attempt, Checkpoint, Event, Node
from jobs.reports.usage import week_starts
from tests.console_helpers import (
    _client,
    _rows,
    shared_fixture,  # noqa: F401 (fixture)
)

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
