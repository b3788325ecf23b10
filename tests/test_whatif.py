"""Admins' what-if: recorded jobs become a simulator trace, a changed quota is replayed against
the current one, bad input changes nothing, and only cluster admins may run it."""

from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone
from rest_framework.test import APIClient

from jobs import whatif
from jobs.models import Event, Node, WhatIfRun
from jobs.scheduling.trace import TraceJob
from teams.models import Team

HOUR = 3600.0


@pytest.fixture
def window():
    """A window that ended a minute ago and began two days before (whole seconds)."""
    until = timezone.now().replace(microsecond=0) - timedelta(minutes=1)
    return until - timedelta(days=2), until


@pytest.fixture
def vision(make_team, make_user, make_nodes, make_recorded_job, window):
    """4 GPUs (2 nodes x 2); team vision (quota 2, no borrowing) ran four 2-GPU jobs of an hour
    each, submitted a second apart, so its quota let them run one at a time; team nlp (quota
    2) ran one 1-GPU job later on."""
    since, _ = window
    make_nodes(2, 2)
    vision = make_team("vision", quota=2)
    nlp = make_team("nlp", quota=2)
    ann, bob = make_user("ann", team=vision), make_user("bob", team=nlp)
    start = since + timedelta(hours=1)
    for k in range(4):
        began = start + timedelta(seconds=k * HOUR)
        make_recorded_job(
            vision,
            ann,
            submitted=start + timedelta(seconds=k),
            gpus=2,
            runs=[(began, began + timedelta(seconds=HOUR))],
        )
    later = start + timedelta(hours=8)
    make_recorded_job(nlp, bob, submitted=later, runs=[(later, later + timedelta(minutes=30))])
    return vision, nlp


@pytest.fixture
def admin(make_user):
    client = Client()
    client.force_login(make_user("root", staff=True))
    return client


def _form(window, teams, **changes) -> dict:
    since, until = window
    data = {
        "since": since.strftime("%Y-%m-%dT%H:%M:%S"),
        "until": until.strftime("%Y-%m-%dT%H:%M:%S"),
        "gpus": 4,
        # As a browser posts the form: today's settings prefilled (AGED_BORROWED_FIRST ticked,
        # QUOTA_BEFORE_DRAIN not: an unticked box sends nothing).
        "aged_borrowed_first": "on",
    }
    for team in teams:
        data[f"team_{team.id}_quota"] = team.quota
        data[f"team_{team.id}_borrow_limit"] = team.borrow_limit
        data[f"team_{team.id}_weight"] = team.weight
    data.update(changes)
    return data


@pytest.mark.django_db
def test_recorded_jobs_become_trace_rows_with_the_run_time_their_attempts_held(
    make_team, make_user, make_recorded_job, window
):
    since, until = window
    now = until + timedelta(minutes=1)
    team = make_team("lab", quota=4)
    ann = make_user("ann", team=team)

    def at(seconds):
        return since + timedelta(seconds=seconds)

    restarted = make_recorded_job(  # two attempts: 300 s, then 600 s after a failure
        team,
        ann,
        submitted=at(60),
        gpus=2,
        priority="high",
        runs=[(at(100), at(400)), (at(500), at(1100))],
    )
    running = make_recorded_job(team, ann, submitted=at(120), runs=[(at(200), None)])
    limited = make_recorded_job(
        team, ann, submitted=at(130), time_limit_s=7 * 86400, runs=[(at(300), None)]
    )
    queued = make_recorded_job(team, ann, submitted=at(140), gpus=4, priority="low")
    queued_limited = make_recorded_job(team, ann, submitted=at(150), time_limit_s=1800)
    make_recorded_job(team, ann, submitted=at(160), state="CANCELLED")  # never ran
    make_recorded_job(team, ann, submitted=since - timedelta(seconds=1), runs=[(at(0), at(50))])
    make_recorded_job(team, ann, submitted=until, runs=[(until, now)])  # the window excludes

    recorded = whatif.recorded_trace(since, until, now=now)

    assert recorded.jobs == [
        TraceJob(str(restarted.id), 60.0, 2, 900.0, "lab", 2),
        TraceJob(str(running.id), 120.0, 1, (now - at(200)).total_seconds(), "lab", 1),
        TraceJob(str(limited.id), 130.0, 1, 7 * 86400.0, "lab", 1),
        TraceJob(str(queued.id), 140.0, 4, 900.0, "lab", 0),  # the ended jobs' median
        TraceJob(str(queued_limited.id), 150.0, 1, 1800.0, "lab", 1),
    ]
    assert recorded.summary() == {
        "jobs": 5,
        "finished": 1,
        "time_limit": 2,
        "elapsed_so_far": 1,
        "estimated": 1,
        "skipped": 1,
        "gpu_hours": round(
            (2 * 900 + (now - at(200)).total_seconds() + 7 * 86400 + 4 * 900 + 1800) / 3600, 1
        ),
    }


@pytest.mark.django_db
def test_the_current_cluster_is_the_gpus_of_nodes_that_are_not_down(make_nodes):
    nodes = make_nodes(3, 4)
    Node.objects.filter(pk=nodes[0].pk).update(state=Node.State.DOWN)
    Node.objects.filter(pk=nodes[1].pk).update(state=Node.State.CORDONED)
    assert whatif.current_cluster() == whatif.Cluster(gpus=8, gpus_per_node=4, nodes=2)


@pytest.mark.django_db
def test_raising_a_teams_quota_lowers_its_wait_in_the_replay_and_changes_nothing(
    vision, admin, window
):
    team, nlp = vision
    events = Event.objects.count()
    response = admin.post(
        "/console/whatif/", _form(window, [team, nlp], **{f"team_{team.id}_quota": 4})
    )
    run = WhatIfRun.objects.get()
    assert response.status_code == 302 and response.url == f"/console/whatif/{run.id}/"
    assert run.state == "done", run.error
    # What the replay should give, from the recorded jobs: an hour each, submitted at 0-3 s.
    # Quota 2: one 2-GPU job at a time, starting at 0, D, 2D, 3D. Quota 4: two at a time.
    d, offsets = HOUR, [0, 1, 2, 3]
    serial = sum(k * d - s for k, s in zip(range(4), offsets, strict=True)) / 4
    paired = sum(max(0, (k // 2) * d + (k % 2) - s) for k, s in zip(range(4), offsets, strict=True))
    current = run.result["metrics"]["current"]["teams"]["vision"]
    changed = run.result["metrics"]["changed"]["teams"]["vision"]
    assert current["wait_mean_s"] == pytest.approx(serial, abs=1)
    assert changed["wait_mean_s"] == pytest.approx(paired / 4, abs=1)
    assert changed["wait_mean_s"] < current["wait_mean_s"] - HOUR / 2
    (row,) = [r for r in run.result["teams"] if r["team"] == "vision"]
    assert row["wait_verdict"] == "better"
    assert row["inputs"]["changed"]["quota"] == 4 and row["inputs"]["current"]["quota"] == 2
    assert run.result["trace"]["jobs"] == 5
    assert set(run.result["figures"]) == {"team_wait", "team_reclaim", "utilization", "queue"}
    # A what-if is not a quota change: the team is as it was; one audit event was written.
    team.refresh_from_db()
    assert (team.quota, team.borrow_limit, team.weight) == (2, 0, 1.0)
    assert Event.objects.count() == events + 1
    assert Event.objects.get(kind="whatif.requested").data == {"whatif": run.id}

    page = admin.get(f"/console/whatif/{run.id}/")
    assert page.status_code == 200
    html = page.content.decode()
    assert 'id="whatif-summary"' in html and 'data-team="vision"' in html
    assert "<strong>Changed:</strong> vision: quota 2 -&gt; 4</p>" in html
    assert '<script src="/vendor/plotly.min.js">' in html


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("changes", "field", "message"),
    [
        ({"quota": -1}, "quota", "greater than or equal to 0"),
        ({"weight": "heavy"}, "weight", "Enter a number."),
        ({"gpus": 0}, "gpus", "greater than or equal to 1"),
        ({"since": "yesterday-ish"}, "since", "Enter a valid date/time."),
        ({"swap": True}, "until", "The window must end after it starts."),
        ({"since": "2020-01-01T00:00"}, "since", "at most 92 days"),
        ({"empty": True}, None, "No jobs were submitted between"),
    ],
)
def test_bad_what_if_input_is_a_400_with_the_message_on_its_field_and_changes_nothing(
    vision, admin, window, changes, field, message
):
    team, nlp = vision
    data = _form(window, [team, nlp])
    if "quota" in changes:
        data[f"team_{team.id}_quota"] = changes["quota"]
    if "weight" in changes:
        data[f"team_{nlp.id}_weight"] = changes["weight"]
    if "gpus" in changes:
        data["gpus"] = changes["gpus"]
    if "since" in changes:
        data["since"] = changes["since"]
    if "swap" in changes:
        data["since"], data["until"] = data["until"], data["since"]
    if "empty" in changes:
        data["until"] = (window[0] + timedelta(minutes=5)).strftime("%Y-%m-%dT%H:%M")
    events = Event.objects.count()

    response = admin.post("/console/whatif/", data)

    assert response.status_code == 400
    form = response.context["form"]
    names = {"quota": f"team_{team.id}_quota", "weight": f"team_{nlp.id}_weight"}
    errors = form.errors.get(names.get(field, field) if field else "__all__")
    assert errors and any(message in e for e in errors), form.errors
    assert message.replace("'", "&#x27;") in response.content.decode()
    assert WhatIfRun.objects.count() == 0 and Event.objects.count() == events
    assert list(Team.objects.order_by("name").values_list("quota", "borrow_limit", "weight")) == [
        (2, 0, 1.0),
        (2, 0, 1.0),
    ]


@pytest.mark.django_db
def test_the_form_is_prefilled_with_todays_quotas_and_cluster(vision, admin):
    team, _ = vision
    Team.objects.filter(pk=team.pk).update(borrow_limit=3, weight=2.5)
    form = admin.get("/console/whatif/").context["form"]
    assert form[f"team_{team.id}_quota"].value() == 2
    assert form[f"team_{team.id}_borrow_limit"].value() == 3
    assert form[f"team_{team.id}_weight"].value() == 2.5
    assert form["gpus"].value() == 4
    since, until = form["since"].value(), form["until"].value()  # shown in UTC, naive
    assert until - since == timedelta(days=7)
    assert until >= timezone.make_naive(timezone.now()) > until - timedelta(minutes=2)


@pytest.mark.django_db
def test_only_cluster_admins_reach_the_what_if_pages_and_api(vision, make_user, admin, window):
    team, nlp = vision
    admin.post("/console/whatif/", _form(window, [team, nlp]))
    run = WhatIfRun.objects.get()
    member = Client()
    member.force_login(make_user("lead", team=team, role="lead"))
    assert member.get("/console/whatif/").status_code == 404
    assert member.get(f"/console/whatif/{run.id}/").status_code == 404
    assert member.post("/console/whatif/", _form(window, [team, nlp])).status_code == 404
    anonymous = Client().get("/console/whatif/")
    assert anonymous.status_code == 302 and anonymous.url.startswith("/login/")
    api = APIClient()
    api.force_authenticate(make_user("eve", team=nlp))
    assert api.post("/api/v1/whatif/", {}, format="json").status_code == 403
    assert api.get(f"/api/v1/whatif/{run.id}/").status_code == 403
    assert APIClient().post("/api/v1/whatif/", {}, format="json").status_code in (401, 403)
    assert WhatIfRun.objects.count() == 1


@pytest.mark.django_db
def test_the_api_runs_a_what_if_and_reports_field_errors(vision, make_user, window):
    team, nlp = vision
    api = APIClient()
    api.force_authenticate(make_user("root", staff=True))
    since, until = window
    bad = [
        ({"teams": {"vision": {"quota": -1}}}, "teams", "vision"),
        ({"teams": {"nope": {"quota": 1}}}, "teams", "Unknown team 'nope'."),
        ({"gpus": 0}, "gpus", "greater than or equal to 1"),
        ({"since": until.isoformat(), "until": since.isoformat()}, "until", "must end after"),
        ({"until": "0001-01-01T00:00:03Z"}, "until", "Too early"),  # found by the fuzzer
    ]
    for body, field, message in bad:
        response = api.post("/api/v1/whatif/", body, format="json")
        assert response.status_code == 400, response.content
        assert field in response.json() and message in str(response.json()[field])
    assert WhatIfRun.objects.count() == 0

    response = api.post(
        "/api/v1/whatif/",
        {"since": since.isoformat(), "until": until.isoformat(), "teams": {"vision": {"quota": 4}}},
        format="json",
    )
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["state"] == "done" and body["params"]["changed"]["teams"]["vision"]["quota"] == 4
    teams = body["result"]["metrics"]
    assert (
        teams["changed"]["teams"]["vision"]["wait_mean_s"]
        < (teams["current"]["teams"]["vision"]["wait_mean_s"])
    )
    assert api.get(f"/api/v1/whatif/{body['id']}/").json()["result"] == body["result"]
    assert [r["id"] for r in api.get("/api/v1/whatif/").json()["results"]] == [body["id"]]
    team.refresh_from_db()
    assert team.quota == 2


@pytest.mark.django_db(transaction=True)
def test_a_large_window_runs_on_the_rq_worker_and_the_page_waits_for_it(
    vision, admin, window, settings
):
    import django_rq
    from rq import SimpleWorker

    settings.LOCKSTEP = {**settings.LOCKSTEP, "WHATIF_INLINE_MAX_JOBS": 2}
    team, nlp = vision
    queue = django_rq.get_queue("default")
    before = set(queue.get_job_ids())
    response = admin.post(
        "/console/whatif/", _form(window, [team, nlp], **{f"team_{team.id}_quota": 4})
    )
    run = WhatIfRun.objects.get()
    assert response.status_code == 302 and run.state == "queued"
    # Only this test's job is run (the queue's Redis may be shared with other test runs).
    (job,) = [
        j
        for j in queue.get_jobs()
        if j.id not in before and j.func_name == "jobs.tasks.run_whatif" and j.args == (run.id,)
    ]
    waiting = admin.get(f"/console/whatif/{run.id}/").content.decode()
    assert 'http-equiv="refresh"' in waiting and "Running in the background" in waiting

    queue.remove(job)
    SimpleWorker([queue], connection=queue.connection).execute_job(job, queue)

    run.refresh_from_db()
    assert run.state == "done", run.error
    assert (
        run.result["metrics"]["changed"]["teams"]["vision"]["wait_mean_s"]
        < (run.result["metrics"]["current"]["teams"]["vision"]["wait_mean_s"])
    )
    done = admin.get(f"/console/whatif/{run.id}/").content.decode()
    assert 'http-equiv="refresh"' not in done and 'id="whatif-by-team"' in done


@pytest.mark.parametrize("offset", [0.0, 604_800.123, 1e9])
def test_chart_bins_keep_the_whole_area_of_a_short_busy_stretch_late_in_a_window(offset):
    # The what-if's charts bin the replay's step series; bin edges computed in floats used to
    # stop a segment early and drop the rest of it (a fully busy run drawn as mostly idle).
    from jobs.scheduling.report import binned

    ts = [offset + t for t in (0.0, 0.5, 3.1, 3.4, 6.2)]
    _, busy = binned(ts, [1, 1, 1, 1, 0], bins=200)
    assert min(busy) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.django_db
def test_without_a_registered_gpu_there_is_nothing_to_compare_with(vision, admin, window):
    team, nlp = vision
    Node.objects.update(state=Node.State.DOWN)
    response = admin.post("/console/whatif/", _form(window, [team, nlp]))
    assert response.status_code == 400
    assert "there is no cluster to compare with" in str(response.context["form"].errors["gpus"])
    assert WhatIfRun.objects.count() == 0


@pytest.mark.django_db
def test_a_replay_that_fails_says_why_on_its_page(vision, admin, window, monkeypatch):
    team, nlp = vision

    def broken(*args, **kwargs):
        raise RuntimeError("the planner fell over")

    monkeypatch.setattr(whatif, "run_window", broken)
    response = admin.post("/console/whatif/", _form(window, [team, nlp]))
    run = WhatIfRun.objects.get()
    assert response.status_code == 302
    assert (run.state, run.error) == ("failed", "RuntimeError: the planner fell over")
    assert run.finished_at is not None
    page = admin.get(f"/console/whatif/{run.id}/").content.decode()
    assert "The replay failed: RuntimeError: the planner fell over" in page


@pytest.mark.django_db
def test_the_replay_uses_todays_protection_and_quota_settings(settings):
    settings.LOCKSTEP = {
        **settings.LOCKSTEP,
        "RESTART_COST_S": 45.0,
        "PREEMPT_EXEMPT_S": 900.0,
        "PREEMPT_MAX_PER_DAY": 3,
        "RECLAIM_GANG_EXEMPT_S": 7200.0,
        "QUOTA_BEFORE_DRAIN": True,
    }
    teams = {"vision": {"quota": 2, "borrow_limit": 0, "weight": 1.0}}
    today = whatif.sim_config(4, 2, teams)
    assert (today.restart_s, today.preempt_exempt_s, today.safety_stop) == (45.0, 900.0, 3)
    assert today.gang_reclaim_exempt_s == 7200.0 and today.checkpoint_on_stop
    assert today.quota_before_drain and today.aged_borrowed_first
    changed = whatif.sim_config(4, 2, teams, {"aged_borrowed_first": False})
    assert not changed.aged_borrowed_first and changed.quota_before_drain


@pytest.fixture
def drained(make_team, make_user, make_nodes, make_recorded_job, window):
    """4 GPUs (2 nodes x 2). Team lab (quota 2, may borrow 4) runs a 2-GPU job for an hour;
    ten seconds on it asks for all 4 GPUs at high priority (beyond its quota: borrowed), the
    head, whose reservation waits for team b's 10-hour job; then b asks for one more GPU,
    within its quota, for 11 hours: longer than the head's drain, so only QUOTA_BEFORE_DRAIN
    lets it start on the GPU that stands free."""
    since, _ = window
    make_nodes(2, 2)
    lab, b = make_team("lab", quota=2, borrow_limit=4), make_team("b", quota=2)
    ann, bob = make_user("ann", team=lab), make_user("bob", team=b)
    t0 = since + timedelta(hours=1)

    def at(seconds, hours):
        return [(t0 + timedelta(seconds=seconds), t0 + timedelta(seconds=seconds + hours * HOUR))]

    make_recorded_job(b, bob, submitted=t0, gpus=1, runs=at(0, 10))
    make_recorded_job(lab, ann, submitted=t0, gpus=2, runs=at(0, 1))
    make_recorded_job(
        lab, ann, submitted=t0 + timedelta(seconds=10), gpus=4, priority="high", runs=at(36000, 1)
    )
    make_recorded_job(b, bob, submitted=t0 + timedelta(seconds=20), gpus=1, runs=at(39600, 11))
    return lab, b


@pytest.mark.django_db
def test_a_what_if_of_quota_before_drain_starts_a_guaranteed_job_beside_the_drain(
    drained, make_user, window
):
    api = APIClient()
    api.force_authenticate(make_user("root", staff=True))
    since, until = window
    response = api.post(
        "/api/v1/whatif/",
        {"since": since.isoformat(), "until": until.isoformat(), "quota_before_drain": True},
        format="json",
    )
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["params"]["current"]["policy"] == {
        "aged_borrowed_first": True,
        "quota_before_drain": False,
    }
    assert body["params"]["changed"]["policy"]["quota_before_drain"] is True
    waits = {
        side: body["result"]["metrics"][side]["teams"]["b"]["wait_max_s"]
        for side in ("current", "changed")
    }
    assert waits["current"] > 10 * HOUR and waits["changed"] < 60, waits
    assert Event.objects.get(kind="whatif.requested").message.endswith(
        "QUOTA_BEFORE_DRAIN false -> true"
    )
    bad = api.post("/api/v1/whatif/", {"quota_before_drain": "maybe"}, format="json")
    assert bad.status_code == 400 and "quota_before_drain" in bad.json()
    assert WhatIfRun.objects.count() == 1
    # A form-encoded body that leaves a setting out keeps today's value (DRF would read False).
    window_only = {"since": since.isoformat(), "until": until.isoformat()}
    posted = api.post("/api/v1/whatif/", window_only, format="multipart")
    assert posted.status_code == 201, posted.content
    assert posted.json()["params"]["changed"]["policy"] == {
        "aged_borrowed_first": True,
        "quota_before_drain": False,
    }


@pytest.mark.django_db
def test_the_form_offers_todays_quota_settings_and_a_ticked_box_changes_the_replay(
    drained, admin, window, settings
):
    settings.LOCKSTEP = {**settings.LOCKSTEP, "AGED_BORROWED_FIRST": True}
    form = admin.get("/console/whatif/").context["form"]
    assert form["aged_borrowed_first"].value() is True
    assert form["quota_before_drain"].value() is False
    lab, b = drained
    data = _form(window, [lab, b], quota_before_drain="on")
    response = admin.post("/console/whatif/", data)
    run = WhatIfRun.objects.get()
    assert response.status_code == 302, response.content
    assert run.params["changed"]["policy"] == {
        "aged_borrowed_first": True,
        "quota_before_drain": True,
    }
    page = admin.get(f"/console/whatif/{run.id}/").content.decode()
    assert "QUOTA_BEFORE_DRAIN false -&gt; true" in page
    assert "AGED_BORROWED_FIRST" not in page.split("Changed:")[1].split("</p>")[0]
