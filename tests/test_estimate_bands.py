"""Start estimates with the band they have earned: a queued job's first estimate is kept as its
promise, the error of promises that came true is measured per size class, and the pages show
"HH:MM, usually within N min" (jobs.reports.estimates)."""

import json
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from jobs.models import Job
from jobs.reports import estimates
from jobs.reports.estimates import MIN_SAMPLES, band_text, estimate_bands
from jobs.scheduling.loop import run_pass
from tests.heartbeats import submit


@pytest.fixture
def lab(make_team, make_user, make_nodes):
    team = make_team("lab", quota=8)
    user = make_user("ann", team=team)
    make_nodes(1, 4)
    return team, user


@pytest.mark.django_db
def test_the_first_estimate_is_kept_as_the_promise(lab):
    team, user = lab
    running = submit(team, user, gpus=4, time_limit_s=3600)
    run_pass()
    waiting = submit(team, user, gpus=4)
    run_pass()
    waiting.refresh_from_db()
    assert waiting.estimated_start_at is not None
    assert waiting.promised_start_at == waiting.estimated_start_at
    promised = waiting.promised_start_at
    # The running job's limit grows: the estimate moves, the promise does not.
    Job.objects.filter(pk=running.pk).update(time_limit_s=7200)
    run_pass()
    waiting.refresh_from_db()
    assert waiting.estimated_start_at > promised
    assert waiting.promised_start_at == promised


def _started(team, user, gpus, error_s, now):
    job = submit(team, user, gpus=gpus)
    Job.objects.filter(pk=job.pk).update(
        state=Job.State.SUCCEEDED,
        promised_start_at=now - timedelta(hours=2),
        first_started_at=now - timedelta(hours=2) + timedelta(seconds=error_s),
    )


@pytest.mark.django_db
def test_a_band_is_the_90th_percentile_error_of_this_clusters_promises(lab, tmp_path, monkeypatch):
    team, user = lab
    now = timezone.now()
    simulated = tmp_path / "bands.json"
    simulated.write_text(json.dumps({"source": "test", "by_size": {"2-8": 1800.0}}))
    monkeypatch.setattr(estimates, "SIMULATED_BANDS", simulated)
    # Too few of its own: the simulator's band, and none where it has none either.
    _started(team, user, 4, 60, now)
    bands = estimate_bands(now)
    assert bands["2-8"] == {"band_s": 1800.0, "samples": 1, "source": "simulator"}
    assert bands["1"]["band_s"] is None and band_text(1, bands) == ""
    assert band_text(4, bands) == "usually within 30 min"
    assert band_text(128, bands).startswith("at the earliest")  # a lower bound, not a band
    # Enough of its own: errors of 1..20 minutes (early or late alike) -> p90 = 18 min.
    for minutes in range(2, MIN_SAMPLES + 1):
        _started(team, user, 4, (-1 if minutes % 2 else 1) * minutes * 60, now)
    bands = estimate_bands(now)
    assert bands["2-8"] == {"band_s": 18 * 60.0, "samples": MIN_SAMPLES, "source": "this cluster"}
    assert band_text(4, bands) == "usually within 18 min"
    # Outside the report window they no longer count.
    assert estimate_bands(now + timedelta(days=30))["2-8"]["source"] == "simulator"


@pytest.mark.django_db
def test_the_job_list_shows_the_estimate_with_its_band(lab, tmp_path, monkeypatch):
    team, user = lab
    simulated = tmp_path / "bands.json"
    simulated.write_text(json.dumps({"by_size": {"2-8": 25 * 60.0}}))
    monkeypatch.setattr(estimates, "SIMULATED_BANDS", simulated)
    submit(team, user, gpus=4, time_limit_s=3600)
    run_pass()
    waiting = submit(team, user, gpus=4)
    run_pass()
    waiting.refresh_from_db()
    client = Client()
    client.force_login(user)
    html = client.get("/").content.decode()
    (row,) = [r for r in html.split("<tr") if f'href="/jobs/{waiting.id}/"' in r]
    local = timezone.localtime(waiting.estimated_start_at)
    assert f"{local:%H:%M}" in row and "usually within 25 min" in row


@pytest.mark.django_db(transaction=True)
def test_the_api_and_lockstep_status_give_the_estimate_with_its_band(
    lab, tmp_path, monkeypatch, live_server, token_for, capsys
):
    from lockstep_cli.cli import main

    team, user = lab
    simulated = tmp_path / "bands.json"
    simulated.write_text(json.dumps({"by_size": {"2-8": 25 * 60.0}}))
    monkeypatch.setattr(estimates, "SIMULATED_BANDS", simulated)
    running = submit(team, user, gpus=4, time_limit_s=3600)
    run_pass()
    waiting = submit(team, user, gpus=4)
    run_pass()
    client = Client()
    client.force_login(user)
    detail = client.get(f"/api/v1/jobs/{waiting.id}/").json()
    assert detail["estimated_start_at"] is not None
    assert detail["estimated_start_band"] == "usually within 25 min"
    # A running job has no estimate, so no band either.
    assert client.get(f"/api/v1/jobs/{running.id}/").json()["estimated_start_band"] is None

    token = token_for(user)
    assert main(["--url", live_server.url, "--token", token, "status", str(waiting.id)]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("est. start")]
    assert len(rows) == 1, out
    expected = detail["estimated_start_at"].replace("T", " ")[:19]
    assert rows[0].split(None, 2)[2] == f"{expected}, usually within 25 min", out


@pytest.mark.django_db
def test_the_apis_bands_are_computed_once_a_minute(lab, tmp_path, monkeypatch):
    team, user = lab
    simulated = tmp_path / "bands.json"
    simulated.write_text(json.dumps({"by_size": {"2-8": 1800.0}}))
    monkeypatch.setattr(estimates, "SIMULATED_BANDS", simulated)
    now = timezone.now()
    assert estimates.recent_estimate_bands(now)["2-8"]["source"] == "simulator"
    for minutes in range(1, MIN_SAMPLES + 1):
        _started(team, user, 4, minutes * 60, now)
    # Within the minute: the same answer, without reading the jobs again.
    later = now + timedelta(seconds=estimates.MEMO_S - 1)
    assert estimates.recent_estimate_bands(later)["2-8"]["source"] == "simulator"
    after = now + timedelta(seconds=estimates.MEMO_S)
    assert estimates.recent_estimate_bands(after)["2-8"]["source"] == "this cluster"
