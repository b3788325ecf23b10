"""The researcher's day in headless Chromium against a live cluster: the home page says why a
job waits, resubmit prefills the form, the job page zooms and fetches the zoomed range again,
logs follow a chosen rank, a checkpoint becomes a model version, the cluster grid shows whose
job is on a GPU, and every page fits a phone. Screenshots go to docs/screenshots/portal-*.png."""

import json
import os
import re
import shutil
import time
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest

from tests.live import Api, LiveCluster, wait_for

pytestmark = pytest.mark.browser

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
SCREENSHOTS = Path(
    os.environ.get("LOCKSTEP_PORTAL_SCREENSHOTS", Path(__file__).parent.parent / "docs/screenshots")
)

if not Path(CHROMIUM).exists():
    pytest.skip(
        "Debian's chromium is not installed (apt-get install chromium); .ci/run installs it",
        allow_module_level=True,
    )

os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")

FIRST_REASON = "queued; waiting for the scheduler's next pass"  # before the first pass
TRAIN = ["python", "-m", "trainer", "--steps", "100000", "--checkpoint-every", "25"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    live = LiveCluster(tmp_path_factory.mktemp("research"), agents=1, gpus_per_agent=2)
    try:
        live.start()
        live.demo = json.loads(live.manage("seed_demo").strip().splitlines()[-1])
        api = Api(live.url, live.demo["alice_token"])
        live.running = _submit(api, "long-run", TRAIN + ["--log-every", "5"], gpus=2)
        # The cluster has 2 GPUs and long-run holds both: this one waits, with a reason.
        live.waiting = _submit(api, "next-in-line", TRAIN, gpus=2)
        yield live
    finally:
        live.stop()


def _submit(api, name, command, gpus):
    response = api.post(
        "/api/v1/jobs/",
        {
            "name": name,
            "team": "demo",
            "image": "lockstep/trainer:latest",
            "command": command,
            "dataset": "synthetic://addition",
            "gpus": gpus,
        },
    )
    assert response.status_code == 201, response.text
    return response.json()["id"]


@pytest.fixture(scope="module")
def page(cluster):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--no-first-run",
            ],
        )
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.set_default_timeout(20_000)
        offline = []
        # Pages need no internet: anything not from the portal itself is a failure.
        page.route(
            "**/*",
            lambda route: (
                route.continue_()
                if route.request.url.startswith(cluster.url.replace("http", "ws"))
                or route.request.url.startswith(cluster.url)
                else (offline.append(route.request.url), route.abort())
            ),
        )
        page.goto(cluster.url + "/login/")
        page.fill("#id_username", "alice")
        page.fill("#id_password", cluster.demo["alice_password"])
        page.click("main button[type=submit]")
        page.wait_for_url(cluster.url + "/")
        yield page
        assert not offline, offline
        browser.close()


def _shot(page, name: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / f"portal-{name}.png"), full_page=True)


def _wait_in_page(page, predicate, timeout_s: float, what: str):
    """wait_for, but pumping Playwright's events (a plain sleep would hold back page.on)."""
    for _ in range(int(timeout_s * 4)):
        if predicate():
            return
        page.wait_for_timeout(250)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def _wait_for_points(page, chart: str, count: int, timeout: float = 120_000) -> None:
    page.wait_for_function(
        f"() => {{ const d = document.getElementById('{chart}').data;"
        f" return d && d.length > 0 && d[0].x.length >= {count}; }}",
        timeout=timeout,
    )


def test_home_lists_the_waiting_job_with_its_reason_and_the_team_quota(cluster, page):
    api = Api(cluster.url, cluster.demo["alice_token"])
    wait_for(
        lambda: api.get(f"/api/v1/jobs/{cluster.running}/").json()["state"] == "RUNNING",
        120,
        "long-run to run",
    )
    wait_for(
        lambda: api.get(f"/api/v1/jobs/{cluster.waiting}/").json()["reason"] != FIRST_REASON,
        30,
        "the scheduler to give next-in-line its reason",
    )
    page.goto(cluster.url + "/")
    waiting = page.locator(f"#jobs tr[data-job='{cluster.waiting}']")
    reason = api.get(f"/api/v1/jobs/{cluster.waiting}/").json()["reason"]
    assert reason and reason in waiting.locator(".reason").inner_text()
    assert waiting.locator(".position").inner_text() == "#1"
    assert "QUEUED" in waiting.inner_text()
    running = page.locator(f"#jobs tr[data-job='{cluster.running}']")
    assert "RUNNING" in running.inner_text()
    usage = page.locator("#team-usage [data-team=demo]")
    assert "2 GPUs in use of 4 guaranteed" in usage.inner_text()
    assert usage.locator(".in-quota").get_attribute("style") == "width:50.0%"
    _shot(page, "home")


def test_job_page_draws_charts_zooms_and_fetches_the_zoomed_range(cluster, page):
    metrics = []
    page.on(
        "request",
        lambda r: metrics.append(parse_qs(urlparse(r.url).query)) if "/metrics/" in r.url else None,
    )
    page.goto(f"{cluster.url}/jobs/{cluster.running}/")
    page.wait_for_function("() => window.lockstepJob && window.lockstepJob.ready")
    _wait_for_points(page, "loss-chart", 40)
    _wait_for_points(page, "step-time-chart", 20)
    # Every rank has its own throughput and step-time trace, so a straggler stands out.
    assert page.evaluate("() => document.getElementById('step-time-chart').data.length") == 2
    first = [m for m in metrics if m["name"] == ["loss"]]
    assert first and first[0]["max_points"] == ["2000"] and "until_step" not in first[0]

    # Drag across the middle of the loss chart: the chart asks for just those steps again.
    page.locator("#loss-chart").scroll_into_view_if_needed()
    box = page.locator("#loss-chart .nsewdrag").first.bounding_box()
    y = box["y"] + box["height"] / 2
    page.mouse.move(box["x"] + box["width"] * 0.3, y)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] * 0.5, y, steps=5)
    page.mouse.move(box["x"] + box["width"] * 0.6, y, steps=5)
    page.mouse.up()
    _wait_in_page(
        page,
        lambda: any("until_step" in m and m["name"] == ["loss"] for m in metrics),
        10,
        "a second loss request for the zoomed range",
    )
    zoomed = next(m for m in metrics if "until_step" in m and m["name"] == ["loss"])
    lo, hi = int(zoomed["since_step"][0]), int(zoomed["until_step"][0])
    last = page.evaluate("() => window.lockstepJob.charts.loss.last['0']")
    assert 0 <= lo < hi < last, (lo, hi, last)
    page.wait_for_function(
        "() => document.getElementById('detail-note').textContent.startsWith('zoomed')"
    )
    # Inside the range: every step, fetched again; outside it, the overview stays.
    chart = page.evaluate(
        "() => { const e = document.getElementById('loss-chart');"
        " return {x: e.data[0].x, range: e.layout.xaxis.range}; }"
    )
    assert [x for x in chart["x"] if lo < x <= hi] == list(range(lo + 1, hi + 1))
    assert lo <= chart["range"][0] < chart["range"][1] <= hi + 1

    # The timeline shows the running attempt.
    timeline = page.evaluate(
        "() => document.getElementById('timeline-chart').data.map(t => t.y[0])"
    )
    assert "attempt 1" in timeline
    page.wait_for_timeout(1500)
    _shot(page, "job")

    # Double-click resets the zoom and asks for the whole series again.
    count = len(metrics)
    page.locator("#loss-chart .nsewdrag").first.dblclick()
    _wait_in_page(
        page,
        lambda: any("until_step" not in m and m["name"] == ["loss"] for m in metrics[count:]),
        10,
        "the full series again after the reset",
    )


def test_live_points_reach_the_chart_within_2_s_of_their_step(cluster, page):
    """From the trainer writing a step's record to the point arriving in the page (agent tail,
    heartbeat every 0.5 s here, 1 s by default, portal, channel layer, websocket)."""
    page.goto(f"{cluster.url}/jobs/{cluster.running}/")
    page.wait_for_function("() => window.lockstepJob && window.lockstepJob.ready")
    page.wait_for_function(
        "() => Object.keys(window.lockstepJob.arrivals).length >= 30", timeout=120_000
    )
    arrivals = page.evaluate("() => window.lockstepJob.arrivals")
    written = {}
    for path in cluster.work.glob("agents/**/rank-0.metrics.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record.get("kind") == "step":
                written[str(record["step"])] = record["time"]
    latencies = sorted(arrivals[s] - written[s] for s in arrivals if s in written)
    assert len(latencies) >= 30
    median, worst = latencies[len(latencies) // 2], latencies[-1]
    print(f"live latency over {len(latencies)} steps: median {median:.2f} s, max {worst:.2f} s")
    assert median < 2.0, latencies


def test_the_progress_row_moves_with_the_run(cluster, page):
    """The Progress row (step, pace, projected end) is drawn again while the job runs
    (job_progress.js), not left as it was when the page loaded."""
    page.goto(f"{cluster.url}/jobs/{cluster.running}/")
    step = re.compile(r"step (\d+) of 100000")
    page.wait_for_function(
        "() => { const p = document.getElementById('progress');"
        " return p && / steps\\/s /.test(p.textContent); }",
        timeout=120_000,
    )
    first = int(step.search(page.inner_text("#progress")).group(1))
    page.wait_for_function("() => window.lockstepJobProgress.redraws >= 2", timeout=30_000)
    later = int(step.search(page.inner_text("#progress")).group(1))
    assert later > first, (first, later)
    assert not page.is_hidden("#progress-row")
    assert "ends about" in page.inner_text("#progress")


def test_lost_pushes_and_a_dropped_socket_are_refilled_from_the_server(cluster, page):
    """The channel layer may lose a push (a watcher's queue full while its portal process
    stalls), and a socket that reconnects misses what was pushed meanwhile. Between the
    portal and this page the test withholds every metrics push until at least 20 of rank 0's
    loss steps are gone, then closes the socket once: the page sees the pushes' numbers skip
    (jobs/notify.py) and, later, its socket reopen, and each time fetches its charts again,
    so the hole it would otherwise keep is filled."""
    # A context of its own, logged in as alice (the fixture's cookies): the route below then
    # leaves the shared page alone.
    context = page.context.browser.new_context(viewport={"width": 1280, "height": 900})
    context.add_cookies(page.context.cookies())
    tab = context.new_page()
    seen = {"metrics": 0, "sockets": [], "held": set(), "first_after": None, "shown": -1}

    def route(ws):
        server = ws.connect_to_server()
        seen["sockets"].append(ws)
        first = len(seen["sockets"]) == 1

        def from_server(text):
            if first and seen.get("closing"):
                return  # this socket is being closed: nothing more reaches the page on it
            message = json.loads(text)
            if message.get("type") == "metrics":
                seen["metrics"] += 1
                steps = [p["step"] for p in message["points"] if p["name"] == "loss"]
                if len(seen["sockets"]) > 1 and steps and seen["first_after"] is None:
                    seen["first_after"] = min(steps)  # the first step after the reconnect
                if seen["metrics"] >= 3 and len(seen["held"]) < 20:
                    seen["held"].update(
                        p["step"]
                        for p in message["points"]
                        if p["name"] == "loss" and p["rank"] == 0
                    )
                    return  # lost on the way
                seen["shown"] = max([seen["shown"]] + steps)
            ws.send(text)

        server.on_message(from_server)

    tab.route_web_socket(re.compile(r".*/ws/jobs/\d+/$"), route)
    try:
        tab.goto(f"{cluster.url}/jobs/{cluster.running}/")
        tab.wait_for_function("() => window.lockstepJob && window.lockstepJob.ready")
        _wait_in_page(tab, lambda: len(seen["held"]) >= 20, 120, "20 loss steps withheld")
        held = sorted(seen["held"])
        tab.wait_for_function("() => window.lockstepJob.refills >= 1", timeout=30_000)
        gaps = tab.evaluate("() => window.lockstepJob.gaps")
        assert gaps and gaps[0]["missing"] >= 1, gaps

        def loss_steps_within(lo, hi):
            return tab.evaluate(
                "([lo, hi]) => { const d = document.getElementById('loss-chart').data[0];"
                " return d.x.filter((x) => x >= lo && x <= hi); }",
                [lo, hi],
            )

        # The page now holds points inside the withheld range: without the refill it had
        # none, as later pushes only add steps after the last one it has.
        _wait_in_page(
            tab, lambda: loss_steps_within(held[0], held[-1]), 20, "the withheld steps refilled"
        )

        # The socket drops; the page reconnects 2 s later and fetches again what it missed.
        refills = tab.evaluate("() => window.lockstepJob.refills")
        seen["closing"] = True
        last_before = seen["shown"]
        seen["sockets"][-1].close()
        tab.wait_for_function("() => window.lockstepJob.sockets >= 2", timeout=30_000)
        tab.wait_for_function(f"() => window.lockstepJob.refills > {refills}", timeout=30_000)
        _wait_in_page(tab, lambda: seen["first_after"] is not None, 30, "pushes again")
        missed = (last_before + 1, seen["first_after"] - 1)
        assert missed[1] >= missed[0], (last_before, seen["first_after"])
        _wait_in_page(
            tab, lambda: loss_steps_within(*missed), 20, f"steps {missed} pushed while away"
        )
        _shot(tab, "job-refilled")
    finally:
        context.close()


def test_the_charts_are_fetched_only_once_the_socket_is_subscribed(cluster, page):
    """Points pushed between a chart's fetch and the socket joining the job's group would be
    lost with no gap to show it (the socket's first number is its start), and a busy portal
    joins late. The consumer says "state" once it has joined; the test holds that message
    back for 1.5 s, and the page's first read of a chart must come after it."""
    context = page.context.browser.new_context(viewport={"width": 1280, "height": 900})
    context.add_cookies(page.context.cookies())
    tab = context.new_page()
    seen = {"state": None, "sockets": [], "forwarded_at": None, "fetched_at": []}

    def route(ws):
        server = ws.connect_to_server()
        seen["sockets"].append(ws)

        def from_server(text):
            if json.loads(text).get("type") == "state" and seen["forwarded_at"] is None:
                seen["state"] = text  # held back: forwarded by the test below
                return
            ws.send(text)

        server.on_message(from_server)

    def on_request(request):
        if "/metrics/?name=" in request.url:
            seen["fetched_at"].append(time.monotonic())

    tab.on("request", on_request)
    tab.route_web_socket(re.compile(r".*/ws/jobs/\d+/$"), route)
    try:
        tab.goto(f"{cluster.url}/jobs/{cluster.running}/")
        _wait_in_page(tab, lambda: seen["state"] is not None, 30, "the consumer's state message")
        tab.wait_for_timeout(1500)
        assert seen["fetched_at"] == [], "a chart was fetched before the socket was subscribed"
        seen["forwarded_at"] = time.monotonic()
        seen["sockets"][0].send(seen["state"])
        tab.wait_for_function("() => window.lockstepJob && window.lockstepJob.ready")
        assert seen["fetched_at"] and min(seen["fetched_at"]) >= seen["forwarded_at"]
    finally:
        context.close()


def test_logs_follow_the_chosen_rank(cluster, page):
    page.goto(f"{cluster.url}/jobs/{cluster.running}/")
    page.wait_for_function("() => window.lockstepJob && window.lockstepJob.ready")
    page.select_option("#log-rank", "1")
    page.wait_for_function("() => /step \\d+/.test(document.getElementById('logs').textContent)")
    text = page.locator("#logs").inner_text()
    assert "[rank 0]" not in text
    before = len(text)
    page.wait_for_function(
        f"() => document.getElementById('logs').textContent.length > {before}", timeout=60_000
    )
    assert page.is_checked("#log-follow")
    at_bottom = page.evaluate(
        "() => { const l = document.getElementById('logs');"
        " return l.scrollTop + l.clientHeight >= l.scrollHeight - 5; }"
    )
    assert at_bottom


def test_resubmit_prefills_the_form(cluster, page):
    page.goto(f"{cluster.url}/jobs/{cluster.running}/")
    page.click("#resubmit")
    page.wait_for_url(f"**/jobs/new/?from={cluster.running}")
    assert page.input_value("#id_name") == "long-run"
    assert page.input_value("#id_command").startswith("python -m trainer --steps 100000")
    assert page.input_value("#id_gpus") == "2"
    assert page.locator("#id_team").input_value() == "demo"
    # The memory planner's section is still there and answers.
    page.locator("#planner summary").click()
    page.click("#planner-check")
    page.wait_for_selector("#planner-result .planner-fits, #planner-result .planner-nofit")
    # A pasted spec with a bad value: the error sits next to its field, nothing is submitted.
    page.locator("#spec summary").click()
    page.fill(
        "#id_spec_text",
        '{"name": "pasted", "team": "demo", "image": "x", "command": ["python"], "gpus": 0}',
    )
    page.click("#spec-form button[type=submit]")
    assert page.input_value("#id_name") == "pasted"
    assert "greater than or equal to 1" in page.locator("#id_gpus ~ .errorlist").inner_text()
    page.fill("#id_gpus", "1")
    _shot(page, "submit")


def test_a_checkpoint_becomes_a_model_version_with_lineage_and_weights(cluster, page):
    page.goto(f"{cluster.url}/jobs/{cluster.running}/")
    newest = page.locator("#checkpoints tbody tr[data-step]").first
    newest.wait_for(timeout=120_000)
    step = newest.get_attribute("data-step")
    # Pin the row by its step: a checkpoint committing meanwhile is inserted above it, and
    # `.first` would then point the fill and the click at different rows.
    row = page.locator(f'#checkpoints tbody tr[data-step="{step}"]')
    row.locator("input[name=name]").fill("adder")
    row.locator("input[name=notes]").fill("first look")
    row.locator("button").click()
    page.wait_for_url("**/models/*")
    version = page.locator("#models article.version").first
    assert f"step {step}" in version.inner_text() and "first look" in version.inner_text()
    assert "long-run" in version.inner_text() and "synthetic://" in version.inner_text()

    def exported():
        page.reload()
        return page.locator("#models a.button", has_text="Download state dict").count() > 0

    wait_for(exported, 120, "the export to finish", interval=2)
    with page.expect_download() as download:
        page.click("#models a.button >> nth=0")
    assert download.value.suggested_filename == "adder-v1-state_dict.pt"
    _shot(page, "models")


def test_cluster_grid_hover_shows_the_job(cluster, page):
    page.goto(cluster.url + "/cluster/")
    gpus = page.locator("#nodes a.gpu.busy")
    assert gpus.count() == 2
    gpus.first.hover()
    tip = page.locator("#gpu-tip")
    tip.wait_for(state="visible")
    assert re.search(rf"job {cluster.running} long-run \(demo\), rank \d", tip.inner_text())
    _shot(page, "cluster")


def test_a_token_made_on_the_tokens_page_works_once_shown_and_stops_when_revoked(cluster, page):
    page.goto(cluster.url + "/")
    page.click("header a[title='API tokens']")
    page.wait_for_url(cluster.url + "/tokens/")
    page.fill("#id_name", "browser-made")
    page.select_option("#id_expires_in_days", "30")
    page.click("#token-form button[type=submit]")
    raw = page.locator("#new-token").inner_text().strip()
    assert raw.startswith("lst_")
    assert "will not be shown again" in page.locator("#token-created").inner_text()
    row = page.locator("#tokens tr[data-token='browser-made']")
    assert "active" in row.inner_text() and raw[:10] in row.inner_text()
    _shot(page, "tokens")
    api = Api(cluster.url, raw)
    assert api.get("/api/v1/jobs/").status_code == 200
    page.goto(cluster.url + "/tokens/")
    assert raw not in page.content()  # shown once
    page.once("dialog", lambda dialog: dialog.accept())
    row.locator("button.danger").click()
    page.wait_for_selector("#tokens tr[data-token='browser-made'] .state-revoked")
    assert "revoked" in page.locator(".messages").inner_text()
    assert api.get("/api/v1/jobs/").status_code == 401


# A finished 96-rank job of the demo team (wider than LIVE_RANKS_MAX, 64), made in one
# transaction: step times of every rank over 120 steps, rank 41 twice as slow from step 60,
# and ten minutes of GPU readings in which rank 77 idles. No allocations: its nodes are not
# the cluster's. Prints the job's id.
WIDE_JOB = """
import math
from datetime import timedelta
from django.contrib.auth import get_user_model
from django.db import transaction
from django.utils import timezone
from jobs import rollup
from jobs.models import Attempt, GpuSample, Job, MetricPoint
from teams.models import Team

now = timezone.now()
with transaction.atomic():
    owner = get_user_model().objects.get(username="alice")
    job = Job.objects.create(owner=owner, team=Team.objects.get(name="demo"), name="wide-run",
        image="lockstep/trainer:latest", command=["python", "-m", "trainer"], gpus=96,
        state="SUCCEEDED", submitted_at=now - timedelta(minutes=20),
        first_started_at=now - timedelta(minutes=15), finished_at=now)
    attempt = Attempt.objects.create(job=job, number=1, state="succeeded", master_addr="x",
        master_port=29500, created_at=now - timedelta(minutes=15),
        running_at=now - timedelta(minutes=15), ended_at=now, world_size=96, last_step=120)
    points = [MetricPoint(job=job, attempt=attempt, rank=r, step=s, name="step_time_s",
              value=(2.0 if r == 41 and s > 60 else 1.0) + 0.01 * math.sin(s + r), time=now)
              for r in range(96) for s in range(1, 121)]
    MetricPoint.objects.bulk_create(points)
    rollup.record(job.id, points, world=96)
    t0 = int(now.timestamp()) - 600
    GpuSample.objects.bulk_create(GpuSample(job=job, attempt=attempt, rank=r, t=t0 + 10 * i,
        util=5.0 if r == 77 else 90.0 + r % 5, mem_used=1 << 30, mem_total=16 << 30)
        for r in range(96) for i in range(60))
print(job.id)
"""


def test_a_wide_jobs_page_draws_the_band_of_every_rank_and_its_stragglers(cluster, page):
    job = int(cluster.manage("shell", "-c", WIDE_JOB).strip().splitlines()[-1])
    page.goto(f"{cluster.url}/jobs/{job}/")
    page.wait_for_function(
        "() => window.lockstepJob && window.lockstepJob.ready && window.lockstepJob.gpuReadyAt"
    )
    chart = page.evaluate(
        "() => document.getElementById('step-time-chart').data.map("
        "t => ({name: t.name, fill: t.fill || null, points: t.x.length, high: Math.max(...t.y)}))"
    )
    band = [t for t in chart if t["fill"] == "tonexty"]
    lines = [t["name"] for t in chart if t["name"].startswith("rank ")]
    # The band holds every rank (rank 41's doubled step time is its top), and the page draws
    # 8 of the 96 ranks: rank 0 and the slowest among the farthest from the rest.
    assert len(band) == 1 and "all 96 ranks" in band[0]["name"] and band[0]["high"] > 2.0
    assert len(lines) == 8 and "rank 0" in lines and "rank 41 (above the rest)" in lines
    requests = page.evaluate("() => window.lockstepJob.requests.map(r => r.url)")
    assert any("name=step_time_s" in u and "lines=8" in u for u in requests)
    assert not any("name=loss" in u and "lines=" in u for u in requests)  # rank 0's own chart
    gpu = page.evaluate("() => document.getElementById('gpu-util-chart').data.map(t => t.name)")
    assert "mean of all ranks" in gpu and "rank 77" in gpu and len(gpu) == 2 + 1 + 8
    assert "96 ranks" in page.locator("#gpu-note").inner_text()
    notes = page.evaluate(
        "() => (document.getElementById('gpu-mem-chart').layout.annotations || []).map(a => a.text)"
    )
    assert notes == []  # GPUs with memory readings: no "no memory reading" note
    # Its log panel asks for a rank number (a list of 96 or 4,096 is no way to find one) and
    # offers the ranks the step-time chart singles out.
    field = page.locator("#log-rank")
    assert field.evaluate("e => e.tagName + ' ' + e.type + ' ' + e.max") == "INPUT number 95"
    suggested = page.eval_on_selector_all("#log-rank-suggest option", "os => os.map(o => o.value)")
    assert suggested[0] == "0" and "41" in suggested and len(suggested) == 8
    asked: list[str] = []
    page.on("request", lambda r: asked.append(r.url) if "/logs/" in r.url else None)
    field.fill("96")
    field.dispatch_event("change")
    status = page.locator("#log-status")
    assert status.inner_text() == "no rank 96: this job's ranks are 0 to 95; showing rank 0"
    with page.expect_request(lambda r: "/logs/?rank=41&" in r.url):
        field.fill("41")
        field.dispatch_event("change")
    assert not any("rank=96" in url for url in asked)
    page.locator("#step-time-chart").scroll_into_view_if_needed()
    page.wait_for_timeout(500)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.locator("#step-time-chart").screenshot(path=str(SCREENSHOTS / "portal-wide-job.png"))
    # Zoomed to steps before rank 41 slowed down: the band is fetched again for that range.
    page.evaluate("() => Plotly.relayout('step-time-chart', {'xaxis.range': [5, 50]})")
    page.wait_for_function(
        "() => window.lockstepJob.requests.some(r => r.name === 'step_time_s' && r.range)"
    )
    page.wait_for_function(
        "() => { const d = document.getElementById('step-time-chart').data;"
        " return d[1].fill === 'tonexty' && Math.max(...d[1].y) < 1.5; }"
    )


@pytest.mark.parametrize("path", ["/", "/jobs/new/", "job", "/models/", "/cluster/", "/tokens/"])
def test_pages_fit_a_phone_without_horizontal_scrolling(cluster, page, path):
    page.set_viewport_size({"width": 390, "height": 844})
    try:
        url = f"{cluster.url}/jobs/{cluster.running}/" if path == "job" else cluster.url + path
        page.goto(url)
        if path == "job":
            page.wait_for_function("() => window.lockstepJob && window.lockstepJob.ready")
            width = page.evaluate(
                "() => document.getElementById('loss-chart').getBoundingClientRect().width"
            )
            assert 300 <= width <= 390
        overflow = page.evaluate(
            "() => document.documentElement.scrollWidth - document.documentElement.clientWidth"
        )
        assert overflow <= 0, f"{path}: {overflow}px wider than the phone"
        name = {"/": "home", "/jobs/new/": "submit", "job": "job", "/models/": "models",
                "/tokens/": "tokens"}.get(path, "cluster")  # fmt: skip
        if path in ("/", "job", "/cluster/"):
            page.wait_for_timeout(800)
            _shot(page, f"{name}-phone")
    finally:
        page.set_viewport_size({"width": 1280, "height": 900})
