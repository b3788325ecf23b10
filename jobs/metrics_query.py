"""Reading metric series back, downsampled on the server so charts stay light.

A rank's series within the asked step range comes back raw when it has at most `max_points`
points. A longer one is cut into `max_points // 2` equal step buckets and each bucket keeps its
minimum and its maximum at the steps where they happened, so spikes survive and the line keeps
its shape. The bucketing runs in the database (one GROUP BY per extreme), not in Python: a
million-point series is read as about 2,000 rows.
"""

from django.db import connection
from django.db.models import Max, Min

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
    if _at_most(points, max_points):
        return _raw(name, points)
    span = points.order_by().aggregate(lo=Min("step"), hi=Max("step"))
    buckets = max(max_points // 2, 1)
    kept, counts = _bucketed(points, span["lo"], span["hi"], buckets)
    # A rank with few points next to long ones comes back whole.
    small = {r for r, n in counts.items() if n <= max_points}
    result = _raw(name, points.filter(rank__in=small) if small else None)
    for r in sorted(set(kept) - small):
        series = [p for b in sorted(kept[r]) for p in sorted(kept[r][b])]
        result["ranks"][str(r)] = {"step": [s for s, _ in series], "value": [v for _, v in series]}
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


def _bucketed(points, lo: int, hi: int, buckets: int):
    """Per rank, each step bucket's minimum and maximum at their own steps; and per rank, how
    many points it has. Two passes over the rows, whatever the number of ranks."""
    width = -(-(hi - lo + 1) // buckets)
    inner, params = points.values_list("rank", "step", "value").query.sql_with_params()
    if connection.vendor == "sqlite":
        # SQLite fills a bare column from the row that gave min() or max() (documented).
        queries = [
            f"SELECT rank, (step - %s) / %s AS b, step, {agg}(value), COUNT(*) "
            f"FROM ({inner}) q GROUP BY rank, b"
            for agg in ("MIN", "MAX")
        ]
    elif connection.vendor == "postgresql":
        queries = [
            f"SELECT DISTINCT ON (rank, b) rank, b, step, value, "
            f"COUNT(*) OVER (PARTITION BY rank, b) FROM "
            f"(SELECT rank, (step - %s) / %s AS b, step, value FROM ({inner}) q0) q "
            f"ORDER BY rank, b, value {order}, step"
            for order in ("ASC", "DESC")
        ]
    else:  # pragma: no cover - the two databases Lockstep runs on are above
        return _bucketed_python(points, buckets)
    kept: dict[int, dict[int, set]] = {}
    counts: dict[int, int] = {}
    with connection.cursor() as cursor:
        for index, sql in enumerate(queries):
            cursor.execute(sql, [lo, width, *params])
            for rank, b, step, value, n in cursor.fetchall():
                kept.setdefault(rank, {}).setdefault(b, set()).add((step, value))
                if index == 0:
                    counts[rank] = counts.get(rank, 0) + n
    return kept, counts


def _bucketed_python(points, buckets: int):
    kept, counts = {}, {}
    by_rank: dict[int, list] = {}
    for r, step, value in points.order_by("rank", "step", "id").values_list(
        "rank", "step", "value"
    ):
        by_rank.setdefault(r, []).append((step, value))
    for r, series in by_rank.items():
        counts[r] = len(series)
        kept[r] = {0: set(_min_max_python(series, buckets))}
    return kept, counts


def _min_max_python(series: list[tuple[int, float]], buckets: int) -> list[tuple[int, float]]:
    size = -(-len(series) // buckets)
    kept = []
    for start in range(0, len(series), size):
        bucket = series[start : start + size]
        lo = min(bucket, key=lambda p: p[1])
        hi = max(bucket, key=lambda p: p[1])
        kept.extend(sorted({lo, hi}))
    return kept
