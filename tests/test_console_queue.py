"""The console's queue page (every live and waiting job, its reservation, priority changes
by admins and by leads for their own teams) and its preemptions page (the requests a raised
priority makes, approved or rejected by an admin), through Django's test client."""

import pytest
from django.utils import timezone

from jobs import actions
from jobs.models import Event, Job
from jobs.scheduling.loop import run_pass
from tests.console_helpers import (
    _client,
    _rows,
    shared_fixture,  # noqa: F401 (fixture)
)
from tests.heartbeats import past_protection

# --- queue -----------------------------------------------------------------------------------


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


def test_reservations_are_read_from_the_wait_data_the_scheduler_writes():
    """The queue page renders what a job holds from Job.wait (the plan's WaitReason as data),
    not by parsing the sentence."""
    import dataclasses
    from datetime import timedelta

    from jobs.scheduling.policy import plan
    from jobs.scheduling.vocab import WaitReason
    from portal.console.queue import reservation_of
    from tests.builders import T0, job, node, running, snapshot, team

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
    # A claim waiting for a job that ends within the grace anyway: nothing is stopped.
    guest = team("guest", quota=0, borrow=8, used=8)
    lent = running(10, n1, range(8), team_id=guest.id)
    ending = dataclasses.replace(lent, frees_by=T0 + timedelta(seconds=30))
    owner = team("owner", quota=8, used=0)
    on = dataclasses.replace(
        snapshot([n1], [job(1, 8, team_id=owner.id)], [owner, guest], [ending]),
        wait_for_ending=True,  # the setting WAIT_FOR_ENDING_JOBS
    )
    wait = plan(on).waits[1]
    assert wait.code == "ending"
    assert reservation_of(wait.to_json()) == "the GPUs of job 10, once ended (nothing stopped)"


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
