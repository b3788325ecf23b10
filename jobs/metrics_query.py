"""Reading metric series back, downsampled on the server so charts stay light.

A rank's series within the asked step range comes back raw when it has at most `max_points`
points. A longer one is cut into `max_points // 2` equal step buckets and each bucket keeps its
minimum and its maximum, so spikes survive downsampling. The bucketing is one GROUP BY pass in
the database, not a loop in Python: a million-point series leaves it as about 2,000 rows.

A bucket's two extremes are placed at its first and last step, the one nearer the previous
bucket's last value first, so a rising or falling curve stays a clean line instead of a zigzag.
A bucket spans about one pixel of the chart it was asked for (max_points ~ 2x the chart's width),
so neither placement is visible; zooming in asks again for the narrower range, down to every
point.
"""

from django.db.models import Count, F, IntegerField, Max, Min
from django.db.models.expressions import ExpressionWrapper

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
    kept, counts = _bucketed(points, span["lo"], span["hi"], max(max_points // 2, 1))
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


def _bucketed(points, lo: int, hi: int, buckets: int):
    """Per rank, (steps, values) with each bucket's minimum and maximum; and per rank, how many
    points it has. One pass over the rows, whatever the number of ranks."""
    width = -(-(hi - lo + 1) // buckets)
    rows = (
        points.order_by()
        .annotate(bucket=ExpressionWrapper((F("step") - lo) / width, output_field=IntegerField()))
        .values("rank", "bucket")
        .annotate(
            first=Min("step"), last=Max("step"), lo=Min("value"), hi=Max("value"), n=Count("id")
        )
        .order_by("rank", "bucket")
        .values_list("rank", "first", "last", "lo", "hi", "n")
    )
    by_rank: dict[int, list] = {}
    for r, *bucket in rows:
        by_rank.setdefault(r, []).append(bucket)
    kept: dict[int, tuple[list, list]] = {}
    counts: dict[int, int] = {}
    for r, rank_buckets in by_rank.items():
        steps, values = kept[r] = ([], [])
        counts[r] = sum(b[4] for b in rank_buckets)
        for index, (first, last, low, high, _) in enumerate(rank_buckets):
            if low == high:
                steps.append(first)
                values.append(low)
                continue
            if values:
                previous = values[-1]
            else:  # the first bucket: go towards where the curve goes next
                after = rank_buckets[index + 1] if index + 1 < len(rank_buckets) else None
                falling = after is not None and (after[2] + after[3]) < (low + high)
                previous = high if falling else low
            pair = (low, high) if abs(previous - low) <= abs(previous - high) else (high, low)
            steps.extend((first, last))
            values.extend(pair)
    return kept, counts
