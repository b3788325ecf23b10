"""Reading metric series back, downsampled on the server so charts stay light."""

from jobs.models import MetricPoint


def metric_series(
    job_id: int,
    name: str,
    *,
    since_step: int | None = None,
    max_points: int = 2000,
    rank: int | None = None,
    attempt: int | None = None,
) -> dict:
    """Points of one metric, per rank, as {"name", "ranks": {rank: {"step": [], "value": []}}}.

    When a rank has more than `max_points` points, each bucket of steps keeps its minimum and
    maximum (in step order), so spikes survive downsampling.
    """
    points = MetricPoint.objects.filter(job_id=job_id, name=name)
    if since_step is not None:
        points = points.filter(step__gt=since_step)
    if rank is not None:
        points = points.filter(rank=rank)
    if attempt is not None:
        points = points.filter(attempt__number=attempt)
    by_rank: dict[int, list[tuple[int, float]]] = {}
    for r, step, value in points.order_by("rank", "step", "id").values_list(
        "rank", "step", "value"
    ):
        by_rank.setdefault(r, []).append((step, value))
    out = {}
    for r, series in by_rank.items():
        series = _min_max(series, max_points)
        out[str(r)] = {"step": [s for s, _ in series], "value": [v for _, v in series]}
    return {"name": name, "ranks": out}


def _min_max(series: list[tuple[int, float]], max_points: int) -> list[tuple[int, float]]:
    if len(series) <= max_points:
        return series
    buckets = max(max_points // 2, 1)
    size = -(-len(series) // buckets)
    kept = []
    for start in range(0, len(series), size):
        bucket = series[start : start + size]
        lo = min(bucket, key=lambda p: p[1])
        hi = max(bucket, key=lambda p: p[1])
        kept.extend(sorted({lo, hi}))
    return kept
