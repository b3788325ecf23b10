"""Job page with a 1,000,000-point series: time to a drawn chart in headless Chromium, and the
metrics API's response times (full series downsampled, a zoomed range, a raw range).

Builds its own SQLite database in a temporary folder (migrations, one team, user, job and
attempt, then 1,000,000 `loss` points of rank 0 plus 2 x 1,000,000 throughput/step-time points
on two ranks with --all-series, then their rollups, jobs/rollup.py), starts daphne and a
private redis-server on it, logs in with Playwright (Debian's /usr/bin/chromium) and loads the
job page --loads times. "Chart drawn" is window.lockstepJob.readyAt: performance.now() after
every chart's Plotly.newPlot resolved, measured from the navigation's start. Writes
bench/results/job_page.json; docs/portal.md explains the numbers.

    python bench/job_page.py                  # 1M points, 5 page loads (~1-2 min)
    python bench/job_page.py --points 100000  # smaller
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
RESULTS = REPO / "bench" / "results" / "job_page.json"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
PASSWORD = "bench-password-1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup_database(points: int, all_series: bool) -> dict:
    """Migrate and fill the database named by DATABASE_URL; returns ids and insert time."""
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connection
    from django.utils import timezone

    from jobs import actions
    from jobs.models import Attempt, Job, MetricPoint
    from teams.actions import do_add_member, do_create_team

    call_command("migrate", "--noinput", "-v", "0")
    from django.contrib.auth import get_user_model

    team = do_create_team("bench", quota=8)
    user = get_user_model().objects.create_user(username="bench", password=PASSWORD)
    do_add_member(team, user)
    now = timezone.now()
    job = actions.do_submit_job(
        owner=user,
        team=team,
        now=now,
        name="million",
        image="lockstep/trainer:latest",
        command=["python", "-m", "trainer"],
        gpus=2,
    )
    Job.objects.filter(pk=job.pk).update(state="SUCCEEDED", first_started_at=now, finished_at=now)
    attempt = Attempt.objects.create(
        job=job,
        number=1,
        state="succeeded",
        master_addr="127.0.0.1",
        master_port=29400,
        created_at=now,
        running_at=now,
        ended_at=now,
        last_step=points,
    )
    table = MetricPoint._meta.db_table
    sql = (
        f"INSERT INTO {table} (job_id, attempt_id, rank, step, name, value, time) "
        "VALUES (%s, %s, %s, %s, %s, %s, %s)"
    )
    stamp = now.isoformat() if connection.vendor == "sqlite" else now
    series = [("loss", 0, lambda s: 4.0 * math.exp(-s / (points / 5)) + 0.3 * math.sin(s / 37))]
    if all_series:
        series += [
            (name, rank, lambda s, r=rank: 1000.0 + 50 * math.sin(s / 101 + r))
            for name in ("tokens_per_s", "step_time_s")
            for rank in (0, 1)
        ]
    started = time.perf_counter()
    with connection.cursor() as cursor:
        for name, rank, fn in series:
            batch = []
            for step in range(1, points + 1):
                value = fn(step)
                if step == points // 3:
                    value = 25.0  # a spike the downsampled chart must keep
                batch.append((job.id, attempt.id, rank, step, name, value, stamp))
                if len(batch) == 50_000:
                    cursor.executemany(sql, batch)
                    batch.clear()
            if batch:
                cursor.executemany(sql, batch)
        if connection.vendor == "sqlite":
            cursor.execute("ANALYZE")
    inserted = time.perf_counter() - started
    total = MetricPoint.objects.filter(job=job).count()
    # The rows went in around ingest (raw inserts, for speed): build the rollups ingest keeps
    # (jobs/rollup.py; what migration 0006 does for older series), timed on their own.
    rollup_s = None
    try:
        from jobs import rollup
    except ImportError:  # a tree from before rollups (a baseline run)
        rollup = None
    if rollup is not None:
        started = time.perf_counter()
        for name, _rank, _fn in series:
            rollup.rebuild(job.id, name)
        rollup_s = round(time.perf_counter() - started, 1)
    return {"job": job.id, "insert_s": round(inserted, 1), "rows": total, "rollup_s": rollup_s}


def grow(job_id: int, steps: int) -> None:
    """Append `steps` more loss points after the last one, as a running job's heartbeats would
    (stored, then merged into the rollup, in batches of 20 steps)."""
    from django.db import transaction
    from django.utils import timezone

    from jobs.models import Attempt, MetricPoint

    try:
        from jobs.rollup import record
    except ImportError:  # a tree from before rollups (a baseline run)
        record = None
    last = MetricPoint.objects.filter(job_id=job_id, name="loss").order_by("-step")[0].step
    attempt = Attempt.objects.get(job_id=job_id, number=1)
    for start in range(last + 1, last + steps + 1, 20):
        batch = [
            MetricPoint(
                job_id=job_id,
                attempt=attempt,
                rank=0,
                step=s,
                name="loss",
                value=0.3,
                time=timezone.now(),
            )
            for s in range(start, min(start + 20, last + steps + 1))
        ]
        with transaction.atomic():
            MetricPoint.objects.bulk_create(batch)
            if record is not None:
                record(job_id, batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--points", type=int, default=1_000_000)
    parser.add_argument("--loads", type=int, default=5)
    parser.add_argument("--all-series", action="store_true", help="also 4 x N per-rank points")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--reuse", type=Path, help="a database this script filled before (skips the inserts)"
    )
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="lockstep-bench-"))
    from portal.embedded_redis import start_embedded_redis, unix_url

    redis_sock = work / "redis.sock"
    redis = start_embedded_redis(redis_sock, log_path=work / "redis.log")
    env = dict(
        os.environ,
        DJANGO_SETTINGS_MODULE="portal.settings",
        DATABASE_URL=f"sqlite:///{(args.reuse or work / 'bench.sqlite3').resolve()}",
        REDIS_URL=unix_url(redis_sock),
        PYTHONUNBUFFERED="1",
    )
    os.environ.update(env)
    # This process reads and writes the database between Playwright calls (sync API).
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    daphne = None
    try:
        print(f"database: {args.reuse or f'inserting {args.points:,} points'}", flush=True)
        if args.reuse:
            import django

            django.setup()
            from jobs.models import MetricPoint

            db = {
                "job": 1,
                "insert_s": None,
                "rollup_s": None,
                "rows": MetricPoint.objects.count(),
            }
        else:
            db = setup_database(args.points, args.all_series)
        print(f"  {db['rows']:,} rows in {db['insert_s']} s", flush=True)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        daphne = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "daphne",
                "-b",
                "127.0.0.1",
                "-p",
                str(port),
                "portal.asgi:application",
            ],
            cwd=REPO,
            env=env,
            stdout=open(work / "daphne.log", "wb"),  # noqa: SIM115
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        results = run_browser(url, db["job"], args.loads)
        results.update(
            points_per_series=args.points,
            rows=db["rows"],
            insert_s=db["insert_s"],
            rollup_build_s=db["rollup_s"],
            all_series=args.all_series,
            when=datetime.now(UTC).isoformat(timespec="seconds"),
            machine={
                "python": platform.python_version(),
                "cpus": os.cpu_count(),
                "platform": platform.platform(),
                "database": "sqlite",
            },
        )
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        print(json.dumps(results, indent=2))
    finally:
        if daphne is not None:
            os.killpg(daphne.pid, signal.SIGTERM)
            daphne.wait(timeout=15)
        redis.terminate()
        redis.wait(timeout=10)
        shutil.rmtree(work, ignore_errors=True)


def _median(values):
    return round(statistics.median(values), 1)


def run_browser(url: str, job_id: int, loads: int) -> dict:
    import requests
    from playwright.sync_api import sync_playwright

    deadline = time.monotonic() + 60
    while True:
        try:
            if requests.get(url + "/login/", timeout=2).status_code == 200:
                break
        except requests.RequestException:
            pass
        if time.monotonic() > deadline:
            raise SystemExit("daphne did not come up")
        time.sleep(0.3)

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
        page.set_default_timeout(60_000)
        page.goto(url + "/login/")
        page.fill("#id_username", "bench")
        page.fill("#id_password", PASSWORD)
        page.click("main button[type=submit]")
        page.wait_for_url(url + "/")
        cookies = {c["name"]: c["value"] for c in page.context.cookies()}

        api = requests.Session()
        api.cookies.update(cookies)
        base = f"{url}/api/v1/jobs/{job_id}/metrics/?name=loss&rank=0"

        from django.core.cache import cache

        def timed(query: str, reps: int = 5):
            cache.clear()  # nothing cached: the first request is a cold one
            times, body = [], None
            for _ in range(reps):
                t0 = time.perf_counter()
                response = api.get(base + query, timeout=60)
                times.append((time.perf_counter() - t0) * 1000)
                assert response.status_code == 200, response.text[:300]
                body = response.json()
            series = body["ranks"]["0"]
            return {
                "first_ms": round(times[0], 1),
                "then_median_ms": _median(times[1:]),
                "points_returned": len(series["step"]),
                "kept_spike": 25.0 in series["value"],
                "bytes": len(json.dumps(body)),
            }

        def load_page():
            page.goto(f"{url}/jobs/{job_id}/")
            page.wait_for_function("() => window.lockstepJob && window.lockstepJob.ready")
            return page.evaluate(
                "() => ({ready: window.lockstepJob.readyAt,"
                " loss: window.lockstepJob.charts.loss.drawn,"
                " requests: window.lockstepJob.requests.map(r => r.ms),"
                " points: document.getElementById('loss-chart').data[0].x.length,"
                " type: document.getElementById('loss-chart').data[0].type,"
                " started: window.lockstepJob.startedAt})"
            )

        api_results = {
            "full_series_max_points_2000": timed("&max_points=2000"),
            "zoom_10pct_max_points_2000": timed(
                "&max_points=2000&since_step=450000&until_step=550000"
            ),
            "zoom_raw_1500_steps": timed("&max_points=2000&since_step=500000&until_step=501500"),
        }

        cache.clear()
        loads_ms, loss_ms, requests_ms, script_ms = [], [], [], []
        for _ in range(loads):
            info = load_page()
            loads_ms.append(info["ready"])
            loss_ms.append(info["loss"])
            script_ms.append(info["started"])
            requests_ms.extend(info["requests"])
            trace_type = info["type"]
            drawn_points = info["points"]

        # The run goes on: 2,000 more steps, then the page again.
        growing = []
        for _ in range(3):
            grow(job_id, 2_000)
            growing.append(load_page()["ready"])

        # Responsiveness after the load: a zoom (drag on the chart) to the re-fetched detail,
        # and how long the main thread is busy with a plain relayout.
        page.evaluate("() => document.getElementById('detail-note').textContent = ''")
        page.locator("#loss-chart").scroll_into_view_if_needed()
        box = page.locator("#loss-chart .nsewdrag").first.bounding_box()
        y = box["y"] + box["height"] / 2
        t0 = time.perf_counter()
        page.mouse.move(box["x"] + box["width"] * 0.45, y)
        page.mouse.down()
        page.mouse.move(box["x"] + box["width"] * 0.55, y, steps=4)
        page.mouse.up()
        page.wait_for_function(
            "() => document.getElementById('detail-note').textContent.startsWith('zoomed')"
        )
        zoom_ms = (time.perf_counter() - t0) * 1000
        relayout_ms = page.evaluate(
            "async () => { const t = performance.now();"
            " await Plotly.relayout('loss-chart', {'yaxis.autorange': true});"
            " return performance.now() - t; }"
        )
        browser.close()

    return {
        "page": {
            "loads": loads,
            "chart_drawn_ms_median": _median(loads_ms),
            "chart_drawn_ms_max": round(max(loads_ms), 1),
            "chart_drawn_ms_all": [round(v, 1) for v in loads_ms],
            "chart_drawn_ms_first_load": round(loads_ms[0], 1),
            "chart_drawn_ms_later_loads_median": _median(loads_ms[1:]),
            "chart_drawn_ms_after_2000_more_steps": [round(v, 1) for v in growing],
            "loss_chart_drawn_ms_median": _median(loss_ms),
            "scripts_running_ms_median": _median(script_ms),
            "metrics_fetch_in_page_ms_median": _median(requests_ms),
            "points_drawn_loss": drawn_points,
            "trace_type": trace_type,
            "zoom_drag_to_detail_ms": round(zoom_ms, 1),
            "relayout_ms": round(relayout_ms, 1),
        },
        "api": api_results,
    }


if __name__ == "__main__":
    main()
