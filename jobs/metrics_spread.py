"""A wide job's per-rank series, in a form a browser can draw: the band every rank's values lie
in (the minimum and maximum across ranks per step bucket) and the lines of a few ranks only,
rank 0 and the ranks farthest from the rest at the end of the asked range (a straggler, or a
rank far ahead). Drawn per rank, a 4,096-rank job's step-time chart is 4,096 traces of up to
2,000 points each (8 million points, tens of megabytes of JSON): no page draws that.

The band comes from one GROUP BY across ranks: over the series' rollup (`jobs/rollup.py`) for
the whole run once its buckets are at least the rollup's every-rank level wide, so it covers
the run past the raw points' retention (`jobs/metric_store.py`), else over the raw points of
the range. The lines are picked from the raw points of the range's last `PICK_WINDOW` steps
(one GROUP BY per rank on a bounded slice) and read as `jobs/metrics_query.metric_series`
reads any rank, so they are exact where they fit and min/max downsampled where they do not.
The same picking serves the GPU charts' spread (`gpu_spread`).
"""

from __future__ import annotations

import math
import statistics

from django.core.cache import cache
from django.db.models import Avg, BigIntegerField, F, IntegerField, Max, Min, Value
from django.db.models.expressions import ExpressionWrapper

from jobs import rollup
from jobs.metrics_query import gpu_bucket_s, gpu_history, metric_series
from jobs.models import Attempt, GpuSample, MetricPoint, MetricRollup

PICK_WINDOW = 64  # steps at the end of the range whose per-rank means pick the lines
BAND_BUCKETS = 500  # the band's resolution: a chart is ~1,000 px wide, two points a bucket
# Raw points the band may scan; past it the band reads the rollup's every-rank level (256-step
# buckets). A 4,096-rank job two hours in has 29 million raw points per metric, and the page
# of a job that wide asks again every LIVE_REFRESH_S.
BAND_RAW_ROWS = 1_000_000
# How long the whole-run answer is shared: every watcher of a wide job's page asks for it every
# LIVE_REFRESH_S (15 s); 200 of them would each pay its reads.
SHARED_S = 5.0


def pick_ranks(means: dict[int, float], lines: int) -> list[int]:
    """Rank 0 (when it has points), then the ranks whose mean is farthest from the median of
    every rank's mean, either side, up to `lines` ranks in all; in rank order."""
    if not means or lines <= 0:
        return []
    chosen = [0] if 0 in means else []
    middle = statistics.median(means.values())
    others = sorted((r for r in means if r != 0), key=lambda r: (-abs(means[r] - middle), r))
    chosen += others[: max(0, lines - len(chosen))]
    return sorted(chosen)


def metric_spread(
    job_id: int,
    name: str,
    *,
    lines: int,
    since_step: int | None = None,
    until_step: int | None = None,
    max_points: int = 2000,
    attempt: int | None = None,
) -> dict:
    """`metric_series`' answer for at most `lines` ranks (`pick_ranks`), plus `spread`: the
    band across every rank ({"step", "low", "high", "ranks"}) and `lines`: why each rank was
    drawn ("rank 0", "above", "below": farther than the rest from the ranks' median).
    The whole run's answer is shared for `SHARED_S` seconds (the cache)."""
    if since_step is None and until_step is None and attempt is None:
        key = f"metric-spread:{job_id}:{name}:{lines}:{max_points}"
        shared = cache.get(key)
        if shared is None:
            shared = _metric_spread(job_id, name, lines, max_points=max_points)
            cache.set(key, shared, SHARED_S)
        return shared
    return _metric_spread(job_id, name, lines, since_step, until_step, max_points, attempt)


def _metric_spread(
    job_id, name, lines, since_step=None, until_step=None, max_points=2000, attempt=None
) -> dict:
    points = MetricPoint.objects.filter(job_id=job_id, name=name)
    if since_step is not None:
        points = points.filter(step__gt=since_step)
    if until_step is not None:
        points = points.filter(step__lte=until_step)
    if attempt is not None:
        points = points.filter(attempt__number=attempt)
    hi = points.order_by("-step").values_list("step", flat=True).first()
    if hi is None:
        return {"name": name, "ranks": {}, "downsampled": {}, "spread": None, "lines": {}}
    lo = points.order_by("step").values_list("step", flat=True).first()
    means = dict(
        points.filter(step__gt=hi - PICK_WINDOW)
        .order_by()
        .values("rank")
        .annotate(mean=Avg("value"))
        .values_list("rank", "mean")
    )
    chosen = pick_ranks(means, lines)
    result = metric_series(
        job_id,
        name,
        since_step=since_step,
        until_step=until_step,
        max_points=max_points,
        attempt=attempt,
        ranks=chosen,
    )
    middle = statistics.median(means.values())
    result["lines"] = {
        str(r): "rank 0" if r == 0 else ("above" if means[r] >= middle else "below") for r in chosen
    }
    result["spread"] = _band(points, job_id, name, lo, hi, len(means), attempt) | {
        "ranks": len(means)
    }
    return result


def _band(points, job_id: int, name: str, lo: int, hi: int, ranks: int, attempt) -> dict:
    """Per bucket of steps, the lowest and highest value of any rank. From the raw points while
    the range holds at most about `BAND_RAW_ROWS` of them; past that, only its recent part
    (from a rollup bucket's edge on) is read raw, and the steps before it from the rollup's
    buckets, which are coarser (at least 256 steps). The rollup has no attempts: an attempt's
    band is all raw."""
    width = max(1, -(-(hi - lo + 1) // BAND_BUCKETS))
    level = rollup.LEVELS[1]  # the finest level every rank of a wide job keeps
    split = lo
    if attempt is None and (hi - lo + 1) * max(1, ranks) > BAND_RAW_ROWS:
        split = max(lo, (hi - BAND_RAW_ROWS // max(1, ranks) + 1) // level * level)
    rows = list(_rollup_band(job_id, name, lo, split, width)) if split > lo else []
    raw = (
        points.filter(step__gte=split)
        .order_by()
        .annotate(b=ExpressionWrapper((F("step") - lo) / width, output_field=IntegerField()))
        .values("b")
        .annotate(first=Min("step"), low=Min("value"), high=Max("value"))
        .order_by("b")
        .values_list("first", "low", "high")
    )
    rows += list(raw)
    return {
        "step": [r[0] for r in rows],
        "low": [r[1] for r in rows],
        "high": [r[2] for r in rows],
        "bucket_steps": width,
        "raw_from_step": split,
    }


def _rollup_band(job_id: int, name: str, lo: int, split: int, width: int):
    """(first step, lowest, highest) across ranks per bucket of the rollup, for the steps from
    lo's bucket up to `split` (a multiple of 256, so no bucket read reaches past it; the last
    merged bucket may be narrower): the widest level no wider than the band's buckets, so a
    month-long run reads 4,096-step buckets, not 256-step ones."""
    wide = max(rollup.LEVELS[1], 1 << math.ceil(math.log2(width)))
    level = max(w for w in rollup.LEVELS[1:] if w <= wide)
    return (
        MetricRollup.objects.filter(
            job_id=job_id,
            name=name,
            width=level,
            bucket__gte=lo // level,
            bucket__lt=split // level,
        )
        .annotate(
            b=ExpressionWrapper(F("bucket") / Value(wide // level), output_field=BigIntegerField())
        )
        .values("b")
        .annotate(first=Min("first_step"), low=Min("low"), high=Max("high"))
        .order_by("b")
        .values_list("first", "low", "high")
    )


def gpu_spread(job_id: int, *, lines: int, max_points: int = 300) -> dict:
    """The GPU history of a wide job's latest attempt: per time bucket the lowest, mean and
    highest utilization across its ranks, and `gpu_history`'s lines of at most `lines` ranks
    (rank 0 and those farthest from the rest over the last three buckets)."""
    latest = Attempt.objects.filter(job_id=job_id).order_by("-number").first()
    samples = GpuSample.objects.filter(job_id=job_id, attempt=latest)
    span = samples.aggregate(first=Min("t"), last=Max("t"))
    if latest is None or span["first"] is None:
        return {"bucket_s": None, "series": [], "spread": None}
    width = gpu_bucket_s(span["first"], span["last"], max_points)
    means = {
        rank: util
        for rank, util in samples.filter(t__gte=span["last"] - 3 * width)
        .order_by()
        .values("rank")
        .annotate(util=Avg("util"))
        .values_list("rank", "util")
        if util is not None
    }
    history = gpu_history(
        job_id, max_points=max_points, attempt=latest, ranks=pick_ranks(means, lines)
    )
    rows = (
        samples.annotate(
            bucket=ExpressionWrapper(
                F("t") / Value(width, output_field=BigIntegerField()),
                output_field=BigIntegerField(),
            )
        )
        .values("bucket")
        .annotate(t=Min("t"), low=Min("util"), mean=Avg("util"), high=Max("util"))
        .order_by("bucket")
        .values_list("t", "low", "mean", "high")
    )
    band: dict = {"t": [], "low": [], "mean": [], "high": []}
    for t, low, mean, high in rows:
        band["t"].append(t)
        band["low"].append(low)
        band["mean"].append(None if mean is None else round(mean, 2))
        band["high"].append(high)
    band["ranks"] = len(means)  # the ranks with readings in the last buckets
    history["spread"] = band
    return history
