"""Reading metric series back, downsampled on the server so charts stay light.

A rank's series within the asked step range comes back raw when it has at most `max_points`
points. A longer one is cut into `max_points // 2` equal step buckets and each bucket keeps its
minimum and its maximum at the steps where they happened, so spikes survive and the line keeps
its shape. The bucketing runs in the database (one GROUP BY per extreme), not in Python: a
million-point series is read as about 2,000 rows.
"""

from django.db import connection
from django.db.models import Count, Max, Min

from jobs.models import MetricPoint


def metric_series(
    job_id: int,
    name: str,
    *,
    since_step: int | None = None,
    until_step: int | None = None,
    max_points: int = 2000,
    rank: int | None = None,
    attempt: int | None = None,
) -> dict:
    """Points of one metric, per rank, as {"name", "ranks": {rank: {"step": [], "value": []}},
    "downsampled": {rank: bool}}, for steps in (since_step, until_step]."""
    points = MetricPoint.objects.filter(job_id=job_id, name=name)
    if since_step is not None:
        points = points.filter(step__gt=since_step)
    if until_step is not None:
        points = points.filter(step__lte=until_step)
    if rank is not None:
        points = points.filter(rank=rank)
    if attempt is not None:
        points = points.filter(attempt__number=attempt)
    shapes = (
        points.order_by()
        .values("rank")
        .annotate(n=Count("id"), lo=Min("step"), hi=Max("step"))
        .values_list("rank", "n", "lo", "hi")
    )
    out, downsampled = {}, {}
    raw_ranks = []
    for r, n, lo, hi in shapes:
        if n <= max_points:
            raw_ranks.append(r)
            continue
        series = _bucketed(points.filter(rank=r), lo, hi, max(max_points // 2, 1))
        out[r] = {"step": [s for s, _ in series], "value": [v for _, v in series]}
        downsampled[r] = True
    if raw_ranks:
        for r, step, value in (
            points.filter(rank__in=raw_ranks)
            .order_by("rank", "step", "id")
            .values_list("rank", "step", "value")
        ):
            series = out.setdefault(r, {"step": [], "value": []})
            series["step"].append(step)
            series["value"].append(value)
            downsampled[r] = False
    return {
        "name": name,
        "ranks": {str(r): out[r] for r in sorted(out)},
        "downsampled": {str(r): downsampled[r] for r in sorted(downsampled)},
    }


def _bucketed(points, lo: int, hi: int, buckets: int) -> list[tuple[int, float]]:
    """Each step bucket's minimum and maximum, at their own steps, in step order."""
    width = -(-(hi - lo + 1) // buckets)
    inner, params = points.values_list("step", "value").query.sql_with_params()
    kept: dict[int, set[tuple[int, float]]] = {}
    if connection.vendor == "sqlite":
        # SQLite fills a bare column from the row that gave min() or max() (documented).
        queries = [
            f"SELECT (step - %s) / %s AS b, step, {agg}(value) FROM ({inner}) q GROUP BY b"
            for agg in ("MIN", "MAX")
        ]
    elif connection.vendor == "postgresql":
        queries = [
            f"SELECT DISTINCT ON (b) b, step, value FROM "
            f"(SELECT (step - %s) / %s AS b, step, value FROM ({inner}) q0) q "
            f"ORDER BY b, value {order}, step"
            for order in ("ASC", "DESC")
        ]
    else:  # pragma: no cover - the two databases Lockstep runs on are above
        return _min_max_python(
            list(points.order_by("step", "id").values_list("step", "value")), buckets
        )
    with connection.cursor() as cursor:
        for sql in queries:
            cursor.execute(sql, [lo, width, *params])
            for b, step, value in cursor.fetchall():
                kept.setdefault(b, set()).add((step, value))
    return [p for b in sorted(kept) for p in sorted(kept[b])]


def _min_max_python(series: list[tuple[int, float]], buckets: int) -> list[tuple[int, float]]:
    size = -(-len(series) // buckets)
    kept = []
    for start in range(0, len(series), size):
        bucket = series[start : start + size]
        lo = min(bucket, key=lambda p: p[1])
        hi = max(bucket, key=lambda p: p[1])
        kept.extend(sorted({lo, hi}))
    return kept
