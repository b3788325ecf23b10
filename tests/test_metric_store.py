"""Metric storage tiers and retention (jobs/metric_store.py, issue 20): rank 0's points stay for
the job's life, every other rank's raw points go after METRIC_RAW_RETENTION_S, on PostgreSQL by
dropping whole time partitions (the .ci/run leg), on SQLite by a DELETE; the rollups stay."""

from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from jobs import metric_store, rollup
from jobs.actions import ingest
from jobs.models import Attempt, Job, MetricPoint, MetricRollup
from tests.heartbeats import submit

_POSTGRES_ONLY = pytest.mark.skipif(
    connection.vendor != "postgresql",
    reason="partitions are PostgreSQL's; the SQLite leg deletes instead (tested below)",
)


def _attempt(team, user, started, gpus=2):
    """A running attempt of a new job of `gpus` ranks, started at `started`."""
    job = submit(team, user, gpus=gpus)
    Job.objects.filter(pk=job.pk).update(first_started_at=started)
    return Attempt.objects.create(
        job=job,
        number=1,
        state="running",
        master_addr="127.0.0.1",
        master_port=29400,
        created_at=started,
        running_at=started,
        world_size=gpus,
    )


def _steps(attempt, steps, when):
    """Rank 0's and rank 1's loss at `steps`, ingested as the portal would at time `when`."""
    records = [
        {"kind": "step", "rank": rank, "step": step, "time": when.timestamp(), "loss": 1.0 + rank}
        for step in steps
        for rank in (0, 1)
    ]
    ingest.ingest_records(attempt, records, now=when)


@pytest.fixture
def lab(make_team, make_user):
    team = make_team("lab", quota=8)
    return team, make_user("ann", team=team)


@pytest.mark.django_db
def test_a_point_from_a_clock_hours_off_is_stored_under_the_portals_time(lab):
    now = timezone.now()
    attempt = _attempt(*lab, started=now - timedelta(minutes=30))
    skewed, close = now - timedelta(hours=5), now - timedelta(minutes=10)
    records = [
        {"kind": "step", "rank": 0, "step": 1, "time": skewed.timestamp(), "loss": 2.0},
        {"kind": "step", "rank": 0, "step": 2, "time": close.timestamp(), "loss": 1.9},
    ]
    ingest.ingest_records(attempt, records, now=now)
    times = dict(MetricPoint.objects.filter(attempt=attempt).values_list("step", "time"))
    assert times[1] == now  # would have gone into a partition about to be dropped
    assert abs(times[2] - close) < timedelta(milliseconds=1)


@pytest.mark.django_db
def test_without_partitions_only_other_ranks_old_points_are_deleted(lab, settings):
    settings.LOCKSTEP = {**settings.LOCKSTEP, "METRIC_RAW_RETENTION_S": 86400.0}
    now = timezone.now()
    attempt = _attempt(*lab, started=now - timedelta(days=3))
    _steps(attempt, [1, 2], now - timedelta(days=2))
    _steps(attempt, [3], now - timedelta(minutes=1))
    assert metric_store.delete_expired(now) == 2  # rank 1 at steps 1 and 2
    left = set(MetricPoint.objects.filter(attempt=attempt).values_list("rank", "step"))
    assert left == {(0, 1), (0, 2), (0, 3), (1, 3)}


@_POSTGRES_ONLY
@pytest.mark.django_db
def test_partitions_are_made_ahead_once(settings):
    settings.LOCKSTEP = {**settings.LOCKSTEP, "METRIC_RAW_PARTITION_S": 3600.0}
    later = timezone.now() + timedelta(days=20)
    made = metric_store.ensure_partitions(later)
    assert len(made) == metric_store.AHEAD + 1
    assert metric_store.ensure_partitions(later) == []
    spans = {name: (start, end) for name, start, end in metric_store.raw_partitions()}
    start, end = spans[metric_store.partition_name(later.replace(minute=0, second=0))]
    assert start <= later < end and end - start == timedelta(hours=1)


def _rows(table: str) -> int:
    with connection.cursor() as cursor:
        cursor.execute(f'SELECT count(*) FROM "{table}"')
        return cursor.fetchone()[0]


def _exists(table: str) -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT to_regclass(%s)", [table])
        return cursor.fetchone()[0] is not None


@_POSTGRES_ONLY
@pytest.mark.django_db
def test_retention_drops_an_old_partition_whole_and_leaves_the_live_one(lab, settings):
    settings.LOCKSTEP = {
        **settings.LOCKSTEP,
        "METRIC_RAW_RETENTION_S": 86400.0,
        "METRIC_RAW_PARTITION_S": 3600.0,
    }
    now = timezone.now()
    old = now - timedelta(days=3)
    metric_store.ensure_partitions(old)
    metric_store.ensure_partitions(now)
    attempt = _attempt(*lab, started=old - timedelta(minutes=5))
    _steps(attempt, range(1, 21), old)
    _steps(attempt, range(21, 31), now)
    old_table = metric_store.partition_name(old.replace(minute=0, second=0, microsecond=0))
    live_table = metric_store.partition_name(now.replace(minute=0, second=0, microsecond=0))
    assert (_rows(old_table), _rows(live_table)) == (20, 10)  # rank 1's points, by time
    rollups = list(MetricRollup.objects.filter(job=attempt.job).order_by("id").values())
    with connection.cursor() as cursor:
        # The test's one transaction still holds the inserts' deferred foreign-key checks,
        # which PostgreSQL will not leave pending on a table being dropped; in the portal the
        # points were committed hours before.
        cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")

    done = metric_store.maintain(now, force=True)

    assert old_table in done["dropped"] and live_table not in done["dropped"]
    assert not _exists(old_table)
    assert _exists(live_table) and _rows(live_table) == 10
    kept = set(MetricPoint.objects.filter(attempt=attempt).values_list("rank", "step"))
    assert kept == {(0, s) for s in range(1, 31)} | {(1, s) for s in range(21, 31)}
    # The rollups are the record of the dropped points now; a read does not "repair" them
    # from the raw rows that are left.
    rollup.ensure_current(attempt.job_id, "loss")
    assert list(MetricRollup.objects.filter(job=attempt.job).order_by("id").values()) == rollups
    header = MetricRollup.objects.get(job=attempt.job, name="loss", width=rollup.HEADER)
    assert header.count == 60


@pytest.mark.django_db
def test_a_large_jobs_other_ranks_are_rolled_up_from_256_steps(lab):
    """Per-rank rollups at 16 steps are one row per 16 points of every rank, forever: a job of
    more than FINE_RANKS ranks keeps them for rank 0 only; its other ranks read coarser."""
    team, user = lab
    now = timezone.now()
    attempt = _attempt(team, user, now, gpus=rollup.FINE_RANKS + 8)
    job = attempt.job
    records = [
        {"kind": "step", "rank": rank, "step": step, "time": now.timestamp(), "loss": step + rank}
        for step in range(600)
        for rank in (0, 70)
    ]
    ingest.ingest_records(attempt, records, now=now)
    finest = MetricRollup.objects.filter(job=job, name="loss", width=rollup.LEVELS[0])
    assert set(finest.values_list("rank", flat=True)) == {0}
    coarser = MetricRollup.objects.filter(job=job, name="loss", width=rollup.LEVELS[1])
    assert set(coarser.values_list("rank", flat=True)) == {0, 70}
    by_rank = rollup.buckets(job.id, "loss", 16)
    assert [row[0] for row in by_rank[0]] == list(range(38))  # 600 steps / 16, rounded up
    assert [row[1:] for row in by_rank[70]] == [
        [0, 255, 70.0, 325.0, 256],
        [256, 511, 326.0, 581.0, 256],
        [512, 599, 582.0, 669.0, 88],
    ]
    # A small job keeps every rank's finest level, as before.
    small_attempt = _attempt(team, user, now)
    small = small_attempt.job
    _steps(small_attempt, range(40), now)
    ranks = MetricRollup.objects.filter(job=small, name="loss", width=rollup.LEVELS[0])
    assert set(ranks.values_list("rank", flat=True)) == {0, 1}


@_POSTGRES_ONLY
@pytest.mark.django_db
def test_rollup_pages_keep_room_for_the_heartbeats_updates():
    """Every heartbeat upserts its buckets' rows (a new version of each per step): pages filled
    to 70 % keep room for those versions on their own page (HOT updates, no index entries), and
    the table has no index an upsert would have to extend but its key (migration 0025)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT reloptions FROM pg_class WHERE oid = %s::regclass",
            [MetricRollup._meta.db_table],
        )
        assert cursor.fetchone()[0] == ["fillfactor=70"]
        cursor.execute(
            "SELECT pg_get_indexdef(indexrelid) FROM pg_index WHERE indrelid = %s::regclass",
            [MetricRollup._meta.db_table],
        )
        indexes = sorted(row[0].split(" USING ")[1] for row in cursor.fetchall())
    assert indexes == ["btree (id)", "btree (job_id, name, width, rank, bucket)"]
