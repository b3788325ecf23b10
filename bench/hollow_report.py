"""The hollow-node harness's report (bench/hollow.py): the run's figures from what its nodes
and watchers measured, which watcher should have received which points, and issue 20's goals."""

from __future__ import annotations

import os
import threading
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from jobs.settings_table import DEFAULTS
from nodeagent.agent import JITTER


@dataclass
class Stats:
    """What every hollow node and watcher measured, shared (a lock guards it)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    beats: list[float] = field(default_factory=list)  # seconds per accepted heartbeat
    # the portal's own seconds of each (its Server-Timing): the rest of a beat's time waited
    # for a portal thread, the network, or the harness's own threads
    beats_app: list[float] = field(default_factory=list)
    errors: Counter = field(default_factory=Counter)
    # (job, attempt number, rank, step, name) -> times a heartbeat carrying it was accepted
    acked: Counter = field(default_factory=Counter)
    # watcher -> (job, attempt, rank, step, name) -> times received
    received: dict[int, Counter] = field(default_factory=lambda: defaultdict(Counter))
    lags: list[float] = field(default_factory=list)
    # (job, attempt, rank, step) -> when the heartbeat first carrying it was sent, and the lag
    # from then to a watcher: what the portal adds, without the wait for the next heartbeat
    sent_at: dict[tuple, float] = field(default_factory=dict)
    portal_lags: list[float] = field(default_factory=list)
    passes: dict[float, dict] = field(default_factory=dict)  # the scheduler's passes seen
    watching: dict[int, int] = field(default_factory=dict)  # watcher -> its job
    # (job, attempt, rank, step, name) -> when its heartbeat was accepted (monotonic), and
    # when the ranks stopped stepping: a point a watcher lacks is told apart by it.
    acked_at: dict[tuple, float] = field(default_factory=dict)
    stopped_at: float | None = None
    # What the portal stored of the watched jobs, read back at the end (job -> keys): points
    # a hollow node sent for an attempt the portal had already ended are fenced, answered and
    # dropped (jobs/actions/heartbeat.py), so what a watcher must get is what was stored.
    stored: dict[int, set] | None = None
    ended: Counter = field(default_factory=Counter)  # why the watched jobs' attempts ended
    # watcher -> sending process (`src`) -> the push numbers (`seq`) it received
    seqs: dict[int, dict[str, set]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(set))
    )

    def beat(self, seconds: float, app_s: float | None = None) -> None:
        with self.lock:
            self.beats.append(seconds)
            if app_s is not None:
                self.beats_app.append(app_s)

    def error(self, what: str) -> None:
        with self.lock:
            self.errors[what] += 1


# What the portal pushes live (the portal runs with this environment too).
LIVE_RANKS_MAX = int(os.environ.get("LOCKSTEP_LIVE_RANKS_MAX", DEFAULTS["LIVE_RANKS_MAX"]))


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def live_points(stats: Stats, job_id: int) -> set[tuple]:
    """The accepted points a watcher of `job_id` should receive: every rank's, or rank 0's
    alone for a job wider than LIVE_RANKS_MAX (jobs/actions/heartbeat.py). Call with the lock
    held."""
    if stats.stored is not None:
        keys = list(stats.stored.get(job_id, ()))
    else:
        keys = [key for key in stats.acked if key[0] == job_id]
    if len({key[2] for key in keys}) > LIVE_RANKS_MAX:
        keys = [key for key in keys if key[2] == 0]
    return set(keys)


def expected_watcher_points(stats: Stats) -> int:
    return sum(len(live_points(stats, job)) for job in stats.watching.values())


def missing_watcher_points(stats: Stats) -> dict[str, int]:
    """Where the points a watcher should have had and lacks went: accepted in the last 5 s
    before the ranks stopped (still on their way when the harness stopped listening, or not)
    or earlier; and the pushes each watcher saw skipped in its sending processes' numbering
    (dropped between the portal and the websocket: the channel layer). Call with the lock
    held."""
    late = early = 0
    examples = []
    for watcher, job in stats.watching.items():
        got = stats.received.get(watcher, Counter())
        for key in live_points(stats, job):
            if key in got:
                continue
            at = stats.acked_at.get(key)
            if stats.stopped_at is not None and at is not None and at > stats.stopped_at - 5:
                late += 1
            else:
                early += 1
            if len(examples) < 40:
                examples.append([watcher, *key, round(stats.stopped_at - at, 1) if at else None])
    skipped = sum(
        max(numbers) - min(numbers) + 1 - len(numbers)
        for by_source in stats.seqs.values()
        for numbers in by_source.values()
        if numbers
    )
    return {
        "accepted_last_5s": late,
        "accepted_earlier": early,
        "pushes_skipped": skipped,
        # [watcher, job, attempt, rank, step, name, seconds before the stop it was accepted]
        "examples": examples,
    }


def summary(stats: Stats, seconds: float) -> dict[str, Any]:
    with stats.lock:
        beats = list(stats.beats)
        lags = list(stats.lags)
        portal_lags = list(stats.portal_lags)
        passes = list(stats.passes.values())
        return {
            "seconds": round(seconds, 1),
            "heartbeats": len(beats),
            "heartbeats_per_s": round(len(beats) / seconds, 1) if seconds else None,
            "heartbeat_p50_s": percentile(beats, 0.50),
            "heartbeat_p99_s": percentile(beats, 0.99),
            "heartbeat_max_s": max(beats) if beats else None,
            "heartbeat_app_p50_s": percentile(stats.beats_app, 0.50),
            "heartbeat_app_p99_s": percentile(stats.beats_app, 0.99),
            "errors": dict(stats.errors),
            "points_acked": sum(stats.acked.values()),
            "lag_p50_s": percentile(lags, 0.50),
            "lag_p99_s": percentile(lags, 0.99),
            "portal_lag_p50_s": percentile(portal_lags, 0.50),
            "portal_lag_p99_s": percentile(portal_lags, 0.99),
            "lag_at_production_beat_p99_s": lag_at_production_beat(percentile(portal_lags, 0.99)),
            "watcher_points": sum(sum(c.values()) for c in stats.received.values()),
            "watcher_points_expected": expected_watcher_points(stats),
            "watcher_points_missing": missing_watcher_points(stats),
            "watched_points_fenced": (
                None
                if stats.stored is None
                else sum(
                    1
                    for key in stats.acked
                    if key[0] in stats.stored and key not in stats.stored[key[0]]
                )
            ),
            "watched_attempts_ended": dict(stats.ended),
            "scheduler_passes": len(passes),
            "scheduler_pass_p50_s": percentile([p["seconds"] for p in passes], 0.50),
            "scheduler_pass_max_s": max((p["seconds"] for p in passes), default=None),
            "scheduler_queued_max": max((p["queued"] for p in passes), default=None),
            # Where the passes went (jobs/scheduling/loop.py's phases): p50 of each, and the
            # phases of the slowest pass.
            "scheduler_phase_p50_s": {
                name: percentile([p["phases"][name] for p in passes if "phases" in p], 0.50)
                for name in (passes[-1].get("phases") or {} if passes else {})
            },
            # Housekeeping's own chores (detectors, deadlines), p50 of each.
            "scheduler_housekeeping_p50_s": {
                name: percentile(
                    [p["housekeeping"][name] for p in passes if "housekeeping" in p], 0.50
                )
                for name in (passes[-1].get("housekeeping") or {} if passes else {})
            },
            "scheduler_slowest_pass": max(passes, key=lambda p: p["seconds"], default=None),
        }


def lag_at_production_beat(portal_lag_p99_s: float | None) -> float | None:
    """The metric lag from the step at production's heartbeat: a point waits for its node's
    next beat, at most the interval plus its jitter (nodeagent.agent.jittered), then what the
    portal adds (measured). The wait is bounded, so this sum bounds the p99 from above. A run
    at a lower rate (the 2 cores' 32 s a beat) measures `lag_p99_s` from the step too, but most
    of that is its own long wait for the beat, which production does not have."""
    if portal_lag_p99_s is None:
        return None
    return round(DEFAULTS["HEARTBEAT_S"] * (1.0 + JITTER) + portal_lag_p99_s, 4)


def metric_budget(tiers: dict | None) -> dict[str, Any]:
    """What this run's metric tiers, as it left them on disk (hollow_probes.metric_tiers),
    would cost the flagship's month at the default raw retention (bench/metric_storage.py's
    projection): KB per GPU-hour, against the stated budget. None without PostgreSQL."""
    if tiers is None:
        return {"metric_tiers": None, "metric_storage_kb_per_gpu_hour": None}
    from bench.metric_storage import project

    hours = round(DEFAULTS["METRIC_RAW_RETENTION_S"] / 3600)
    projected = project(tiers)["after"][f"{hours}h"]
    return {
        "metric_tiers": tiers,
        "metric_storage_kb_per_gpu_hour": round(projected["bytes_per_gpu_hour"] / 1e3, 1),
    }


GOALS = {  # issue 20's goals, all in one run
    "heartbeat_p99_s": 1.0,
    "lag_at_production_beat_p99_s": 2.0,
    "scheduler_pass_max_s": 1.0,
    # The stated budget (docs/production.md, "Metric storage"), projected from this run.
    "metric_storage_kb_per_gpu_hour": 50.0,
}


def goals(result: dict[str, Any]) -> dict[str, bool]:
    """Which of the goals the run met (no failed heartbeat; the latencies under their caps)."""
    met = {"no_errors": not result["errors"]}
    for name, cap in GOALS.items():
        met[name] = result.get(name) is not None and result[name] <= cap
    return met
