"""Migration 0025 under concurrent heartbeats: W writer processes, each a node of 8 ranks of
JOBS 64-rank jobs, each heartbeat one transaction through the real ingest (as do_heartbeat:
the attempt locked, raw points, rollups); wall time per heartbeat (p50, p99) and the rollups'
bytes per row. Arms, alternating on one database, the rollups truncated between: `hot`
(fillfactor 70, no job index: 0025) and `plain` (fillfactor 100 and the job index: before).
A full-size run (bench/hollow.py) is too noisy on this machine to see a few per cent.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/test \
        .venv/bin/python bench/rollup_contention.py 8 40 4   # writers, beats, jobs
    # writes bench/results/rollup-contention.json
"""

import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
os.environ["LOCKSTEP_TEST_DB_NAME"] = "contend_bench"
W, BEATS, JOBS = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])


def writer(attempt_ids, node, start_step, q):
    import django

    django.setup()
    from django.conf import settings
    from django.db import connection, transaction

    settings.DATABASES["default"]["NAME"] = "contend_bench"
    connection.settings_dict["NAME"] = "contend_bench"
    from django.utils import timezone

    from jobs.actions import ingest
    from jobs.models import Attempt

    walls = []
    for beat in range(BEATS):
        step = start_step + beat
        for aid in attempt_ids:
            recs = [
                {
                    "kind": "step",
                    "rank": r,
                    "step": step,
                    "time": time.time(),
                    "loss": 1.0 / (step + 1) + r,
                    "tokens_per_s": 1.0 * r,
                    "step_time_s": 1.0,
                    "compute_s": 0.8,
                }
                for r in range(node * 8, node * 8 + 8)
            ]
            t = time.perf_counter()
            with transaction.atomic():
                a = Attempt.objects.select_for_update().get(pk=aid)
                ingest.ingest_records(a, recs, now=timezone.now())
            walls.append(time.perf_counter() - t)
    q.put(walls)


def main():
    import django

    django.setup()
    from django.contrib.auth import get_user_model
    from django.db import connection
    from django.utils import timezone

    from jobs.models import Attempt
    from teams.actions import do_create_team
    from tests.heartbeats import submit

    db = connection.creation.create_test_db(verbosity=0, autoclobber=True, keepdb=False)
    try:
        from jobs import metric_store

        metric_store.ensure_partitions(timezone.now())
        team = do_create_team("b", quota=64 * JOBS)
        user = get_user_model().objects.create(username="b")
        aids = []
        for _ in range(JOBS):
            job = submit(team, user, gpus=64)
            aids.append(
                Attempt.objects.create(
                    job=job,
                    number=1,
                    state="running",
                    master_addr="x",
                    master_port=1,
                    created_at=timezone.now(),
                    running_at=timezone.now(),
                    world_size=64,
                ).id
            )
        connection.close()
        res = {}
        step = 0
        for rnd in range(4):
            for arm in ("hot", "plain") if rnd % 2 else ("plain", "hot"):
                with connection.cursor() as c:
                    c.execute("TRUNCATE jobs_metricrollup")
                    c.execute("DROP INDEX IF EXISTS bench_rollup_job")
                    if arm == "hot":
                        c.execute("ALTER TABLE jobs_metricrollup SET (fillfactor = 70)")
                    else:
                        c.execute("ALTER TABLE jobs_metricrollup SET (fillfactor = 100)")
                        c.execute("CREATE INDEX bench_rollup_job ON jobs_metricrollup (job_id)")
                connection.close()
                q = mp.Queue()
                ps = [mp.Process(target=writer, args=(aids, n % 8, step, q)) for n in range(W)]
                t = time.perf_counter()
                [p.start() for p in ps]
                walls = sum((q.get() for _ in ps), [])
                [p.join() for p in ps]
                el = time.perf_counter() - t
                step += BEATS
                with connection.cursor() as c:
                    c.execute(
                        "SELECT pg_total_relation_size('jobs_metricrollup'), count(*)"
                        " FROM jobs_metricrollup"
                    )
                    size, rows = c.fetchone()
                walls.sort()
                res.setdefault(arm, []).append(
                    (
                        round(statistics.median(walls) * 1000, 1),
                        round(walls[int(len(walls) * 0.99)] * 1000, 1),
                        round(el, 1),
                        round(size / rows),
                    )
                )
                print(arm, res[arm][-1], flush=True)
        print(json.dumps(res))
        out = {
            "writers": W,
            "beats": BEATS,
            "jobs": JOBS,
            "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "columns": ["wall p50 ms", "wall p99 ms", "elapsed s", "rollup bytes per row"],
            "rounds": res,
        }
        (ROOT / "bench" / "results" / "rollup-contention.json").write_text(
            json.dumps(out, indent=1) + "\n"
        )
    finally:
        connection.close()
        connection.creation.destroy_test_db(db, verbosity=0)


if __name__ == "__main__":
    mp.set_start_method("spawn")
    main()
