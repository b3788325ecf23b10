"""A run's progress and projected end (jobs/progress.py): the script says how many steps the run
takes, the portal measures its pace, and the start estimates of the jobs waiting for its GPUs,
the job's page, the API and `lockstep status` use the end that pace projects."""

from datetime import timedelta
from types import SimpleNamespace

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from jobs.models import Attempt, Job, Node
from jobs.progress import pace
from jobs.queries import remaining_estimate
from jobs.scheduling.estimate import DEFAULT_RUNTIME_S, estimate_starts
from jobs.scheduling.loop import run_pass
from jobs.scheduling.reader import take_snapshot
from lockstep_cli.commands import _progress_text
from tests.builders import T0, job, node, running, snapshot, team
from tests.heartbeats import beat, live_attempt, step_records


def _attempt(**fields):
    base = {
        "total_steps": 1000,
        "first_step": 1,
        "first_step_at": T0,
        "last_step": 101,
        "last_progress_at": T0 + timedelta(seconds=50),
    }
    return SimpleNamespace(**{**base, **fields})


def test_the_pace_projects_the_steps_left_from_the_first_step_to_the_latest():
    got = pace(_attempt())
    assert got.steps_per_s == pytest.approx(2.0)  # 100 steps in 50 s
    assert got.projected_end == T0 + timedelta(seconds=50 + 899 / 2.0)
    assert got.fraction == pytest.approx(0.101)


def test_no_pace_without_a_total_or_before_it_has_stepped_long_enough():
    assert pace(_attempt(total_steps=None)) is None
    assert pace(_attempt(first_step=None, first_step_at=None)) is None
    # 5 s of steps: mostly the first step's warm-up, not a pace.
    assert pace(_attempt(last_progress_at=T0 + timedelta(seconds=5))) is None
    assert pace(_attempt(last_step=1)) is None  # no step since the first


def test_a_run_at_its_last_step_ends_now_whatever_its_pace():
    done = pace(_attempt(last_step=1000, last_progress_at=T0 + timedelta(seconds=3)))
    assert done.projected_end == T0 + timedelta(seconds=3) and done.fraction == 1.0


def test_a_start_estimate_waits_for_the_running_job_to_end_at_its_pace_not_an_hour():
    n = node("n", 8, busy=8)
    t = team("t", quota=8)
    run = running(1, n, range(8), team_id=t.id)  # no time limit: its end is unknown
    queued = job(2, 8, team_id=t.id)
    blind = estimate_starts(snapshot([n], [queued], [t], [run]))
    assert blind[2] == run.started_at + timedelta(seconds=DEFAULT_RUNTIME_S)
    at_pace = T0 + timedelta(minutes=5)
    from dataclasses import replace

    seen = estimate_starts(snapshot([n], [queued], [t], [replace(run, projected_end=at_pace)]))
    assert seen[2] == at_pace


@pytest.fixture
def lab(make_team, make_user, make_nodes, token_for):
    team_ = make_team("lab", quota=8)
    user = make_user("ann", team=team_)
    make_nodes(2, 4)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token_for(user)}")
    return team_, user, client


def _start(client, gpus=8, **fields):
    spec = {
        "name": "run",
        "image": "lockstep/trainer:latest",
        "command": ["python", "-m", "trainer"],
        "gpus": gpus,
        **fields,
    }
    job_id = client.post("/api/v1/jobs/", spec, format="json").json()["id"]
    run_pass()
    return Job.objects.get(pk=job_id)


def _report(attempt, records, now):
    """Rank 0's records from the node that holds rank 0, every rank still running."""
    for node_ in Node.objects.filter(allocations__attempt=attempt).distinct():
        ranks = attempt.allocations.filter(node=node_).values_list("rank", flat=True)
        beat(node_, attempt, dict.fromkeys(ranks), records=records if 0 in ranks else (), now=now)


@pytest.mark.django_db
def test_the_trainers_total_and_its_steps_give_the_job_a_projected_end(lab):
    _, _, client = lab
    first = _start(client, time_limit_s=7200)
    attempt = live_attempt(first)
    t0 = timezone.now() - timedelta(seconds=60)
    start = {"kind": "start", "rank": 0, "world_size": 8, "resumed_from_step": 0}
    _report(attempt, [{**start, "total_steps": 600}, *step_records(0, range(1, 11))], t0)
    _report(attempt, step_records(0, range(11, 101)), t0 + timedelta(seconds=45))
    attempt.refresh_from_db()
    # The pace starts at the first batch's latest step, the one done when it came in.
    assert (attempt.total_steps, attempt.first_step, attempt.last_step) == (600, 10, 100)

    body = client.get(f"/api/v1/jobs/{first.id}/").json()
    progress = body["progress"]
    assert progress["step"] == 100 and progress["total_steps"] == 600
    assert progress["steps_per_s"] == pytest.approx(90 / 45, rel=1e-3)
    end = attempt.last_progress_at + timedelta(seconds=500 / (90 / 45))
    assert abs(_parse(progress["projected_end"]) - end) < timedelta(seconds=1)
    assert progress["time_limit_end"] is None  # the limit (2 h) is after the projected end
    assert body["attempts"][0]["total_steps"] == 600
    text = _progress_text(progress)
    assert text.startswith("step 100 of 600 (17 %), 2 steps/s, ends about ")

    # The straggler rule's remaining time is the pace's, not "as long again as it has run".
    left, basis = remaining_estimate(first, now=timezone.now())
    assert basis == "at its pace: step 100 of 600"
    assert abs(left - (end - timezone.now()).total_seconds()) < 2

    # What the scheduler sees: the projected end, kept before the time limit's.
    (view,) = take_snapshot(timezone.now()).running
    assert abs(view.projected_end - end) < timedelta(seconds=1)
    assert view.expected_end > view.projected_end


@pytest.mark.django_db
def test_a_job_waiting_for_a_running_jobs_gpus_is_estimated_at_that_jobs_pace(lab):
    _, _, client = lab
    first = _start(client)  # no time limit
    attempt = live_attempt(first)
    now = timezone.now()
    _report(attempt, step_records(0, range(1, 3)), now - timedelta(seconds=40))
    _report(attempt, step_records(0, range(3, 41)), now)
    second = _start(client)
    # The script said no total: the estimate assumes an hour's run, as before.
    blind = Job.objects.get(pk=second.pk).estimated_start_at
    assert blind - attempt.created_at > timedelta(minutes=55)
    _report(attempt, [{"kind": "total_steps", "rank": 0, "total_steps": 100}], now)
    run_pass()
    # 38 steps in 40 s, 60 left: about a minute from the last step.
    estimated = Job.objects.get(pk=second.pk).estimated_start_at
    assert abs(estimated - (now + timedelta(seconds=60 / (38 / 40)))) < timedelta(seconds=2)
    assert "est. start" in Job.objects.get(pk=second.pk).reason


@pytest.mark.django_db
def test_a_time_limit_that_ends_the_run_first_is_said_and_caps_the_projection(lab):
    _, _, client = lab
    first = _start(client, time_limit_s=300)
    attempt = live_attempt(first)
    now = timezone.now()
    start = {"kind": "start", "rank": 0, "world_size": 8, "resumed_from_step": 0}
    _report(attempt, [{**start, "total_steps": 10_000}, *step_records(0, [1])], now)
    _report(attempt, step_records(0, range(2, 21)), now + timedelta(seconds=20))
    progress = client.get(f"/api/v1/jobs/{first.id}/").json()["progress"]
    assert progress["time_limit_end"] is not None
    assert _parse(progress["time_limit_end"]) < _parse(progress["projected_end"])
    assert "its time limit stops it first, at" in _progress_text(progress)
    (view,) = take_snapshot(now + timedelta(seconds=20)).running
    assert view.projected_end == view.expected_end  # the limit's end, not 2.7 h away
    page = client_page(lab, first)
    assert 'id="time-limit-first"' in page and "step 20 of 10000" in page


@pytest.mark.django_db
def test_bad_totals_are_refused_and_only_rank_0_says_the_runs_length(lab, caplog):
    _, _, client = lab
    first = _start(client)
    attempt = live_attempt(first)
    now = timezone.now()
    for bad in (0, -5, "600", 2.5, True, None):
        _report(attempt, [{"kind": "total_steps", "rank": 0, "total_steps": bad}], now)
    nodes = Node.objects.filter(allocations__attempt=attempt).distinct()
    for node_ in nodes:  # every rank claims a total: only rank 0's counts
        ranks = list(attempt.allocations.filter(node=node_).values_list("rank", flat=True))
        records = [{"kind": "total_steps", "rank": r, "total_steps": 77 + r} for r in ranks]
        beat(node_, attempt, dict.fromkeys(ranks), records=records, now=now)
    assert Attempt.objects.get(pk=attempt.pk).total_steps == 77
    assert "is not a positive step count" in caplog.text
    # Without a measured pace the page and the API say so, and give no end.
    progress = client.get(f"/api/v1/jobs/{first.id}/").json()["progress"]
    assert progress["projected_end"] is None and progress["steps_per_s"] is None
    assert _progress_text(progress) == "step 0 of 77 (0 %), pace not measured yet"


def client_page(lab, job_):
    from django.test import Client

    _, user, _ = lab
    browser = Client()
    browser.force_login(user)
    return browser.get(f"/jobs/{job_.id}/").content.decode()


def _parse(text):
    from datetime import datetime

    return datetime.fromisoformat(text.replace("Z", "+00:00"))


@pytest.mark.django_db
def test_the_job_pages_progress_row_is_drawn_again_as_the_run_goes(lab, make_team, make_user):
    """views.job_progress: the row job_progress.js swaps in every few seconds, from the same
    template as the page's; empty before the script said its total; not another team's."""
    from django.test import Client

    _, user, client = lab
    first = _start(client)
    attempt = live_attempt(first)
    browser = Client()
    browser.force_login(user)
    url = f"/jobs/{first.id}/progress/"
    assert browser.get(url).content.decode().strip() == ""  # no total said yet
    page = browser.get(f"/jobs/{first.id}/").content.decode()
    assert '<tr id="progress-row" hidden>' in page and "job_progress.js" in page
    now = timezone.now()
    start = {"kind": "start", "rank": 0, "world_size": 8, "resumed_from_step": 0}
    _report(attempt, [{**start, "total_steps": 1000}, *step_records(0, [1])], now)
    _report(attempt, step_records(0, range(2, 101)), now + timedelta(seconds=20))
    row = browser.get(url).content.decode()
    assert "step 100 of 1000 (10%)" in row and 'id="projected-end"' in row
    _report(attempt, step_records(0, range(101, 201)), now + timedelta(seconds=40))
    assert "step 200 of 1000 (20%)" in browser.get(url).content.decode()
    # Another team's member: the same 404 as for the page.
    stranger = Client()
    stranger.force_login(make_user("eve", team=make_team("other", quota=8)))
    assert stranger.get(url).status_code == 404
    assert Client().get(url).status_code == 302  # not logged in: to the login page
