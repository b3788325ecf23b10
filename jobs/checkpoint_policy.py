"""The checkpoint interval a job should use: its own setting, else Young/Daly from the job's
measured save stall and observed failure rate (falling back to the fleet's)."""

from __future__ import annotations

from statistics import median

from django.db.models import Count, DurationField, ExpressionWrapper, F, Q, Sum

from jobs.conf import lockstep_setting
from jobs.health import young_daly_interval
from jobs.models import Attempt, Checkpoint, Job

FAILED = (Attempt.State.FAILED, Attempt.State.LOST)
# Bounds on the suggestion: saving at most 1/MAX_SAVE_SHARE of the time and not more often than
# every MIN_INTERVAL_S (each save also writes bytes and counts against retention), never so
# rarely that a failure costs hours. Young/Daly itself already balances the save cost against
# the work a failure throws away; the floor only guards a near-zero measured stall.
MIN_INTERVAL_S, MAX_INTERVAL_S, MAX_SAVE_SHARE = 10.0, 6 * 3600.0, 20.0


def _mtbf(attempts, prior_s: float) -> tuple[float | None, int]:
    """Running seconds per failure over these ended attempts (None without a failure).

    Smoothed with one prior failure-free interval of `prior_s`: one early failure after a
    minute of running must not make the estimate "one failure a minute" (and the interval a
    few seconds); the estimate moves to the observed rate as running time accumulates.
    One aggregate query: this runs for every claim.
    """
    totals = attempts.filter(running_at__isnull=False, ended_at__isnull=False).aggregate(
        running=Sum(
            ExpressionWrapper(F("ended_at") - F("running_at"), output_field=DurationField())
        ),
        failures=Count("id", filter=Q(state__in=FAILED)),
    )
    failures = totals["failures"] or 0
    running = totals["running"].total_seconds() if totals["running"] else 0.0
    return ((running + prior_s) / (failures + 1) if failures else None), failures


_fleet_cache: dict = {"at": 0.0}
FLEET_CACHE_S = 30.0


def _fleet(prior_s: float) -> tuple[list[float], float | None, int]:
    """The fleet's recent save stalls and MTBF, cached briefly: they change slowly and every
    claim asks for them."""
    import time

    if time.monotonic() - _fleet_cache["at"] > FLEET_CACHE_S:
        saves = list(Checkpoint.objects.order_by("-id").values_list("save_s", flat=True)[:200])
        mtbf, failures = _mtbf(Attempt.objects.all(), prior_s)
        _fleet_cache.update(at=time.monotonic(), saves=saves, mtbf=mtbf, failures=failures)
    return _fleet_cache["saves"], _fleet_cache["mtbf"], _fleet_cache["failures"]


def checkpoint_advice(job: Job) -> dict:
    prior = lockstep_setting("DEFAULT_MTBF_S")
    fresh = job.first_started_at is None  # no attempts, no checkpoints of its own yet
    saves = (
        []
        if fresh
        else list(
            Checkpoint.objects.filter(job=job).order_by("-id").values_list("save_s", flat=True)[:20]
        )
    )
    stall_source = "job"
    mtbf, failures = (None, 0) if fresh else _mtbf(Attempt.objects.filter(job=job), prior)
    mtbf_source = "job"
    if not saves or mtbf is None:
        fleet_saves, fleet_mtbf, fleet_failures = _fleet(prior)
        if not saves:
            saves, stall_source = fleet_saves, "fleet"
        if mtbf is None:
            mtbf, failures, mtbf_source = fleet_mtbf, fleet_failures, "fleet"
    if mtbf is None:
        mtbf, mtbf_source = prior, "default"
    stall = median(saves) if saves else None
    suggested = young_daly_interval(stall, mtbf) if stall else None
    if suggested:
        floor = max(MIN_INTERVAL_S, MAX_SAVE_SHARE * stall)
        suggested = min(max(suggested, floor), MAX_INTERVAL_S)
    return {
        "interval_s": job.checkpoint_interval_s or (round(suggested) if suggested else None),
        "source": "job setting" if job.checkpoint_interval_s else "Young/Daly",
        "young_daly_s": round(suggested, 1) if suggested else None,
        "save_stall_s": round(stall, 3) if stall is not None else None,
        "save_stall_source": stall_source if saves else None,
        "mtbf_s": round(mtbf, 1),
        "mtbf_source": mtbf_source,
        "failures": failures,
    }
