"""Metric storage per GPU-hour (issue 20): what one run's metric points cost on PostgreSQL in
each storage tier (jobs/metric_store.py), measured, and projected to the target's flagship run
(4,096 ranks stepping once a second with four metrics, 30 days) beside the layout before the
tiers (every point of every rank in one indexed table, forever; rollups of every rank from 16
steps), in the same run.

What is measured: a job of RANKS ranks steps STEPS times, one step a second of simulated time,
through the real ingest (`jobs.actions.ingest.ingest_records`, one node's heartbeat of 8 ranks
per transaction, as do_heartbeat runs it: raw points, the dedupe, the rollups). Then, after a
VACUUM ANALYZE, the size on disk with indexes (`pg_total_relation_size`) and the rows of
- the kept partition (rank 0), the time partitions (every other rank), the rollups;
- the same points copied into one unpartitioned table with the old indexes ("before").
The rollups' bytes per row are measured as the heartbeats left the table (upserted, then
vacuumed, as autovacuum keeps it); their rows per point for a month-long series are counted
from the levels each rank keeps, before (every rank from 16 steps) and now.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/test .venv/bin/python bench/metric_storage.py
    # --ranks 128 --steps 1800; writes bench/results/metric-storage.json and
    # docs/figures/metric-storage.png
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results" / "metric-storage.json"
FIGURE = ROOT / "docs" / "figures" / "metric-storage.png"
METRICS = ("loss", "tokens_per_s", "step_time_s", "compute_s")
NODE = 8  # ranks per heartbeat
FLAGSHIP = {"ranks": 4096, "metrics": 4, "step_s": 1.0, "days": 30}
RETENTIONS_H = (1, 6, 24)


def _size(cursor, table: str) -> int:
    cursor.execute("SELECT pg_total_relation_size(%s)", [table])
    return cursor.fetchone()[0]


def _parts(cursor, table: str) -> dict[str, int]:
    """The table's heap and each of its indexes, in bytes: where a row's bytes go."""
    cursor.execute(
        "SELECT indexrelid::regclass::text, pg_relation_size(indexrelid) FROM pg_index"
        " WHERE indrelid = %s::regclass ORDER BY 1",
        [table],
    )
    out = {"heap": 0, **dict(cursor.fetchall())}
    cursor.execute("SELECT pg_relation_size(%s)", [table])
    out["heap"] = cursor.fetchone()[0]
    return out


def _count(cursor, sql: str, params=()) -> int:
    cursor.execute(sql, params)
    return cursor.fetchone()[0]


def measure(ranks: int, steps: int) -> dict:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
    import django

    django.setup()
    from django.contrib.auth import get_user_model
    from django.db import connection, transaction
    from django.utils import timezone

    from jobs import metric_store
    from jobs.actions import ingest
    from jobs.models import Attempt
    from teams.actions import do_create_team
    from tests.heartbeats import submit

    if connection.vendor != "postgresql":
        raise SystemExit("needs PostgreSQL: set DATABASE_URL (partitions are PostgreSQL's)")
    connection.creation.create_test_db(verbosity=0, autoclobber=True, keepdb=False)
    try:
        t0 = timezone.now() - timedelta(seconds=steps + 60)
        metric_store.ensure_partitions(t0)
        team = do_create_team("bench", quota=ranks)
        user = get_user_model().objects.create(username="bench")
        job = submit(team, user, gpus=ranks)
        attempt = Attempt.objects.create(
            job=job,
            number=1,
            state="running",
            master_addr="127.0.0.1",
            master_port=29400,
            created_at=t0,
            running_at=t0,
            world_size=ranks,
        )
        began = time.perf_counter()
        for step in range(steps):
            now = t0 + timedelta(seconds=step + 1)
            for first in range(0, ranks, NODE):
                records = [
                    {
                        "kind": "step",
                        "rank": rank,
                        "step": step,
                        "time": now.timestamp(),
                        "loss": 10.0 / (step + 1) + rank * 1e-3,
                        "tokens_per_s": 20_000.0 + rank + step % 7,
                        "step_time_s": 1.0 + 0.01 * (rank % 5),
                        "compute_s": 0.8,
                    }
                    for rank in range(first, min(first + NODE, ranks))
                ]
                with transaction.atomic():
                    locked = Attempt.objects.select_for_update().get(pk=attempt.pk)
                    ingest.ingest_records(locked, records, now=now)
        ingest_s = time.perf_counter() - began
        with connection.cursor() as cursor:
            # As the heartbeats left it (autovacuum's pace), before the VACUUM below: what a
            # live cluster's table looks like between vacuums (bench/hollow.py measures the
            # same live, through hollow_probes.metric_tiers).
            rollup_live_bytes = _size(cursor, "jobs_metricrollup")
            rollup_parts_live = _parts(cursor, "jobs_metricrollup")
            cursor.execute(
                """
                CREATE TABLE bench_before AS SELECT * FROM jobs_metricpoint;
                ALTER TABLE bench_before ADD PRIMARY KEY (id);
                CREATE INDEX ON bench_before (job_id, name, step);
                CREATE INDEX ON bench_before (attempt_id);
                CREATE INDEX ON bench_before (job_id);
                """
            )
            cursor.execute("VACUUM ANALYZE")
            parts = [name for name, _, _ in metric_store.raw_partitions()]
            parts.append(metric_store.DEFAULT)
            kept_rows = _count(cursor, f"SELECT count(*) FROM {metric_store.KEPT}")
            raw_rows = _count(cursor, f"SELECT count(*) FROM {metric_store.RANKS}")
            rollup_rows = _count(cursor, "SELECT count(*) FROM jobs_metricrollup")
            rollup_bytes = _size(cursor, "jobs_metricrollup")
            rollup_parts = _parts(cursor, "jobs_metricrollup")
            out = {
                "ranks": ranks,
                "steps": steps,
                "points": ranks * steps * len(METRICS),
                "ingest_s": round(ingest_s, 1),
                "kept": {"rows": kept_rows, "bytes": _size(cursor, metric_store.KEPT)},
                "raw": {"rows": raw_rows, "bytes": sum(_size(cursor, p) for p in parts)},
                "rollup": {
                    "rows": rollup_rows,
                    "bytes": rollup_bytes,
                    "parts": rollup_parts,
                    "live_bytes": rollup_live_bytes,
                    "live_parts": rollup_parts_live,
                    "live_bytes_per_row": round(rollup_live_bytes / max(1, rollup_rows), 1),
                },
                "rollup_table_bytes_per_row": rollup_bytes / max(1, rollup_rows),
                "before": {"rows": kept_rows + raw_rows, "bytes": _size(cursor, "bench_before")},
            }
    finally:
        connection.creation.destroy_test_db(
            connection.settings_dict["NAME"], verbosity=0, keepdb=False
        )
    for tier in ("kept", "raw", "before"):
        out[tier]["bytes_per_row"] = round(out[tier]["bytes"] / max(1, out[tier]["rows"]), 1)
    out["rollup"]["rows_per_point"] = out["rollup"]["rows"] / out["points"]
    return out


def project(m: dict) -> dict:
    """The flagship's 30 days from the measured bytes per row of each tier (`kept`, `raw`:
    {"bytes_per_row"}; `rollup_table_bytes_per_row`) and the rollups' rows per point. Also
    what bench/hollow.py's live run measured (hollow_probes.metric_tiers), without `before`."""
    f = FLAGSHIP
    seconds = f["days"] * 86400
    points_per_s = f["ranks"] * f["metrics"] / f["step_s"]
    rank0_per_s = f["metrics"] / f["step_s"]
    gpu_hours = f["ranks"] * f["days"] * 24
    from jobs import rollup

    row = m["rollup_table_bytes_per_row"]
    kept = m["kept"]["bytes_per_row"] * rank0_per_s * seconds
    # Rollup rows per point over a month-long series, when every bucket of every level is
    # full (a short measured run over-counts the wide levels' first, part-filled buckets):
    # one row per `width` points at each level a rank keeps (`rollup.record`).
    fine = sum(1 / w for w in rollup.LEVELS)
    others = sum(1 / w for w in rollup.LEVELS[1:]) if rollup.coarse(f["ranks"]) else fine
    rows_per_point = (fine + (f["ranks"] - 1) * others) / f["ranks"]
    rollups = row * rows_per_point * points_per_s * seconds
    out = {"gpu_hours": gpu_hours, "rollup_rows_per_point": rows_per_point, "after": {}}
    if "before" in m:  # the layout before the tiers, measured beside them (measure())
        before_raw = m["before"]["bytes_per_row"] * points_per_s * seconds
        before_rollups = row * fine * points_per_s * seconds
        out["before"] = {
            "raw_bytes": before_raw,
            "rollup_bytes": before_rollups,
            "total_bytes": before_raw + before_rollups,
            "bytes_per_gpu_hour": (before_raw + before_rollups) / gpu_hours,
        }
    for hours in RETENTIONS_H:
        window = m["raw"]["bytes_per_row"] * (points_per_s - rank0_per_s) * hours * 3600
        total = kept + rollups + window
        out["after"][f"{hours}h"] = {
            "kept_bytes": kept,
            "rollup_bytes": rollups,
            "raw_window_bytes": window,
            "total_bytes": total,
            "bytes_per_gpu_hour": total / gpu_hours,
        }
    return out


def plot(result: dict) -> None:
    """Left: the month's total, before and with the tiers (log scale). Right: what the tiers'
    total is made of, per retention of every rank's raw points (linear)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = result["projection"]
    gb = 1e9
    after = [p["after"][f"{h}h"] for h in RETENTIONS_H]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    totals = [p["before"]["total_bytes"] / gb] + [a["total_bytes"] / gb for a in after]
    per = [p["before"]["bytes_per_gpu_hour"]] + [a["bytes_per_gpu_hour"] for a in after]
    labels = ["before:\none table,\nforever"] + [f"tiers,\nraw {h} h" for h in RETENTIONS_H]
    left.bar(range(4), totals, color=["#dc2626", "#2563eb", "#2563eb", "#2563eb"])
    for i, (total, rate) in enumerate(zip(totals, per, strict=True)):
        left.text(
            i,
            total * 1.1,
            f"{total:,.0f} GB\n{rate / 1e3:,.1f} KB/GPU-h",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    left.set_yscale("log")
    left.set_ylim(10, max(totals) * 8)
    left.set_ylabel("GB on PostgreSQL (log scale)")
    left.set_xticks(range(4), labels, fontsize=8)
    left.set_title("the month's total", fontsize=9)
    x = range(len(RETENTIONS_H))
    kept = [a["kept_bytes"] / gb for a in after]
    rollups = [a["rollup_bytes"] / gb for a in after]
    raw = [a["raw_window_bytes"] / gb for a in after]
    right.bar(x, kept, label="rank 0, every step (the job's life)", color="#16a34a")
    right.bar(
        x, rollups, bottom=kept, label="every rank's rollups (the job's life)", color="#2563eb"
    )
    right.bar(
        x,
        raw,
        bottom=[a + b for a, b in zip(kept, rollups, strict=True)],
        label="every rank, raw (the retention)",
        color="#94a3b8",
    )
    right.set_xticks(list(x), [f"raw kept {h} h" for h in RETENTIONS_H], fontsize=8)
    right.set_ylabel("GB")
    right.set_title("what the tiers hold", fontsize=9)
    right.legend(fontsize=8, loc="upper left")
    fig.suptitle(
        "Metric storage of one run: 4,096 ranks x 4 metrics x 1 step/s for 30 days "
        f"(bytes per row measured on {result['measured']['ranks']} ranks)",
        fontsize=10,
    )
    fig.tight_layout()
    FIGURE.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(FIGURE, dpi=120)


def replot() -> None:
    plot(json.loads(RESULTS.read_text()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=128)
    parser.add_argument("--steps", type=int, default=1800)
    parser.add_argument("--plot", action="store_true", help="redraw the figure from the results")
    parser.add_argument("--out", default=str(RESULTS), help="results (figure: default only)")
    args = parser.parse_args()
    if args.plot:
        replot()
        return 0
    os.environ.setdefault("LOCKSTEP_TEST_DB_NAME", f"metric_storage_{os.getpid()}")
    measured = measure(args.ranks, args.steps)
    result = {"measured": measured, "flagship": FLAGSHIP, "projection": project(measured)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    if out.resolve() == RESULTS.resolve():
        plot(result)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
