"""Metric rollups: per (job, name, rank) buckets kept at ingest, so that a whole-run chart
reads a few thousand rollup rows instead of scanning every raw point.

Each series has buckets on fixed grids anchored at step 0, of `LEVELS` widths (16, 256, 4096,
65536 and 1048576 steps). A bucket holds its first and last step, minimum and maximum value and
point count: numbers that merge exactly (min of minima, sum of counts, ...), so

- ingest (`record`, called by `jobs.actions.ingest.ingest_records` in the heartbeat's transaction)
  merges a batch of new points into the buckets they fall in, at every level;
- a chart asking for buckets of width w (a power of two, `jobs.metrics_query`) reads the widest
  level of at most w and merges w / level adjacent buckets in SQL: at most 16 rows per bucket
  asked, per rank, whatever the length of the run.

A series' header row (width 0) holds its totals over every rank. Every change to a series'
rollup first takes its header, in name order: a heartbeat shares it (`FOR KEY SHARE` on
PostgreSQL), merges its points into the buckets in the database (an upsert that adds counts
and takes minima and maxima, so two transactions' points in one bucket both count), and adds
its totals to the header last, so that heartbeats of one job wait for each other only from
that update to their commit (all 512 nodes of a whole-cluster job report into the same
headers; each used to hold them from its first read of the buckets). A read that repairs
takes the header exclusively (`FOR UPDATE`), so it never rebuilds under a heartbeat's merge.

Points written some other way (a bulk load, older data, tests) are noticed by count: a read
compares the header's count with the raw rows' (one index-only count) and, when they differ,
re-reads the raw rows from the start of each rank's last finest bucket if the counts below it
agree (points are appended), or else the whole series (`ensure_current`). Migration 0006
builds the rollups of the series that existed before.
"""

from __future__ import annotations

from django.db import connection, transaction
from django.db.models import Case, Count, F, IntegerField, Max, Min, Q, Sum, Value, When
from django.db.models.expressions import ExpressionWrapper
from django.db.models.functions import Greatest, Least
from django.utils import timezone

from jobs import metric_store
from jobs.bulk_sql import insert_rows
from jobs.models import Job, MetricPoint, MetricRollup

LEVELS = (16, 256, 4096, 65536, 1048576)  # each 16 x the one before
# A job of more ranks than this keeps the finest level for rank 0 only; its other ranks start
# at LEVELS[1]. The finest level is one row per 16 points of every rank, forever: for a
# 4,096-rank run a month long that alone was hundreds of GB (docs/production.md, "Metric
# storage"); rank 0's exact curve and every rank at 256 steps stay.
FINE_RANKS = 64
HEADER = 0  # the width of a series' header row
FIELDS = ("first_step", "last_step", "low", "high", "count")


def _models():
    return MetricPoint, MetricRollup


def _merge(into: list, first: int, last: int, low: float, high: float, n: int) -> None:
    if into[4] == 0:
        into[:] = [first, last, low, high, n]
        return
    into[0] = min(into[0], first)
    into[1] = max(into[1], last)
    into[2] = min(into[2], low)
    into[3] = max(into[3], high)
    into[4] += n


def coarse(world: int) -> bool:
    """Whether a job of `world` ranks keeps the finest level for rank 0 only."""
    return world > FINE_RANKS


def record(job_id: int, points, *, world: int = 0) -> None:
    """Merge new points (MetricPoint objects of one job, just stored) into the job's rollups.
    `world`: the job's ranks (`coarse`)."""
    _, Rollup = _models()
    headers: dict[str, list] = {}
    buckets: dict[tuple, list] = {}  # (name, width, rank, bucket) -> [first, last, lo, hi, n]
    few = not coarse(world)
    for p in points:
        step, value = p.step, p.value
        _merge(headers.setdefault(p.name, [0, 0, 0.0, 0.0, 0]), step, step, value, value, 1)
        for width in LEVELS if few or p.rank == 0 else LEVELS[1:]:
            key = (p.name, width, p.rank, step // width)
            _merge(buckets.setdefault(key, [0, 0, 0.0, 0.0, 0]), step, step, value, value, 1)
    if not headers:
        return
    # No savepoint: inside a heartbeat's transaction a failure here fails the heartbeat.
    with transaction.atomic(savepoint=False):
        _share_headers(job_id, sorted(headers), Rollup)
        # In key order, so that two transactions' upserts lock shared buckets in one order.
        _upsert(job_id, [(*key, *buckets[key]) for key in sorted(buckets)])
        for name in sorted(headers):  # last, in name order: held from here to the commit
            _add_to_header(Rollup, job_id, name, *headers[name])


def _share_headers(job_id: int, names: list[str], Rollup) -> None:
    """Create the series' header rows if missing and hold them shared, in name order: other
    heartbeats may too; a repair (`_lock_headers`, FOR UPDATE) waits for them and they for it.
    SQLite has one writer at a time: nothing to take."""
    _create_headers(job_id, names, Rollup)
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(
                f"SELECT id FROM {Rollup._meta.db_table} WHERE job_id = %s AND width = %s "
                "AND name = ANY(%s) ORDER BY name FOR KEY SHARE",
                [job_id, HEADER, names],
            )


def _add_to_header(Rollup, job_id: int, name: str, first, last, low, high, n) -> None:
    """Merge a batch's totals into the header in SQL (each SET sees the row as it was)."""
    empty = Q(count=0)

    def merged(field: str, value, pick):
        kind = Rollup._meta.get_field(field)
        new = Value(value, output_field=kind)
        return Case(When(empty, then=new), default=pick(field, new), output_field=kind)

    Rollup.objects.filter(job_id=job_id, name=name, width=HEADER, rank=0, bucket=0).update(
        first_step=merged("first_step", first, Least),
        last_step=merged("last_step", last, Greatest),
        low=merged("low", low, Least),
        high=merged("high", high, Greatest),
        count=F("count") + n,
    )


# How a bucket's fields combine with the new points' (the upsert's merge, in the database).
MERGE = {"first_step": "min", "last_step": "max", "low": "min", "high": "max", "count": "sum"}


def _upsert(job_id: int, rows: list[tuple]) -> None:
    """Merge (name, width, rank, bucket, *FIELDS) rows of the job into the rows already
    there, in the database (the same buckets from two transactions add up)."""
    _, Rollup = _models()
    key = ("job_id", "name", "width", "rank", "bucket")
    insert_rows(
        Rollup,
        key + FIELDS,
        [(job_id, *row) for row in rows],
        conflict=key,
        update=FIELDS,
        merge=MERGE,
    )


def _lock_headers(job_id: int, names: list[str], Rollup=None) -> dict:
    """The series' header rows, created if missing and locked exclusively (FOR UPDATE: it
    waits for the heartbeats that share them), in name order."""
    Rollup = Rollup or _models()[1]
    _create_headers(job_id, names, Rollup)
    rows = (
        Rollup.objects.select_for_update()
        .filter(job_id=job_id, width=HEADER, name__in=names)
        .order_by("name")
    )
    return {row.name: row for row in rows}


def _create_headers(job_id: int, names: list[str], Rollup) -> None:
    Rollup.objects.bulk_create(
        [
            Rollup(
                job_id=job_id,
                name=name,
                width=HEADER,
                rank=0,
                bucket=0,
                first_step=0,
                last_step=0,
                low=0.0,
                high=0.0,
                count=0,
            )
            for name in sorted(names)
        ],
        ignore_conflicts=True,
    )


def ensure_current(job_id: int, name: str) -> None:
    """Make the series' rollup agree with its raw points, should they have been written other
    than through `record`. One index-only count when it already does."""
    Point, Rollup = _models()
    if Job.objects.filter(
        pk=job_id, first_started_at__lt=metric_store.pruned_before(timezone.now())
    ).exists():
        # Its old raw points of ranks other than 0 may be gone by retention (jobs.metric_store):
        # the rollup, kept at ingest, is the record now, and counting a long run's points on
        # every read would cost more than the chart.
        return
    points = Point.objects.filter(job_id=job_id, name=name)
    header = Rollup.objects.filter(job_id=job_id, name=name, width=HEADER, rank=0, bucket=0)
    stored = next(iter(header.values_list("count", flat=True)), None)  # the unique index
    if stored == points.count():
        return
    with transaction.atomic(savepoint=False):
        header = _lock_headers(job_id, [name])[name]
        total = points.count()
        if header.count == total:
            return  # another request repaired it meanwhile
        since = 0
        base = LEVELS[0]
        ends = Rollup.objects.filter(job_id=job_id, name=name, width=base).values("rank")
        ends = ends.annotate(end=Max("bucket")).values_list("end", flat=True)
        oldest = min(ends, default=None)
        if oldest:
            # Points are appended: below the start of every rank's last bucket, the same number
            # of raw points as of counted ones means the same points.
            below = (
                Rollup.objects.filter(
                    job_id=job_id, name=name, width=base, bucket__lt=oldest
                ).aggregate(n=Sum("count"))["n"]
                or 0
            )
            if below == points.filter(step__lt=oldest * base).count():
                since = oldest * base
        rebuild(job_id, name, since=since)


def rebuild(job_id: int, name: str, *, since: int = 0, Point=None, Rollup=None) -> None:
    """Recompute the series' buckets from the raw points at steps >= since (a multiple of the
    finest width; 0 = all), then its header. Callers hold the header's lock, or are alone
    (the migration)."""
    if Point is None or Rollup is None:
        Point, Rollup = _models()
    base = LEVELS[0]
    assert since % base == 0
    series = Rollup.objects.filter(job_id=job_id, name=name)
    series.filter(width=base, bucket__gte=since // base).delete()
    rows = (
        Point.objects.filter(job_id=job_id, name=name, step__gte=since)
        .order_by()
        .annotate(b=_div("step", base))
        .values("rank", "b")
        .annotate(
            first=Min("step"), last=Max("step"), lo=Min("value"), hi=Max("value"), n=Count("id")
        )
        .values_list("rank", "b", "first", "last", "lo", "hi", "n")
    )
    _store(Rollup, job_id, name, base, rows)
    for finer, width in zip(LEVELS, LEVELS[1:], strict=False):
        start = since // width
        series.filter(width=width, bucket__gte=start).delete()
        rows = (
            series.filter(width=finer, bucket__gte=start * (width // finer))
            .order_by()
            .annotate(b=_div("bucket", width // finer))
            .values("rank", "b")
            .annotate(
                first=Min("first_step"),
                last=Max("last_step"),
                lo=Min("low"),
                hi=Max("high"),
                n=Sum("count"),
            )
            .values_list("rank", "b", "first", "last", "lo", "hi", "n")
        )
        _store(Rollup, job_id, name, width, rows)
    totals = series.filter(width=LEVELS[-1]).aggregate(
        first=Min("first_step"),
        last=Max("last_step"),
        lo=Min("low"),
        hi=Max("high"),
        n=Sum("count"),
    )
    values = {
        "first_step": totals["first"] or 0,
        "last_step": totals["last"] or 0,
        "low": totals["lo"] or 0.0,
        "high": totals["hi"] or 0.0,
        "count": totals["n"] or 0,
    }
    if not series.filter(width=HEADER).update(**values):
        Rollup.objects.create(job_id=job_id, name=name, width=HEADER, rank=0, bucket=0, **values)
    if coarse(_world(job_id)):
        series.filter(width=base).exclude(rank=0).delete()


def _world(job_id: int) -> int:
    return next(iter(Job.objects.filter(pk=job_id).values_list("gpus", flat=True)), 0)


def _store(Rollup, job_id: int, name: str, width: int, rows) -> None:
    Rollup.objects.bulk_create(
        (
            Rollup(
                job_id=job_id,
                name=name,
                width=width,
                rank=rank,
                bucket=bucket,
                first_step=first,
                last_step=last,
                low=lo,
                high=hi,
                count=n,
            )
            for rank, bucket, first, last, lo, hi, n in list(rows)
        ),
        batch_size=1000,
    )


def _div(field: str, by: int):
    return ExpressionWrapper(F(field) / by, output_field=IntegerField())


def buckets(job_id: int, name: str, width: int, rank=None) -> dict[int, list]:
    """Per rank, [bucket, first step, last step, min, max, count] for buckets of `width` steps
    (a power of two, at least LEVELS[0]) from step 0, in bucket order: what one GROUP BY over
    the raw points would give, read from the widest level of at most `width`. `rank`: every
    rank (None), one, or a collection of them."""
    _, Rollup = _models()
    ranks = None if rank is None else {rank} if isinstance(rank, int) else set(rank)
    level = max(w for w in LEVELS if w <= width)
    if level == LEVELS[0] and coarse(_world(job_id)):
        # Only rank 0 has the finest level: the others come at the next (fewer points).
        out = (
            _buckets(Rollup, job_id, name, width, level, {0}) if ranks is None or 0 in ranks else {}
        )
        if ranks != {0}:
            wider = max(width, LEVELS[1])
            others = _buckets(
                Rollup, job_id, name, wider, LEVELS[1], None if ranks is None else ranks - {0}
            )
            out.update((r, rows) for r, rows in others.items() if r != 0)
        return out
    return _buckets(Rollup, job_id, name, width, level, ranks)


def _buckets(Rollup, job_id: int, name: str, width: int, level: int, ranks) -> dict[int, list]:
    rows = Rollup.objects.filter(job_id=job_id, name=name, width=level)
    if ranks is not None:
        rows = rows.filter(rank__in=sorted(ranks))
    fields = ("rank", "b", "first", "last", "lo", "hi", "n")
    if width == level:
        rows = rows.annotate(
            b=F("bucket"),
            first=F("first_step"),
            last=F("last_step"),
            lo=F("low"),
            hi=F("high"),
            n=F("count"),
        )
    else:
        rows = (
            rows.order_by()
            .annotate(b=_div("bucket", width // level))
            .values("rank", "b")
            .annotate(
                first=Min("first_step"),
                last=Max("last_step"),
                lo=Min("low"),
                hi=Max("high"),
                n=Sum("count"),
            )
        )
    by_rank: dict[int, list] = {}
    for r, b, first, last, lo, hi, n in rows.order_by("rank", "b").values_list(*fields):
        # int(): PostgreSQL's sum of a bigint is a numeric.
        by_rank.setdefault(r, []).append([b, first, last, lo, hi, int(n)])
    return by_rank
