"""The whole-cluster job's page: one 4,096-rank gang on 512 nodes, opened in headless Chromium,
with every rank's step metrics and GPU readings stored, drawn the two ways the page can draw a
per-rank chart: a line per rank (what a job of at most LIVE_RANKS_MAX ranks gets, and what every
job got before) and the band across ranks with a few ranks' lines (jobs/metrics_spread.py).

Builds its own SQLite database (migrations, 512 nodes of 8 GPUs, a running job of --ranks
ranks with its allocations, `tokens_per_s` and `step_time_s` for every rank and `loss` for rank
0 over --steps steps, one rank slowing down halfway, a GPU reading per rank every 10 s for 10
minutes, and the rollups), then starts daphne on it twice: with LOCKSTEP_LIVE_RANKS_MAX above
the job's width (a line per rank) and with the default (the band). Per mode it loads the page
--loads times and records when the metric charts and the GPU charts were drawn, the traces
drawn, and the bytes of the chart requests. A load that does not draw within --timeout-s is
recorded as such. Writes bench/results/wide-job-page-<ranks>.json; docs/portal.md has the table.

    python bench/wide_job_page.py                 # 4,096 ranks x 300 steps (~5 min)
    python bench/wide_job_page.py --ranks 512     # smaller
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.job_page import CHROMIUM, PASSWORD, free_port  # noqa: E402

RESULTS = REPO / "bench" / "results"  # wide-job-page-<ranks>.json and the charts' screenshots
SLOW_RANK = 1234


def setup_database(ranks: int, steps: int) -> dict:
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connection, transaction
    from django.utils import timezone

    from jobs import actions, rollup
    from jobs.models import GPU, Allocation, Attempt, GpuSample, Job
    from teams.actions import do_add_member, do_create_team

    call_command("migrate", "--noinput", "-v", "0")
    from django.contrib.auth import get_user_model

    started = time.perf_counter()
    team = do_create_team("bench", quota=ranks)
    user = get_user_model().objects.create_user(username="bench", password=PASSWORD)
    do_add_member(team, user)
    now = timezone.now()
    nodes = [
        actions.do_register_node(
            name=f"node-{i:03d}", gpus=8, address="127.0.0.1", boot_id=f"b{i}", now=now
        )[0]
        for i in range(math.ceil(ranks / 8))
    ]
    job = actions.do_submit_job(
        owner=user,
        team=team,
        now=now,
        name="whole-cluster",
        image="lockstep/trainer:latest",
        command=["python", "-m", "trainer"],
        gpus=ranks,
    )
    Job.objects.filter(pk=job.pk).update(state="RUNNING", first_started_at=now)
    attempt = Attempt.objects.create(
        job=job,
        number=1,
        state="running",
        master_addr="127.0.0.1",
        master_port=29400,
        created_at=now - timedelta(minutes=10),
        running_at=now - timedelta(minutes=10),
        world_size=ranks,
        last_step=steps,
    )
    gpus = {(g.node_id, g.index): g for g in GPU.objects.all()}
    Allocation.objects.bulk_create(
        Allocation(
            attempt=attempt,
            node=nodes[r // 8],
            gpu=gpus[(nodes[r // 8].id, r % 8)],
            rank=r,
            local_rank=r % 8,
            group_rank=r // 8,
            claimed_at=now,
            started_at=now,
        )
        for r in range(ranks)
    )
    table = "jobs_metricpoint"
    sql = (
        f"INSERT INTO {table} (job_id, attempt_id, rank, step, name, value, time) "
        "VALUES (%s, %s, %s, %s, %s, %s, %s)"
    )
    stamp = now.isoformat()
    # One transaction: in autocommit each row would be a commit (and a sync) of its own.
    with transaction.atomic(), connection.cursor() as cursor:
        batch = [
            (job.id, attempt.id, 0, s, "loss", 4.0 * math.exp(-s / steps), stamp)
            for s in range(1, steps + 1)
        ]
        for r in range(ranks):
            for s in range(1, steps + 1):
                slow = 1.6 if r == SLOW_RANK and s > steps // 2 else 1.0
                step_time = slow * (1.0 + 0.02 * math.sin(s / 7 + r))
                batch.append((job.id, attempt.id, r, s, "step_time_s", step_time, stamp))
                batch.append((job.id, attempt.id, r, s, "tokens_per_s", 8192 / step_time, stamp))
            if len(batch) >= 100_000:
                cursor.executemany(sql, batch)
                batch.clear()
        cursor.executemany(sql, batch)
    t0 = int(now.timestamp()) - 600
    GpuSample.objects.bulk_create(
        (
            GpuSample(
                job=job,
                attempt=attempt,
                rank=r,
                t=t0 + 10 * i,
                util=40.0 if r == SLOW_RANK else 95.0 + 3 * math.sin(i / 5 + r),
                mem_used=60 << 30,
                mem_total=80 << 30,
            )
            for r in range(ranks)
            for i in range(60)
        ),
        batch_size=20_000,
    )
    for name in ("loss", "step_time_s", "tokens_per_s"):
        rollup.rebuild(job.id, name)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")
    return {"job": job.id, "setup_s": round(time.perf_counter() - started, 1)}


def kill_browsers() -> None:
    """Kill this process's Chromium descendants: a renderer stuck in a page's script does not
    answer Playwright's own timeouts (seen: 4,096 Plotly traces, 10 minutes at 100 % CPU)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    todo, mine = [os.getpid()], []
    while todo:
        pid = todo.pop()
        for child in children.get(pid, []):
            mine.append(child)
            todo.append(child)
    for pid in mine:
        try:
            if b"chrom" in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def run_mode(
    env: dict, work: Path, job_id: int, loads: int, timeout_s: float, mode: str, ranks: int
):
    import requests
    from playwright.sync_api import Error as PlaywrightError
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import sync_playwright

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
        stdout=open(work / f"daphne-{mode}.log", "wb"),  # noqa: SIM115
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
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
                args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"],
            )
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.set_default_timeout(timeout_s * 1000)
            page.goto(url + "/login/")
            page.fill("#id_username", "bench")
            page.fill("#id_password", PASSWORD)
            page.click("main button[type=submit]")
            page.wait_for_url(url + "/")
            sizes: dict[str, int] = {}

            def on_response(response):
                if "/metrics/" in response.url or "/gpus/" in response.url:
                    try:
                        sizes[response.url] = len(response.body())
                    except Exception:  # noqa: BLE001 - a page navigated away mid-body
                        pass

            page.on("response", on_response)
            out = []
            for _ in range(loads):
                sizes.clear()
                t0 = time.perf_counter()
                watchdog = threading.Timer(timeout_s, kill_browsers)
                watchdog.start()
                try:
                    page.goto(f"{url}/jobs/{job_id}/", timeout=timeout_s * 1000)
                    page.wait_for_function(
                        "() => window.lockstepJob && window.lockstepJob.ready"
                        " && window.lockstepJob.gpuReadyAt",
                        timeout=timeout_s * 1000,
                    )
                except PlaywrightError:  # a timeout, or the watchdog killed the browser
                    out.append({"drawn": False, "waited_s": round(time.perf_counter() - t0, 1)})
                    return out
                finally:
                    watchdog.cancel()
                got = page.evaluate(
                    "() => ({charts: window.lockstepJob.readyAt,"
                    " gpus: window.lockstepJob.gpuReadyAt,"
                    " traces: document.getElementById('step-time-chart').data.length,"
                    " gpu_traces: document.getElementById('gpu-util-chart').data.length,"
                    " points: document.getElementById('step-time-chart').data"
                    ".reduce((n, t) => n + t.x.length, 0)})"
                )
                page.wait_for_timeout(500)  # let the last bodies be read
                got.update(drawn=True, chart_bytes=sum(sizes.values()))
                out.append(got)
            if out and out[-1].get("drawn"):
                for chart in ("step-time-chart", "gpu-util-chart"):
                    try:
                        page.locator(f"#{chart}").screenshot(
                            path=str(RESULTS / f"wide-job-page-{ranks}-{mode}-{chart}.png"),
                            timeout=timeout_s * 1000,
                        )
                    except PlaywrightTimeout:  # a page that busy is what the results say
                        print(f"  no screenshot of {chart}: the page did not answer", flush=True)
            browser.close()
        return out
    finally:
        os.killpg(daphne.pid, signal.SIGTERM)
        daphne.wait(timeout=15)


def summary(loads: list[dict]) -> dict:
    drawn = [x for x in loads if x.get("drawn")]
    if not drawn:
        return {"drawn": False, "gave_up_after_s": loads[0]["waited_s"] if loads else None}
    return {
        "drawn": True,
        "loads": len(drawn),
        "metric_charts_ms_median": round(statistics.median(x["charts"] for x in drawn)),
        "gpu_charts_ms_median": round(statistics.median(x["gpus"] for x in drawn)),
        "step_time_traces": drawn[0]["traces"],
        "step_time_points": drawn[0]["points"],
        "gpu_util_traces": drawn[0]["gpu_traces"],
        "chart_bytes": drawn[0]["chart_bytes"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--loads", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=180)
    parser.add_argument("--out", type=Path, help="bench/results/wide-job-page-<ranks>.json")
    parser.add_argument(
        "--database", type=Path, help="a SQLite file to fill and keep, or reuse if it exists"
    )
    parser.add_argument("--modes", default="band,line-per-rank")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="lockstep-wide-"))
    from portal.embedded_redis import start_embedded_redis, unix_url

    redis_sock = work / "redis.sock"
    redis = start_embedded_redis(redis_sock, log_path=work / "redis.log")
    env = dict(
        os.environ,
        DJANGO_SETTINGS_MODULE="portal.settings",
        DATABASE_URL=f"sqlite:///{(args.database or work / 'bench.sqlite3').resolve()}",
        REDIS_URL=unix_url(redis_sock),
        PYTHONUNBUFFERED="1",
    )
    os.environ.update(env)
    try:
        if args.database and args.database.exists():
            import django

            django.setup()
            from jobs.models import Job

            db = {"job": Job.objects.get(name="whole-cluster").id, "setup_s": None}
        else:
            print(f"filling: {args.ranks:,} ranks x {args.steps} steps", flush=True)
            db = setup_database(args.ranks, args.steps)
            print(f"  in {db['setup_s']} s", flush=True)
        results = {"ranks": args.ranks, "steps": args.steps, "setup_s": db["setup_s"]}
        for mode, extra in (
            ("band", {}),
            ("line-per-rank", {"LOCKSTEP_LIVE_RANKS_MAX": str(args.ranks)}),
        ):
            if mode not in args.modes.split(","):
                continue
            print(f"mode {mode}", flush=True)
            loads = run_mode(
                {**env, **extra}, work, db["job"], args.loads, args.timeout_s, mode, args.ranks
            )
            results[mode] = summary(loads)
            results[mode]["each"] = loads
            print(json.dumps(results[mode]), flush=True)
        results.update(
            when=datetime.now(UTC).isoformat(timespec="seconds"),
            machine={
                "python": platform.python_version(),
                "cpus": os.cpu_count(),
                "database": "sqlite",
            },
        )
        out = args.out or RESULTS / f"wide-job-page-{args.ranks}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2) + "\n")
        print(json.dumps(results, indent=2))
    finally:
        redis.terminate()
        redis.wait(timeout=10)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
