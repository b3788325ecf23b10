"""The leader's start estimates: worked out in the pass while that is cheap, else beside it.

`estimate.estimate_starts` replays plan() forward, a hundred times or more: at the target's
size (512 nodes, 10,000 queued) that took 0.4 s with gangs of 8-64 GPUs and 2 s with many small
jobs, beside a plan() of 0.3-0.4 s, and the pass decides nothing while it runs. Estimates are
advice; placements are not. So, as Slurm works out expected start times in its backfill cycle
(every `bf_interval`, 30 s by default) and not in its main scheduler: once one estimate took
longer than ESTIMATE_INLINE_S, the next ones run in a process of their own (below the leader's
priority, so a pass never waits on it), at most every ESTIMATE_EVERY_S, on the snapshot of the
pass that asked; each pass writes the latest finished ones for the jobs still queued. A cluster
small enough to estimate within the budget gets them fresh every pass, as before.

Before the first estimate has been measured, its cost is taken to be at least the pass's own
plan(), which the estimate replays many times over: a leader that starts with 10,000 queued on
512 nodes (plan 0.3-0.4 s) sends even its first estimate beside the pass, which otherwise took
a pass over 1 s to learn what it costs (bench/hollow.py, docs/production.md). Once beside the
pass, estimates stay there for the leadership term, as Slurm's stay in its backfill cycle.

Importing this module imports no Django: the worker process loads only the pure scheduler.
"""

from __future__ import annotations

import concurrent.futures
import logging
import multiprocessing
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures.process import BrokenProcessPool
from datetime import datetime

from jobs.scheduling.estimate import estimate_starts, head_of_queue
from jobs.scheduling.snapshot import Snapshot

log = logging.getLogger("lockstep.scheduler")


def _timed(snapshot: Snapshot, stop_grace_s: float, approval_delay_s: float):
    """(estimates, seconds it took): what the worker process runs."""
    started = time.perf_counter()
    found = estimate_starts(snapshot, stop_grace_s=stop_grace_s, approval_delay_s=approval_delay_s)
    return found, time.perf_counter() - started


def _below_the_leader() -> None:
    os.nice(10)  # advice only: the leader's passes and the portal come first


class Estimator:
    """One per leadership term (jobs/scheduling/loop.py), like the reason memo. `on_ready`, if
    given, is called (from a pool thread) when a background estimate finishes: the loop wakes
    for a pass that writes it instead of leaving it for the tick."""

    def __init__(
        self,
        *,
        inline_s: float,
        every_s: float,
        on_ready: Callable[[], None] | None = None,
    ) -> None:
        self.inline_s = inline_s
        self.every_s = every_s
        self.on_ready = on_ready
        self.latest: dict[int, datetime] = {}
        self.cost_s: float | None = None  # how long the last estimate took (None: not yet)
        # Once beside the pass, always beside it for this term: a background estimate measured
        # a little under the budget (its process below the leader's priority) brought the next
        # ones back into the pass, where one cost 0.17 s of a 1.35 s pass (bench/hollow.py).
        self.beside = False
        self.started_at: float | None = None  # monotonic: when the latest was asked for
        self.background = 0  # estimates run in the worker process (for tests and reports)
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._running: concurrent.futures.Future | None = None

    def estimates(
        self,
        snapshot: Snapshot,
        *,
        stop_grace_s: float,
        approval_delay_s: float,
        plan_s: float = 0.0,
        order: Sequence[int] = (),
    ) -> dict[int, datetime]:
        """Queued job id -> estimated start, for the pass that planned `snapshot` in `plan_s`
        seconds (`order`: that plan's order of the queue, `Plan.order`)."""
        self._collect()
        expected_s = plan_s if self.cost_s is None else self.cost_s
        self.beside = self.beside or expected_s > self.inline_s
        if self._running is None and not self.beside:
            self.started_at = time.monotonic()
            head = head_of_queue(snapshot, order=order)
            self.latest, self.cost_s = _timed(head, stop_grace_s, approval_delay_s)
            return self.latest
        due = self.started_at is None or time.monotonic() - self.started_at >= self.every_s
        if self._running is None and due:
            self.started_at = time.monotonic()
            try:
                # The head is taken only here: a pass that reuses the last estimates does not
                # pick it for nothing.
                head = head_of_queue(snapshot, order=order)
                self._running = self._worker().submit(_timed, head, stop_grace_s, approval_delay_s)
            except (BrokenProcessPool, RuntimeError):  # never a failed pass over advice
                log.warning("start estimate worker unavailable; a new one next time")
                self.close()
            else:
                self._running.add_done_callback(self._ready)
                self.background += 1
        queued = {job.id for job in snapshot.queued}
        return {job_id: at for job_id, at in self.latest.items() if job_id in queued}

    def _collect(self) -> None:
        running = self._running
        if running is None or not running.done():
            return
        self._running = None
        try:
            self.latest, self.cost_s = running.result()
        except Exception as exc:  # a failed estimate leaves the last ones; the next as due
            log.error("start estimate failed: %r", exc)
            if isinstance(exc, BrokenProcessPool):  # the worker died (killed, out of memory)
                self.close()  # the next estimate starts a new one

    def _ready(self, _future) -> None:
        if self.on_ready is not None:
            try:
                self.on_ready()
            except Exception:  # waking is a courtesy: the tick comes anyway
                log.warning("could not wake the scheduler for new estimates", exc_info=True)

    def _worker(self) -> concurrent.futures.ProcessPoolExecutor:
        if self._pool is None:
            # spawn, not fork: the leader holds database connections and a Redis client,
            # which a forked child must not share.
            self._pool = concurrent.futures.ProcessPoolExecutor(
                max_workers=1,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_below_the_leader,
            )
        return self._pool

    def wait(self, timeout_s: float) -> bool:
        """Block until a background estimate in flight has finished (tests, shutdown)."""
        if self._running is None:
            return True
        try:
            self._running.exception(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            return False
        return True

    def close(self) -> None:
        """End the worker now (it only computes advice: nothing is lost) and wait for the pool
        to wind down, so that a stopping leader neither waits out an estimate nor leaves the
        pool's semaphores behind (Python 3.11 has no terminate_workers())."""
        if self._pool is not None:
            for process in list(getattr(self._pool, "_processes", {}).values()):
                process.terminate()
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._running = None
