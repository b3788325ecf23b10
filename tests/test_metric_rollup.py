"""Metric rollups (jobs/rollup.py): kept at ingest, they give a whole-run overview equal to the
one a scan of the raw points gives, spikes included, without reading the raw points; points
written around ingest are noticed and repaired; concurrent ingests lose no count. The
concurrency tests overlap for real on PostgreSQL (the .ci/run leg); SQLite serializes writers."""

import random
import threading
from datetime import timedelta

import pytest
from django.db import connection, connections, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from jobs import metrics_query, rollup
from jobs.actions import ingest
from jobs.metrics_query import metric_series
from jobs.models import Attempt, MetricPoint, MetricRollup
from tests.heartbeats import beat, live_attempt, submit


def _job_and_attempt(team, user, number=1, job=None):
    job = job or submit(team, user, gpus=1)
    attempt = Attempt.objects.create(
        job=job,
        number=number,
        state="running",
        master_addr="127.0.0.1",
        master_port=29400 + number,
        created_at=timezone.now() - timedelta(minutes=5),
        running_at=timezone.now() - timedelta(minutes=5),
    )
    return job, attempt


def _random_points(job, attempt, rng, *, name="loss", ranks=(0, 1, 2), steps=30_000):
    """Per rank a noisy decaying curve with gaps, spikes and dips; rank 2 stops early."""
    now = timezone.now()
    points = []
    for rank in ranks:
        last = steps if rank != 2 else steps // 3
        for step in range(rng.randrange(0, 40), last, rng.choice((1, 1, 2, 3))):
            value = 4.0 * (0.9999**step) + rng.gauss(0, 0.05)
            if rng.random() < 0.0005:
                value = rng.choice((80.0, -20.0)) * rng.random()
            points.append(
                MetricPoint(
                    job=job,
                    attempt=attempt,
                    rank=rank,
                    step=step,
                    name=name,
                    value=value,
                    time=now,
                )
            )
    return points


def _raw_series(monkeypatch, *args, **kwargs):
    """metric_series as a scan of the raw points computes it (no rollup level is fine enough)."""
    with monkeypatch.context() as m:
        m.setattr(rollup, "LEVELS", (1 << 40,))
        return metric_series(*args, **kwargs)


def _rollup_rows(job):
    return sorted(
        MetricRollup.objects.filter(job=job).values_list(
            "name", "width", "rank", "bucket", "first_step", "last_step", "low", "high", "count"
        )
    )


def _heartbeats(job, points, rng):
    """Store and record the points in batches of a few steps, as heartbeats bring them."""
    i = 0
    while i < len(points):
        n = rng.randrange(1, 400)
        batch = points[i : i + n]
        # No savepoints: hundreds of them in the test's transaction slow PostgreSQL down (its
        # subtransaction cache overflows), which heartbeats, one transaction each, never see.
        with transaction.atomic(savepoint=False):
            MetricPoint.objects.bulk_create(batch)
            rollup.record(job.id, batch)
        i += n


@pytest.mark.django_db
def test_rollup_overview_equals_the_raw_scan_with_spikes(setup, monkeypatch):
    team, user, _, _ = setup
    rng = random.Random(7)
    job, attempt = _job_and_attempt(team, user)
    points = _random_points(job, attempt, rng)
    rng.shuffle(points)  # ranks interleaved, steps out of order across batches
    _heartbeats(job, points, rng)
    assert sum(abs(p.value) > 10 for p in points) > 5, "the data has spikes to keep"
    for max_points, rank in [(2000, None), (2000, 0), (200, None), (200, 1), (64, 2), (40, None)]:
        with CaptureQueriesContext(connection) as queries:
            got = metric_series(job.id, "loss", max_points=max_points, rank=rank)
        raw = [q["sql"] for q in queries if "metricpoint" in q["sql"].lower()]
        assert not any("GROUP BY" in sql for sql in raw), raw
        want = _raw_series(monkeypatch, job.id, "loss", max_points=max_points, rank=rank)
        assert got == want, (max_points, rank)
        assert any(got["downsampled"].values())
        for r, series in got["ranks"].items():  # each rank's highest spike and deepest dip
            values = [p.value for p in points if p.rank == int(r)]
            assert max(values) in series["value"] and min(values) in series["value"]
    # Every level and width merges to exactly what one GROUP BY over the raw points gives.
    for width in (16, 32, 256, 1024, 4096, 1 << 16, 1 << 21):
        for rank in (None, 1):
            rows = MetricPoint.objects.filter(job=job, name="loss")
            if rank is not None:
                rows = rows.filter(rank=rank)
            assert rollup.buckets(job.id, "loss", width, rank) == metrics_query._bucket_rows(
                rows, width
            ), (width, rank)


@pytest.mark.django_db
def test_incremental_ingest_equals_a_rebuild_from_scratch(setup):
    team, user, _, _ = setup
    rng = random.Random(11)
    job, attempt = _job_and_attempt(team, user)
    points = _random_points(job, attempt, rng, steps=20_000)
    points += _random_points(job, attempt, rng, name="step_time_s", ranks=(0, 1), steps=9_000)
    # A restart writes steps again from its checkpoint: the same steps a second time.
    again = _random_points(job, attempt, rng, ranks=(0, 1), steps=3_000)
    _heartbeats(job, points, rng)
    _heartbeats(job, again, rng)
    incremental = _rollup_rows(job)
    header = MetricRollup.objects.get(job=job, name="loss", width=rollup.HEADER)
    assert header.count == MetricPoint.objects.filter(job=job, name="loss").count()
    assert header.high == max(p.value for p in points + again if p.name == "loss")
    for name in ("loss", "step_time_s"):
        rollup.rebuild(job.id, name)
    assert _rollup_rows(job) == incremental
    assert len({row[1] for row in incremental}) == 1 + len(rollup.LEVELS)
    MetricRollup.objects.filter(job=job).delete()
    for name in ("loss", "step_time_s"):
        rollup.rebuild(job.id, name)
    assert _rollup_rows(job) == incremental


@pytest.mark.django_db
def test_ingest_records_keeps_the_rollup(setup):
    team, user, _, _ = setup
    job, attempt = _job_and_attempt(team, user)
    records = [
        {"kind": "step", "rank": r, "step": s, "loss": 10.0 / (s + 1), "tokens_per_s": 100.0 + r}
        for s in range(0, 5000, 1)
        for r in (0, 1)
    ]
    records[1234]["loss"] = 99.0
    for i in range(0, len(records), 250):
        ingest.ingest_records(attempt, records[i : i + 250], now=timezone.now())
    assert MetricPoint.objects.filter(job=job).count() == 20_000
    incremental = _rollup_rows(job)
    assert incremental  # kept by ingest, not by a read
    for name in ("loss", "tokens_per_s"):
        rollup.rebuild(job.id, name)
    assert _rollup_rows(job) == incremental
    top = MetricRollup.objects.get(job=job, name="loss", width=16, rank=0, bucket=617 // 16)
    assert top.high == 99.0 and top.count == 16


@pytest.mark.django_db
def test_ingested_points_keep_every_field_as_reported(setup):
    """Ingest writes points with one raw statement, not through model instances: each field
    reads back through the ORM as the worker reported it (its own clock for the time), and
    the rollup of a batch with gaps in it (a resend after an outage) covers only its points."""
    team, user, _, _ = setup
    job, attempt = _job_and_attempt(team, user)
    worker_time = timezone.now() - timedelta(minutes=3, microseconds=4321)
    steps = [7, 300, 4097, 70_000, 8, 9, 301, 4098, 70_001]
    records = [
        {
            "kind": "step",
            "rank": rank,
            "step": step,
            "time": worker_time.timestamp() + step / 100,  # within the hour it may be off
            "loss": 1.5 + step / 1000 + rank,
            "tokens_per_s": 250 + rank,  # an int: stored as a float
        }
        for step in steps
        for rank in (0, 3)
    ]
    # Two batches, each with gaps; the second adds to buckets of the first at every width.
    ingest.ingest_records(attempt, records[:8], now=timezone.now())
    ingest.ingest_records(attempt, records[8:], now=timezone.now())
    stored = {
        (p.rank, p.step, p.name): p
        for p in MetricPoint.objects.filter(job=job).select_related("attempt")
    }
    assert len(stored) == len(records) * 2
    for record in records:
        loss = stored[(record["rank"], record["step"], "loss")]
        assert loss.value == record["loss"]
        assert loss.attempt == attempt
        assert abs(loss.time - (worker_time + timedelta(seconds=record["step"] / 100))) < timedelta(
            microseconds=2
        )
        assert (
            stored[(record["rank"], record["step"], "tokens_per_s")].value == 250.0 + record["rank"]
        )
    incremental = _rollup_rows(job)
    for name in ("loss", "tokens_per_s"):
        rollup.rebuild(job.id, name)
    assert _rollup_rows(job) == incremental
    header = MetricRollup.objects.get(job=job, name="loss", width=rollup.HEADER)
    assert (header.count, header.first_step, header.last_step) == (18, 7, 70_001)
    assert header.high == 1.5 + 70.001 + 3


@pytest.mark.django_db
def test_a_resent_heartbeat_stores_each_step_once(setup):
    """The agent re-sends what a heartbeat carried when it never got the answer (the portal
    restarted after committing it), with whatever the ranks wrote since."""
    team, user, _, _ = setup
    job, attempt = _job_and_attempt(team, user)

    def steps(first, last):
        return [
            {"kind": "step", "rank": r, "step": s, "loss": 1.0 / s, "tokens_per_s": 10.0}
            for s in range(first, last + 1)
            for r in (0, 1)
        ]

    ingest.ingest_records(attempt, steps(1, 3), now=timezone.now())
    pushed = ingest.ingest_records(attempt, steps(1, 5), now=timezone.now())
    assert sorted({(p["rank"], p["step"]) for p in pushed}) == [(0, 4), (0, 5), (1, 4), (1, 5)]
    rank0 = MetricPoint.objects.filter(job=job, name="loss", rank=0).order_by("step")
    assert list(rank0.values_list("step", flat=True)) == [1, 2, 3, 4, 5]
    assert MetricRollup.objects.get(job=job, name="loss", width=rollup.HEADER).count == 10
    # Another attempt of the job (a restart from step 2) stores its own steps.
    Attempt.objects.filter(pk=attempt.pk).update(state="failed", ended_at=timezone.now())
    _, second = _job_and_attempt(team, user, number=2, job=job)
    ingest.ingest_records(second, steps(3, 4), now=timezone.now())
    assert MetricPoint.objects.filter(job=job, name="loss", rank=0).count() == 7


@pytest.mark.django_db
def test_points_written_around_ingest_are_noticed(setup, monkeypatch):
    team, user, _, _ = setup
    rng = random.Random(3)
    job, attempt = _job_and_attempt(team, user)
    points = _random_points(job, attempt, rng, ranks=(0, 1), steps=12_000)
    MetricPoint.objects.bulk_create(points)  # no rollup at all yet: built on the first read
    assert not MetricRollup.objects.filter(job=job).exists()
    first = metric_series(job.id, "loss", max_points=200)
    assert first == _raw_series(monkeypatch, job.id, "loss", max_points=200)
    assert MetricRollup.objects.filter(job=job, width=rollup.HEADER).get().count == len(points)
    # Appended around ingest: only the tail is read again.
    now = timezone.now()
    more = [
        MetricPoint(job=job, attempt=attempt, rank=r, step=s, name="loss", value=0.5, time=now)
        for s in range(12_000, 30_000)
        for r in (0, 1)
    ]
    more[5000].value = 77.0
    MetricPoint.objects.bulk_create(more)
    with CaptureQueriesContext(connection) as queries:
        grown = metric_series(job.id, "loss", max_points=200)
    grouped = [q["sql"] for q in queries if "GROUP BY" in q["sql"] and "metricpoint" in q["sql"]]
    # From the start of the last finest bucket of the rank that had got least far.
    tail = 16 * min(max(p.step for p in points if p.rank == r) // 16 for r in (0, 1))
    assert len(grouped) == 1 and f'"step" >= {tail}' in grouped[0], grouped
    assert grown == _raw_series(monkeypatch, job.id, "loss", max_points=200)
    assert 77.0 in grown["ranks"]["0"]["value"] + grown["ranks"]["1"]["value"]
    # Written below the rollup's end (a late rank, a restart): the whole series again.
    MetricPoint.objects.create(
        job=job, attempt=attempt, rank=1, step=500, name="loss", value=-9.0, time=now
    )
    again = metric_series(job.id, "loss", max_points=200)
    assert again == _raw_series(monkeypatch, job.id, "loss", max_points=200)
    assert -9.0 in again["ranks"]["1"]["value"]
    rows = _rollup_rows(job)
    rollup.rebuild(job.id, "loss")
    assert _rollup_rows(job) == rows


def _together(calls) -> None:
    barrier = threading.Barrier(len(calls))
    errors = []

    def run(call):
        try:
            barrier.wait(timeout=30)
            call()
        except Exception as exc:  # reported below
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=run, args=(call,)) for call in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "an ingest hung"
    assert not errors, errors


@pytest.mark.django_db(transaction=True)
def test_concurrent_ingests_of_one_job_lose_no_count(setup):
    team, user, _, _ = setup
    job, attempt = _job_and_attempt(team, user)
    now = timezone.now()

    def ingest(ranks, seed):
        rng = random.Random(seed)
        for start in range(0, 3000, 50):  # the same buckets as the other thread, at once
            batch = [
                MetricPoint(
                    job_id=job.id,
                    attempt_id=attempt.id,
                    rank=r,
                    step=s,
                    name=name,
                    value=rng.random(),
                    time=now,
                )
                for s in range(start, start + 50)
                for r in ranks
                for name in ("tokens_per_s", "loss")
            ]
            with transaction.atomic():
                MetricPoint.objects.bulk_create(batch)
                rollup.record(job.id, list(reversed(batch)))

    _together([lambda: ingest((0, 1), 1), lambda: ingest((1, 2), 2)])
    assert MetricPoint.objects.filter(job=job).count() == 2 * 3000 * 2 * 2
    incremental = _rollup_rows(job)
    header = MetricRollup.objects.get(job=job, name="loss", width=rollup.HEADER)
    assert header.count == 2 * 3000 * 2
    for name in ("loss", "tokens_per_s"):
        rollup.rebuild(job.id, name)
    assert _rollup_rows(job) == incremental


@pytest.mark.django_db(transaction=True)
def test_simultaneous_heartbeats_with_metrics_and_a_repairing_read(setup, monkeypatch):
    team, user, (a, b), _ = setup
    job = submit(team, user, gpus=4)
    from jobs.scheduling.loop import run_pass

    run_pass()
    attempt = live_attempt(job)

    def records(ranks, start):
        return [
            {"kind": "step", "rank": r, "step": s, "loss": 1.0 / (s + 1) + r}
            for s in range(start, start + 40)
            for r in ranks
        ]

    for round_ in range(8):
        start = round_ * 40
        calls = [
            lambda s=start: beat(a, attempt, {0: None, 1: None}, records=records((0, 1), s)),
            lambda s=start: beat(b, attempt, {2: None, 3: None}, records=records((2, 3), s)),
        ]
        if round_ == 4:  # a point written around ingest: the read repairs while beats land
            MetricPoint.objects.create(
                job=job,
                attempt=attempt,
                rank=0,
                step=3,
                name="loss",
                value=5.0,
                time=timezone.now(),
            )
            calls.append(lambda: rollup.ensure_current(job.id, "loss"))
        _together(calls)
    rollup.ensure_current(job.id, "loss")
    header = MetricRollup.objects.get(job=job, name="loss", width=rollup.HEADER)
    assert header.count == MetricPoint.objects.filter(job=job, name="loss").count() == 8 * 160 + 1
    rows = _rollup_rows(job)
    rollup.rebuild(job.id, "loss")
    assert _rollup_rows(job) == rows


def test_plotly_is_cached_a_day_then_revalidated_by_etag(client):
    first = client.get("/vendor/plotly.min.js")
    assert first.status_code == 200 and len(first.content) > 1_000_000
    assert "max-age=86400" in first["Cache-Control"] and first["ETag"]
    again = client.get("/vendor/plotly.min.js", HTTP_IF_NONE_MATCH=first["ETag"])
    assert again.status_code == 304 and not again.content
    assert "max-age=86400" in again["Cache-Control"]
    other = client.get("/vendor/plotly.min.js", HTTP_IF_NONE_MATCH='"something-else"')
    assert other.status_code == 200 and other.content == first.content
