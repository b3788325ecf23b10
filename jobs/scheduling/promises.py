"""Start estimates as promises, and how far they were off: the simulator's record (issue 17).

The live scheduler estimates every pass with `estimate_starts(head_of_queue(snapshot))` (on the
snapshot the pass planned from) and the portal shows each queued job its estimate. The
simulator promises the same way, at two moments of a job's wait:

- `at_submit`: the estimate of the pass at the job's submit time, if that pass left it queued.
  A job placed by that pass did not wait and has no promise (`placed_at_once`).
- `after_1h`: the estimate of the pass one hour after submit, if the job has not started by
  then (the engine wakes then, so a pass happens: `after_pass` says when).

A job the estimate does not reach (beyond the first ESTIMATE_HEAD in the policy's order, or
past the replay's horizon of events) gets no promise: `coverage` counts the share that did.
Error = actual first start - promise, in seconds: positive when the job started late. Pure: no
Django, no clock; the engine hands in its snapshot, queue and first starts.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Container, Sequence
from datetime import datetime

from jobs.scheduling.estimate import estimate_starts, head_of_queue
from jobs.scheduling.sim_metrics import pct_sorted
from jobs.scheduling.snapshot import Snapshot
from jobs.scheduling.trace import SIZE_CLASSES, size_class

LATER_S = 3600.0  # the second promise, this long after submit
MOMENTS = ("at_submit", "after_1h")


class PromiseBook:
    """What each job was promised, filled by the engine's hooks `arrived` and `after_pass`."""

    def __init__(
        self,
        epoch: datetime,
        *,
        stop_grace_s: float,
        approval_delay_s: float,
        later_s: float = LATER_S,
    ):
        self.epoch = epoch
        self.stop_grace_s = stop_grace_s
        self.approval_delay_s = approval_delay_s
        self.later_s = later_s
        self.promised: dict[str, dict[int, float]] = {m: {} for m in MOMENTS}  # job -> start s
        self.unreached: dict[str, set[int]] = {m: set() for m in MOMENTS}  # waited, no estimate
        self.placed_at_once: set[int] = set()
        self._arrivals: list[int] = []  # arrived since the last pass
        self._due: list[tuple[float, int]] = []  # (submit + later_s, job) for `after_1h`
        self.estimates = 0  # estimate_starts calls
        self.estimate_time_s = 0.0
        self.estimate_max_s = 0.0

    def arrived(self, jid: int) -> None:
        """A job's first arrival (a job requeued after a preemption is not one)."""
        self._arrivals.append(jid)

    def after_pass(
        self,
        snapshot: Snapshot,
        queued: Container[int],
        first_start: Sequence[float | None],
        t: float,
    ) -> list[float]:
        """After the pass at `t` that planned from `snapshot`: promise what is due, with one
        estimate for all of them (it replays plan() up to 200 times). Returns when the engine
        must wake for the second promises of the jobs that arrived and still wait."""
        need: list[tuple[int, str]] = []
        wake: list[float] = []
        for jid in self._arrivals:
            if jid in queued:
                need.append((jid, "at_submit"))
                heapq.heappush(self._due, (t + self.later_s, jid))
                wake.append(t + self.later_s)
            else:
                self.placed_at_once.add(jid)
        self._arrivals.clear()
        while self._due and self._due[0][0] <= t:
            _, jid = heapq.heappop(self._due)
            if jid in queued and first_start[jid - 1] is None:
                need.append((jid, "after_1h"))
        if not need:
            return wake
        began = time.perf_counter()
        starts = estimate_starts(
            head_of_queue(snapshot),
            stop_grace_s=self.stop_grace_s,
            approval_delay_s=self.approval_delay_s,
        )
        took = time.perf_counter() - began
        self.estimates += 1
        self.estimate_time_s += took
        self.estimate_max_s = max(self.estimate_max_s, took)
        for jid, moment in need:
            when = starts.get(jid)
            if when is None:
                self.unreached[moment].add(jid)
            else:
                self.promised[moment][jid] = (when - self.epoch).total_seconds()
        return wake

    def records(self, gpus: Sequence[int], first_start: Sequence[float | None]) -> list[tuple]:
        """Per job that waited at submit or one hour on: (job index, GPUs, promise at submit,
        promise after 1 h, first start); None where there is none."""
        jids = sorted(
            set().union(*self.promised.values(), *self.unreached.values()) - self.placed_at_once
        )
        at, later = self.promised["at_submit"], self.promised["after_1h"]
        return [
            (jid - 1, gpus[jid - 1], at.get(jid), later.get(jid), first_start[jid - 1])
            for jid in jids
        ]

    def summary(self, gpus: Sequence[int], first_start: Sequence[float | None]) -> dict:
        """The metrics' "estimates" object (docs/simulator.md, "Start estimates")."""
        at_once = {c: 0 for c in SIZE_CLASSES}
        for jid in self.placed_at_once:
            at_once[size_class(gpus[jid - 1])] += 1
        out: dict = {
            "later_s": self.later_s,
            "placed_at_once": sum(at_once.values()),
            "placed_at_once_by_size": at_once,
        }
        for moment in MOMENTS:
            errors: dict[str, list[float]] = {c: [] for c in SIZE_CLASSES}
            waited = {c: 0 for c in SIZE_CLASSES}
            never = {c: 0 for c in SIZE_CLASSES}
            for jid in self.unreached[moment]:
                waited[size_class(gpus[jid - 1])] += 1
            for jid, promise in self.promised[moment].items():
                cls = size_class(gpus[jid - 1])
                waited[cls] += 1
                start = first_start[jid - 1]
                if start is None:
                    never[cls] += 1
                else:
                    errors[cls].append(start - promise)
            by_size = {c: error_stats(errors[c], waited[c], never[c]) for c in SIZE_CLASSES}
            every = [e for c in SIZE_CLASSES for e in errors[c]]
            out[moment] = {
                **error_stats(every, sum(waited.values()), sum(never.values())),
                "by_size": by_size,
            }
        out["estimate_calls"] = self.estimates
        out["estimate_time_s"] = round(self.estimate_time_s, 3)
        out["estimate_mean_ms"] = round(
            1000 * self.estimate_time_s / self.estimates if self.estimates else 0.0, 2
        )
        out["estimate_max_s"] = round(self.estimate_max_s, 4)
        return out


def error_stats(errors: Sequence[float], waited: int, never_started: int = 0) -> dict:
    """count (promised and started), median and p90 of |error|, bias (median signed error),
    late share, and coverage (promised / waited)."""
    absolute = sorted(abs(e) for e in errors)
    signed = sorted(errors)
    promised = len(errors) + never_started
    return {
        "waited": waited,
        "promised": promised,
        "coverage": round(promised / waited, 4) if waited else None,
        "count": len(errors),
        "never_started": never_started,
        "median_abs_s": _r(pct_sorted(absolute, 50)) if errors else None,
        "p90_abs_s": _r(pct_sorted(absolute, 90)) if errors else None,
        "bias_s": _r(pct_sorted(signed, 50)) if errors else None,
        "late_fraction": round(sum(1 for e in errors if e > 0) / len(errors), 4)
        if errors
        else None,
    }


def _r(x: float) -> float:
    return round(x, 1)
