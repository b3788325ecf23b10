"""Reading metric series back, downsampled on the server so charts stay light.

A rank's series within the asked step range comes back raw when it has at most `max_points`
points. A longer one is cut into `max_points // 2` equal step buckets and each bucket keeps its
minimum and its maximum, so spikes survive downsampling. The bucketing is one GROUP BY pass in
the database, not a loop in Python. The whole run's overview reads the series' rollup
(`jobs/rollup.py`, kept at ingest) instead of the raw points: a million-point series costs a
few thousand rollup rows, on its first view as on any later one.

A bucket's two extremes are placed at its first and last step, the one nearer the previous
bucket's last value first, so a rising or falling curve stays a clean line instead of a zigzag.
A bucket spans about one pixel of the chart it was asked for (max_points ~ 2x the chart's width),
so neither placement is visible; zooming in asks again for the narrower range, down to every
point.
"""

import math

from django.db.models import Avg, BigIntegerField, Count, F, IntegerField, Max, Min, Value
from django.db.models.expressions import ExpressionWrapper

from jobs import rollup
from jobs.conf import lockstep_setting
from jobs.models import Allocation, Attempt, GpuSample, MetricPoint, MetricRollup


def metric_series(
    job_id: int,
    name: str,
    *,
    since_step: int | None = None,
    until_step: int | None = None,
    max_points: int = 2000,
    rank: int | None = None,
    attempt: int | None = None,
    ranks: list[int] | None = None,
) -> dict:
    """Points of one metric, per rank, as {"name", "ranks": {rank: {"step": [], "value": []}},
    "downsampled": {rank: bool}}, for steps in (since_step, until_step]. `rank` or `ranks`:
    only that rank, or those (read together, one query for all of them, through the
    points' (job, name, rank, step) index)."""
    if ranks is not None:
        rank = None
    points = MetricPoint.objects.filter(job_id=job_id, name=name)
    if since_step is not None:
        points = points.filter(step__gt=since_step)
    if until_step is not None:
        points = points.filter(step__lte=until_step)
    if rank is not None:
        points = points.filter(rank=rank)
    if ranks is not None:
        points = points.filter(rank__in=ranks)
    if attempt is not None:
        points = points.filter(attempt__number=attempt)
    if _at_most(points, max_points):
        return _raw(name, points)
    # Two ordered LIMIT 1 reads walk the (job, name, step) index from either end; one
    # aggregate with both MIN and MAX would read every row.
    lo = points.order_by("step").values_list("step", flat=True).first()
    hi = points.order_by("-step").values_list("step", flat=True).first()
    buckets = max(max_points // 2 - 1, 1)
    if since_step is None and until_step is None and attempt is None:
        by_rank = _overview(
            points, job_id, name, ranks if ranks is not None else rank, lo, hi, buckets
        )
    else:
        width = -(-(hi - lo + 1) // buckets)
        by_rank = _bucket_rows(points, width, lo)
    kept = {r: _line(rows) for r, rows in by_rank.items()}
    counts = {r: sum(row[5] for row in rows) for r, rows in by_rank.items()}
    # A rank with few points next to long ones comes back whole.
    small = {r for r, n in counts.items() if n <= max_points}
    result = _raw(name, points.filter(rank__in=small) if small else None)
    for r in sorted(set(kept) - small):
        steps, values = kept[r]
        result["ranks"][str(r)] = {"step": steps, "value": values}
        result["downsampled"][str(r)] = True
    order = sorted(result["ranks"], key=int)
    result["ranks"] = {r: result["ranks"][r] for r in order}
    result["downsampled"] = {r: result["downsampled"][r] for r in order}
    return result


def _at_most(points, limit: int) -> bool:
    """Whether the query has at most `limit` rows, reading no more than limit + 1 of them."""
    return points.order_by().values("id")[: limit + 1].count() <= limit


def _raw(name: str, points) -> dict:
    out: dict[str, dict] = {"name": name, "ranks": {}, "downsampled": {}}
    if points is None:
        return out
    for r, step, value in points.order_by("rank", "step", "id").values_list(
        "rank", "step", "value"
    ):
        series = out["ranks"].setdefault(str(r), {"step": [], "value": []})
        series["step"].append(step)
        series["value"].append(value)
        out["downsampled"][str(r)] = False
    return out


def _bucket_rows(points, width: int, origin: int = 0) -> dict[int, list]:
    """Per rank, [bucket, first step, last step, min, max, count] for buckets of `width` steps
    from `origin`, in bucket order. One GROUP BY pass, whatever the number of ranks."""
    rows = (
        points.order_by()
        .annotate(
            bucket=ExpressionWrapper((F("step") - origin) / width, output_field=IntegerField())
        )
        .values("rank", "bucket")
        .annotate(
            first=Min("step"), last=Max("step"), lo=Min("value"), hi=Max("value"), n=Count("id")
        )
        .order_by("rank", "bucket")
        .values_list("rank", "bucket", "first", "last", "lo", "hi", "n")
    )
    by_rank: dict[int, list] = {}
    for r, *bucket in rows:
        by_rank.setdefault(r, []).append(bucket)
    return by_rank


def _overview(points, job_id: int, name: str, rank, lo: int, hi: int, buckets: int) -> dict:
    """The whole run's buckets, on a grid anchored at step 0 whose width is a power of two, so
    the grid stays put while the run grows. Read from the series' rollup (`jobs/rollup.py`,
    kept at ingest): a few thousand rows at most, never the raw points, unless the grid is
    finer than the rollup's finest (a short run: at most about 16 x `buckets` steps)."""
    width = 1 << max(0, math.ceil(math.log2(max(1, -(-(hi - lo + 1) // buckets)))))
    while hi // width - lo // width + 1 > buckets:
        width *= 2
    if width < rollup.LEVELS[0]:
        return _bucket_rows(points, width)
    rollup.ensure_current(job_id, name)
    return rollup.buckets(job_id, name, width, rank)


def _line(rank_rows: list) -> tuple[list, list]:
    """A rank's buckets as (steps, values): each bucket's min and max at its first and last
    step, the extreme nearer the line so far first."""
    steps: list[int] = []
    values: list[float] = []
    for index, (_, first, last, low, high, _n) in enumerate(rank_rows):
        if low == high:
            steps.append(first)
            values.append(low)
            continue
        if values:
            previous = values[-1]
        else:  # the first bucket: go towards where the curve goes next
            after = rank_rows[index + 1] if index + 1 < len(rank_rows) else None
            falling = after is not None and (after[3] + after[4]) < (low + high)
            previous = high if falling else low
        pair = (low, high) if abs(previous - low) <= abs(previous - high) else (high, low)
        steps.extend((first, last))
        values.extend(pair)
    return steps, values


def gpu_bucket_s(first: int, last: int, max_points: int) -> int:
    """The time bucket (seconds) that cuts readings from `first` to `last` into at most about
    `max_points`, never finer than the nodes' sampling period."""
    period = max(1, math.ceil(lockstep_setting("GPU_SAMPLE_S")))
    return max(period, math.ceil((last - first + 1) / max(1, max_points)))


def gpu_history(
    job_id: int,
    *,
    max_points: int = 300,
    since: int | None = None,
    attempt: Attempt | None = None,
    ranks: list[int] | None = None,
) -> dict:
    """The job's kept GPU readings (`GpuSample`), per attempt and rank, as at most about
    `max_points` time buckets each: the mean utilization and memory of the samples in a bucket
    (one GROUP BY on the epoch seconds; GPU use is a level, not a curve with spikes to keep).
    `since` (epoch seconds) narrows it to the samples from then on; `attempt` and `ranks` to
    those of one attempt and some of its ranks (a wide job's lines, `jobs/metrics_spread.py`),
    bucketed as that attempt's readings are."""
    samples = GpuSample.objects.filter(job_id=job_id)
    if since is not None:
        samples = samples.filter(t__gte=since)
    if attempt is not None:
        samples = samples.filter(attempt=attempt)
    span = samples.aggregate(first=Min("t"), last=Max("t"))
    if span["first"] is None:
        return {"bucket_s": None, "series": []}
    width = gpu_bucket_s(span["first"], span["last"], max_points)
    if ranks is not None:
        samples = samples.filter(rank__in=ranks)
    rows = (
        samples.annotate(
            bucket=ExpressionWrapper(
                F("t") / Value(width, output_field=BigIntegerField()),
                output_field=BigIntegerField(),
            )
        )
        .values("attempt_id", "rank", "bucket")
        .annotate(
            t=Min("t"), util=Avg("util"), mem_used=Avg("mem_used"), mem_total=Max("mem_total")
        )
        .order_by("attempt_id", "rank", "bucket")
    )
    numbers = dict(Attempt.objects.filter(job_id=job_id).values_list("id", "number"))
    allocations = Allocation.objects.filter(attempt__job_id=job_id)
    if attempt is not None:
        allocations = allocations.filter(attempt=attempt)
    if ranks is not None:
        allocations = allocations.filter(rank__in=ranks)
    places = {
        (attempt_id, rank): (node, gpu)
        for attempt_id, rank, node, gpu in allocations.values_list(
            "attempt_id", "rank", "node__name", "gpu__index"
        )
    }
    series: dict[tuple, dict] = {}
    for row in rows:
        key = (row["attempt_id"], row["rank"])
        if key not in series:
            node, gpu = places.get(key, (None, None))
            series[key] = {
                "attempt": numbers.get(row["attempt_id"]),
                "rank": row["rank"],
                "node": node,
                "gpu": gpu,
                "t": [],
                "util": [],
                "mem_used": [],
                "mem_total": None,  # the largest reading: a GPU's total does not change
            }
        line = series[key]
        line["t"].append(row["t"])
        line["util"].append(None if row["util"] is None else round(row["util"], 2))
        line["mem_used"].append(None if row["mem_used"] is None else round(row["mem_used"]))
        line["mem_total"] = max(line["mem_total"] or 0, row["mem_total"] or 0) or None
    return {"bucket_s": width, "series": list(series.values())}


def metric_names(job_id: int) -> list[str]:
    """Every series the job has stored, by name: the steps' metrics and whatever scalars its
    script logged (TensorBoard tags). Read from the rollups' header rows, one per series."""
    return sorted(
        MetricRollup.objects.filter(job_id=job_id, width=rollup.HEADER)
        .values_list("name", flat=True)
        .distinct()
    )
