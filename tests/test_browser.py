"""The portal as a user sees it, in headless Chromium (Playwright driving Debian's chromium):
log in, submit a job in the form, watch points appear in the live chart."""

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.live import LiveCluster

pytestmark = pytest.mark.browser

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
SCREENSHOTS = Path(os.environ.get("LOCKSTEP_SCREENSHOT_DIR", "var/screenshots"))

if not Path(CHROMIUM).exists():
    pytest.skip(
        "Debian's chromium is not installed (apt-get install chromium); .ci/run installs it",
        allow_module_level=True,
    )

os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    live = LiveCluster(tmp_path_factory.mktemp("browser"), agents=1, gpus_per_agent=2)
    try:
        live.start()
        live.demo = json.loads(live.manage("seed_demo").strip().splitlines()[-1])
        yield live
    finally:
        live.stop()


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
        yield page
        browser.close()


def _shot(page, name: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)


def test_log_in_submit_in_the_form_and_watch_the_live_chart(cluster, page):
    page.goto(cluster.url + "/")
    assert "/login/" in page.url
    page.fill("#id_username", "alice")
    page.fill("#id_password", "wrong")
    page.click("main button[type=submit]")
    assert page.locator(".errorlist").first.is_visible()
    page.fill("#id_username", "alice")
    page.fill("#id_password", cluster.demo["alice_password"])
    page.click("main button[type=submit]")
    page.wait_for_url(cluster.url + "/")
    assert page.locator("h1").inner_text() == "My teams' jobs"

    page.click("text=Submit a job")
    page.fill("#id_name", "browser-run")
    page.fill("#id_command", "python -m trainer --steps 400 --checkpoint-every 50")
    page.fill("#id_gpus", "0")
    page.click("main button[type=submit]")
    # The error is shown next to the GPUs field and nothing was submitted.
    error = page.locator("#id_gpus ~ .errorlist")
    assert "greater than or equal to 1" in error.inner_text()
    page.fill("#id_gpus", "2")
    page.click("main button[type=submit]")
    page.wait_for_url("**/jobs/*/")
    assert "browser-run" in page.locator("h1").inner_text()

    # Points arrive over the websocket and are drawn with Plotly.extendTraces.
    page.wait_for_function(
        "() => { const d = document.getElementById('loss-chart').data;"
        " return d && d.length > 0 && d[0].x.length >= 10; }",
        timeout=120_000,
    )
    page.wait_for_function("() => Number(document.getElementById('live-count').textContent) > 0")
    assert page.locator("#job-state").inner_text() == "RUNNING"
    losses = page.evaluate("() => document.getElementById('loss-chart').data[0].y")
    assert all(isinstance(v, float | int) for v in losses)
    # The chart keeps growing while we watch: it is live, not a snapshot.
    seen = len(losses)
    page.wait_for_function(
        f"() => document.getElementById('loss-chart').data[0].x.length > {seen + 5}",
        timeout=60_000,
    )
    page.wait_for_timeout(3000)
    _shot(page, "job-page")

    # The layout the trainer chose (the form's default: auto) beside what its ranks measured.
    page.reload()
    layout = page.locator("#layout")
    assert layout.is_visible()
    assert "auto: the planner's choice" in page.locator(".layout-shape").inner_text()
    weights = layout.locator("tr", has_text="weights per GPU").locator("td")
    assert weights.nth(1).inner_text().endswith("MiB")  # predicted
    assert weights.nth(2).inner_text().endswith("MiB")  # measured on the ranks
    assert "pp 1 × dp 2 × tp 1" in page.locator("#attempts").inner_text()

    page.goto(cluster.url + "/cluster/")
    assert page.locator("#nodes .gpu.busy").count() == 2
    _shot(page, "cluster")
    page.goto(cluster.url + "/")
    assert "RUNNING" in page.locator("#jobs").inner_text()
    _shot(page, "home")


def test_a_reopened_job_page_draws_the_gpu_use_kept_so_far(cluster, page):
    """GPU use is kept per run by the portal (every LOCKSTEP_GPU_SAMPLE_S, 1 s here), so a page
    opened later starts with the run's history, not an empty chart."""
    page.goto(cluster.url + "/")
    page.click("#jobs a >> nth=0")
    page.wait_for_function(
        "() => window.lockstepJob.gpu && window.lockstepJob.gpu.history !== null", timeout=30_000
    )
    kept = page.evaluate("() => window.lockstepJob.gpu.history")
    assert len(kept["series"]) == 2  # the job's 2 ranks
    assert all(len(s["t"]) >= 5 for s in kept["series"])  # seconds of running, sampled
    # Drawn from the history before the first live poll: one trace per rank, points spanning
    # at least 4 s of the run, and the CPU stand-in's utilization, a share in 0-100 %.
    drawn = page.evaluate(
        "() => document.getElementById('gpu-util-chart').data.map("
        "t => ({name: t.name, x: t.x.map(d => new Date(d).getTime()), y: t.y}))"
    )
    assert [d["name"].split(" (")[0] for d in drawn] == ["rank 0", "rank 1"]
    for trace in drawn:
        assert max(trace["x"]) - min(trace["x"]) >= 4000
        assert all(0 <= u <= 100 for u in trace["y"] if u is not None)
    assert "Whole run" in page.locator("#gpu-note").inner_text()
    # CPU slots have no memory reading: the memory chart says so rather than drawing nothing.
    page.wait_for_function(
        "() => (document.getElementById('gpu-mem-chart').layout.annotations || [])"
        ".some(a => a.text === 'No memory reading on CPU slots')",
        timeout=10_000,
    )
    _shot(page, "job-page-gpu-history")


def test_job_page_works_at_phone_width(cluster, page):
    page.set_viewport_size({"width": 390, "height": 844})
    page.goto(cluster.url + "/")
    page.click("#jobs a >> nth=0")
    page.wait_for_function(
        "() => { const d = document.getElementById('loss-chart').data;"
        " return d && d.length > 0 && d[0].x.length > 0; }",
        timeout=60_000,
    )
    width = page.evaluate(
        "() => document.getElementById('loss-chart').getBoundingClientRect().width"
    )
    assert 300 <= width <= 390
    _shot(page, "job-page-phone")
    page.set_viewport_size({"width": 1280, "height": 900})


def test_admin_sets_a_team_quota_in_the_console(cluster, page):
    page.context.clear_cookies()
    page.goto(cluster.url + "/login/")
    page.fill("#id_username", "admin")
    page.fill("#id_password", cluster.demo["admin_password"])
    page.click("main button[type=submit]")
    page.goto(cluster.url + "/console/teams/")
    row = page.locator("#quotas tr", has_text="demo")
    row.locator("input[name=quota]").fill("-3")
    row.locator("button").click()
    assert "greater than or equal to 0" in page.locator("#quotas").inner_text()
    row = page.locator("#quotas tr", has_text="demo")
    row.locator("input[name=quota]").fill("6")
    row.locator("button").click()
    assert "Team demo: quota 6." in page.locator(".messages").inner_text()
    assert (
        page.locator("#quotas tr", has_text="demo").locator("input[name=quota]").input_value()
        == "6"
    )
    # Refuse process-runtime nodes for the team (the agents here run processes), see the box
    # kept ticked, and allow them again: later tests run demo's jobs on these agents.
    row = page.locator("#quotas tr", has_text="demo")
    row.locator("input[name=isolated_only]").check()
    row.locator("button").click()
    row = page.locator("#quotas tr", has_text="demo")
    assert row.locator("input[name=isolated_only]").is_checked()
    assert "Team demo: quota 6; isolated nodes only." in page.locator(".messages").inner_text()
    _shot(page, "team-quotas")
    row.locator("input[name=isolated_only]").uncheck()
    row.locator("button").click()
    row = page.locator("#quotas tr", has_text="demo")
    assert not row.locator("input[name=isolated_only]").is_checked()


def test_admin_runs_a_what_if_with_a_changed_quota_and_sees_it_side_by_side(cluster, page):
    from tests.live import Api, wait_for

    api = Api(cluster.url, cluster.demo["alice_token"])
    for n in range(3):
        response = api.post(
            "/api/v1/jobs/",
            {
                "name": f"whatif-{n}",
                "team": "demo",
                "image": "lockstep/trainer:latest",
                "command": ["python", "-c", "import time; time.sleep(2)"],
                "gpus": 2,
            },
        )
        assert response.status_code == 201, response.text
    wait_for(
        lambda: any(
            j["state"] == "SUCCEEDED" and j["name"].startswith("whatif-")
            for j in api.get("/api/v1/jobs/").json()["results"]
        ),
        90,
        "a what-if job to finish",
    )

    page.context.clear_cookies()
    page.goto(cluster.url + "/login/")
    page.fill("#id_username", "admin")
    page.fill("#id_password", cluster.demo["admin_password"])
    page.click("main button[type=submit]")
    page.goto(cluster.url + "/console/whatif/")
    assert page.locator("#id_gpus").input_value() == "2"  # today's cluster: one 2-GPU agent
    # Today's scheduling settings, prefilled: the defaults.
    assert page.locator("#id_aged_borrowed_first").is_checked()
    assert not page.locator("#id_quota_before_drain").is_checked()
    row = page.locator("#whatif-teams tr[data-team=demo]")
    quota = row.locator("input[name$=_quota]")
    today = quota.input_value()
    # A bad value is shown next to its field and nothing runs.
    quota.fill("-1")
    page.click("#whatif-form button[type=submit]")
    assert "greater than or equal to 0" in row.inner_text()
    assert "None yet." in page.locator("#whatif-runs").inner_text()
    _shot(page, "whatif-form")

    # Twice the GPUs and a quota to use them: the demo jobs (2 GPUs each, which ran one at a
    # time on the 2-GPU cluster) would run two at a time, so they would wait less.
    row.locator("input[name$=_quota]").fill("8")
    page.fill("#id_gpus", "4")
    page.check("#id_quota_before_drain")
    page.click("#whatif-form button[type=submit]")
    page.wait_for_url("**/console/whatif/*/")
    assert page.locator("#whatif-state").inner_text() == "done"
    summary = page.locator("#whatif-summary")
    assert "GPUs\t2\t4" in summary.inner_text()
    assert "verdict-better" in summary.locator("tr", has_text="mean wait").first.get_attribute(
        "class"
    )
    assert (
        f"GPUs 2 -> 4; demo: quota {today} -> 8; QUOTA_BEFORE_DRAIN false -> true"
        in page.locator("main").inner_text()
    )
    assert page.locator("#whatif-by-team tr[data-team=demo]").count() == 1
    for name in ("team_wait", "team_reclaim", "utilization", "queue"):
        page.wait_for_function(
            f"() => {{ const d = document.getElementById('fig-{name}').data;"
            " return d && d.length === 2; }"
        )
    page.wait_for_timeout(500)
    _shot(page, "whatif")
