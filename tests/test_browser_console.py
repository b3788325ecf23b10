"""The admin console as an admin uses it, in headless Chromium against a live cluster: change a
queued job's priority, cordon then uncordon a node with a reason, filter the event log, see the
report's charts and download its CSV. Screenshots go to docs/screenshots/console-*.png."""

import csv
import io
import os
import shutil
from pathlib import Path

import pytest

from tests.live import Api, LiveCluster, wait_for

pytestmark = pytest.mark.browser

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
SCREENSHOTS = Path(os.environ.get("LOCKSTEP_CONSOLE_SCREENSHOT_DIR", "docs/screenshots"))

if not Path(CHROMIUM).exists():
    pytest.skip(
        "Debian's chromium is not installed (apt-get install chromium); .ci/run installs it",
        allow_module_level=True,
    )

os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")

SLEEP = ["python", "-c", "import time; time.sleep(600)"]

# Three past weeks of team vision on the cluster's node (run with `manage.py shell -c`, in one
# transaction so the scheduler never sees these jobs queued): week -3 a 20 h run, week -2 a
# 30 h run that failed 1.5 h after its last checkpoint, week -1 a 10 h run preempted 0.5 h
# after its checkpoint and a 25 h run; all on 2 GPUs. The node registered 5 weeks ago.
HISTORY = """
from datetime import timedelta
from django.contrib.auth import get_user_model
from django.db import transaction
from django.utils import timezone
from jobs import actions
from jobs.models import GPU, Allocation, Attempt, Checkpoint, Job, Node
from jobs.reports.usage import week_starts
from teams.actions import do_create_team

now = timezone.now()
weeks = week_starts(now, 4)
H = timedelta(hours=1)
with transaction.atomic():
    Node.objects.update(registered_at=weeks[0] - timedelta(weeks=1))
    team = do_create_team("vision", quota=2)
    owner = get_user_model().objects.get(username="admin")
    gpus = list(GPU.objects.order_by("index")[:2])
    runs = [(0, 20, "succeeded", None), (1, 30, "failed", 1.5), (2, 10, "preempted", 0.5),
            (2, 25, "succeeded", None)]
    for n, (week, hours, state, lost) in enumerate(runs):
        start = weeks[week] + timedelta(days=1, hours=n)
        end = start + hours * H
        job = actions.do_submit_job(owner=owner, team=team, now=start, name=f"history-{n}",
            image="lockstep/trainer:latest", command=["python", "-m", "trainer"], gpus=2)
        Job.objects.filter(pk=job.pk).update(state="SUCCEEDED" if state == "succeeded"
            else "FAILED", first_started_at=start, finished_at=end)
        attempt = Attempt.objects.create(job=job, number=1, state=state, master_addr="x",
            master_port=29500, created_at=start, running_at=start, ended_at=end)
        for rank, gpu in enumerate(gpus):
            Allocation.objects.create(attempt=attempt, gpu=gpu, node=gpu.node, rank=rank,
                local_rank=rank, group_rank=0, claimed_at=start, released_at=end)
        if lost:
            Checkpoint.objects.create(job=job, attempt=attempt, step=100, path=f"/h/{n}",
                created_at=end - lost * H)
"""


AGE_RUNNING = """
from datetime import timedelta
from django.db.models import F
from jobs.models import Attempt
earlier = F("created_at") - timedelta(hours=2)
Attempt.objects.filter(ended_at__isnull=True).update(created_at=earlier)
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One agent with 2 GPUs, the demo team (quota 4), and two 2-GPU jobs of alice's: the
    first runs, the second waits for it."""
    import json

    live = LiveCluster(tmp_path_factory.mktemp("console"), agents=1, gpus_per_agent=2)
    try:
        live.start()
        live.demo = json.loads(live.manage("seed_demo").strip().splitlines()[-1])
        live.manage("shell", "-c", HISTORY)
        api = Api(live.url, live.demo["alice_token"])
        live.jobs = []
        for name in ("console-running", "console-waiting"):
            response = api.post(
                "/api/v1/jobs/",
                {
                    "name": name,
                    "team": "demo",
                    "image": "lockstep/trainer:latest",
                    "command": SLEEP,
                    "gpus": 2,
                },
            )
            assert response.status_code == 201, response.text
            live.jobs.append(response.json()["id"])
        wait_for(
            lambda: api.get(f"/api/v1/jobs/{live.jobs[0]}/").json()["state"] == "RUNNING",
            90,
            "the first job to run",
        )
        # Past its minimum run (jobs.scheduling.protection), so that a priority claim may take
        # it: the preemption test below needs one.
        live.manage("shell", "-c", AGE_RUNNING)
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
        context = browser.new_context(
            viewport={"width": 1280, "height": 900}, accept_downloads=True
        )
        page = context.new_page()
        page.set_default_timeout(20_000)
        page.goto(cluster.url + "/login/")
        page.fill("#id_username", "admin")
        page.fill("#id_password", cluster.demo["admin_password"])
        page.click("main button[type=submit]")
        page.wait_for_url(cluster.url + "/")
        yield page
        browser.close()


def _shot(page, name: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / f"console-{name}.png"), full_page=True)


def test_an_admin_raises_a_waiting_jobs_priority_in_the_queue(cluster, page):
    running, waiting = cluster.jobs
    page.click("header >> text=Queue")
    page.wait_for_url("**/console/queue/")
    row = page.locator(f"#queue tr[data-job='{waiting}']")
    assert "QUEUED" in row.inner_text()
    assert "RUNNING" in page.locator(f"#queue tr[data-job='{running}']").inner_text()
    assert row.locator("select[name=priority]").input_value() == "normal"
    # Setting the priority it already has is refused next to the field.
    row.locator("button").click()
    row = page.locator(f"#queue tr[data-job='{waiting}']")
    assert "already has priority normal" in row.locator(".field-errors").inner_text()
    row.locator("select[name=priority]").select_option("high")
    row.locator("button").click()
    assert f"Job {waiting}: priority normal -> high." in page.locator(".messages").inner_text()
    row = page.locator(f"#queue tr[data-job='{waiting}']")
    assert row.locator("select[name=priority]").input_value() == "high"
    _shot(page, "queue")


def test_an_admin_cordons_then_uncordons_a_node_with_a_reason(cluster, page):
    page.click("header >> text=Nodes")
    page.wait_for_url("**/console/nodes/")
    row = page.locator("#nodes tr[data-node='e2e-a']")
    assert "up" in row.locator(".state").inner_text()
    assert "2 / 2" in row.inner_text()  # the running job holds both GPUs
    # Without a reason nothing happens and the form says why.
    row.locator("button[value=cordon]").click()
    row = page.locator("#nodes tr[data-node='e2e-a']")
    assert "Say why" in row.locator(".field-errors").inner_text()
    assert row.locator(".state").inner_text() == "up"
    row.locator("input[name=reason]").fill("fan failure on GPU 1")
    row.locator("button[value=cordon]").click()
    row = page.locator("#nodes tr[data-node='e2e-a']")
    assert row.locator(".state").inner_text() == "cordoned"
    assert "fan failure on GPU 1" in row.locator(".node-reason").inner_text()
    _shot(page, "nodes-cordoned")
    # Cordoned: the running job carries on.
    api = Api(cluster.url, cluster.demo["alice_token"])
    assert api.get(f"/api/v1/jobs/{cluster.jobs[0]}/").json()["state"] == "RUNNING"
    row.locator("input[name=reason]").fill("fan replaced")
    row.locator("button[value=uncordon]").click()
    row = page.locator("#nodes tr[data-node='e2e-a']")
    assert row.locator(".state").inner_text() == "up"
    assert "e2e-a: up (fan replaced)" in page.locator(".messages").inner_text()
    _shot(page, "nodes")


def test_an_admin_filters_the_event_log(cluster, page):
    page.click("header >> text=Events")
    page.wait_for_url("**/console/events/")
    page.select_option("#id_kind", "node.cordoned")
    page.click("#event-filter button[type=submit]")
    page.wait_for_url("**kind=node.cordoned**")
    rows = page.locator("#events tr[data-kind]")
    assert rows.count() == 1
    assert "node e2e-a cordoned by admin: fan failure on GPU 1" in rows.first.inner_text()
    # A node that does not exist is an error next to its field.
    page.fill("#id_node", "no-such-node")
    page.click("#event-filter button[type=submit]")
    assert "No such node." in page.locator("#event-filter .field-errors").inner_text()
    page.fill("#id_node", "e2e-a")
    page.select_option("#id_kind", "")
    page.click("#event-filter button[type=submit]")
    kinds = set(
        page.locator("#events tr[data-kind]").evaluate_all("rs => rs.map(r => r.dataset.kind)")
    )
    assert {"node.cordoned", "node.uncordoned"} <= kinds
    page.click("text=clear")
    page.select_option("#id_kind", "job.priority_changed")
    page.click("#event-filter button[type=submit]")
    assert "priority normal -> high" in page.locator("#events").inner_text()
    _shot(page, "events")


def test_an_admin_sees_the_report_charts_and_downloads_the_csv(cluster, page):
    page.click("header >> text=Reports")
    page.wait_for_url("**/console/reports/")
    for name in ("usage", "lost"):
        page.wait_for_function(
            f"() => {{ const d = document.getElementById('fig-{name}').data;"
            " return d && d.length > 0; }"
        )
    traces = page.evaluate("() => document.getElementById('fig-usage').data.map(t => t.name)")
    assert traces == ["demo", "vision", "idle"]
    assert page.locator("#fig-usage .main-svg .bars path").count() > 0  # drawn, not only data
    # Team vision's history: 2 GPUs x (20 + 30 + 10 + 25) h used; 2 x 1.5 h lost to the
    # failure, 2 x 0.5 h to the preemption; goodput (170 - 4) / 170.
    vision = page.locator("#report-totals tr[data-team=vision] td").all_inner_texts()
    assert vision == ["vision", "170.0", "3.0", "1.0", "97.6%"]
    shown = page.locator("#report-totals tr[data-team=demo] td").nth(1).inner_text()
    with page.expect_download() as info:
        page.click("#csv-link")
    download = info.value
    assert download.suggested_filename == "lockstep-usage.csv"
    rows = list(csv.DictReader(io.StringIO(Path(download.path()).read_text())))
    demo = [r for r in rows if r["team"] == "demo"]
    assert len(demo) == 4  # the default window: four weeks
    # The running job has held 2 GPUs this week only; the page showed the same figure.
    assert [float(r["gpu_hours_used"]) for r in demo[:3]] == [0.0, 0.0, 0.0]
    weekly = [float(r["gpu_hours_used"]) for r in rows if r["team"] == "vision"]
    assert weekly == [40.0, 60.0, 70.0, 0.0]
    assert float(demo[-1]["gpu_hours_used"]) == pytest.approx(float(shown), abs=0.011)
    (cluster_row,) = [r for r in rows if r["team"] == "*" and r["week"] == demo[-1]["week"]]
    assert float(cluster_row["cluster_gpu_hours"]) > 0
    page.wait_for_timeout(500)
    _shot(page, "reports")


def test_the_console_works_at_phone_width(cluster, page):
    page.set_viewport_size({"width": 390, "height": 844})
    try:
        page.goto(cluster.url + "/console/queue/")
        card = page.locator(f"#queue tr[data-job='{cluster.jobs[1]}']")
        box = card.bounding_box()
        assert box["width"] <= 390
        assert page.evaluate("() => document.documentElement.scrollWidth") <= 390
        _shot(page, "queue-phone")
        page.goto(cluster.url + "/console/nodes/")
        assert page.evaluate("() => document.documentElement.scrollWidth") <= 390
        _shot(page, "nodes-phone")
    finally:
        page.set_viewport_size({"width": 1280, "height": 900})


def test_an_admin_approves_a_proposed_preemption(cluster, page):
    """The waiting job was raised to high priority above: the scheduler proposed to preempt the
    running normal-priority job for it, which waits for an admin (or its deadline)."""
    running, waiting = cluster.jobs
    admin = Api(cluster.url, cluster.token("admin"))
    proposal = wait_for(
        lambda: [
            r
            for r in admin.get("/api/v1/preemptions/?state=proposed").json()["results"]
            if r["claimant"] == waiting
        ],
        60,
        "the scheduler to propose a preemption for the high-priority job",
    )[0]
    assert (proposal["victim"], proposal["kind"]) == (running, "priority")
    page.click("header >> text=Preemptions")
    page.wait_for_url("**/console/preemptions/")
    row = page.locator(f"#preemptions tr[data-request='{proposal['id']}']")
    text = row.inner_text()
    assert f"job {waiting}" in text and "(demo, high)" in text
    assert f"job {running}" in text and "(demo, normal)" in text
    assert "since its last checkpoint" in text and "proposed" in text
    _shot(page, "preemptions")
    row.locator("button[value=approve]").click()
    assert f"Preemption {proposal['id']}:" in page.locator(".messages").inner_text()
    # The victim is told to checkpoint and stop; the claimant runs on its GPUs.
    wait_for(
        lambda: admin.get(f"/api/v1/jobs/{waiting}/").json()["state"] == "RUNNING",
        120,
        "the claimant to run",
    )
    decided = admin.get(f"/api/v1/preemptions/{proposal['id']}/").json()
    assert decided["state"] != "proposed" and decided["decided_by"] == "admin"
    page.reload()
    assert "admin" in page.locator(f"#preemptions tr[data-request='{proposal['id']}']").inner_text()
