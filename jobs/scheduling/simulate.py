"""The scheduler simulator: replays a job trace through a pure `plan(snapshot) -> Plan` on a
virtual clock (no processes, no database) and measures what users and admins would see.

The engine calls the planner only at event times (arrivals, completions and preemption stops,
batched per timestamp) and only while jobs are queued; the planner sees only queued jobs. Metric
definitions are in docs/simulator.md; the measurements themselves in sim_metrics.py, the reclaim
clocks in sim_reclaims.py.

The engine is one state machine: its event handlers (start, preempt, approve, stop, complete)
share the virtual cluster's state, which is why it stays one class rather than handlers in
several modules passing that state back and forth; the preemption handlers (a proposal carried
out, approved, its victim stopped) are its mixin in sim_stops.py. Its inputs are in trace.py
(and generate.py), its configuration and result in sim_config.py.
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

from jobs.scheduling.promises import PromiseBook
from jobs.scheduling.protection import min_run_s
from jobs.scheduling.sim_config import (
    EPOCH,
    POLICIES,
    PlanFn,
    SimConfig,
    SimResult,
    SimulationError,
    _at,
    resolve_policy,
)
from jobs.scheduling.sim_metrics import engine_metrics, fit_reason, queued_job_fits, waits_by_class
from jobs.scheduling.sim_reclaims import ReclaimClocks
from jobs.scheduling.sim_stops import _APPROVE, _COMPLETE, _STOP, _WAKE, Stops
from jobs.scheduling.snapshot import JobView, NodeView, RunningView, Snapshot, TeamView
from jobs.scheduling.trace import TeamQuota, TraceJob, equal_quotas

# The simulator's public names: its entry points and what they take and give (sim_config.py).
__all__ = [
    "EPOCH",
    "POLICIES",
    "PlanFn",
    "SimConfig",
    "SimResult",
    "SimulationError",
    "resolve_policy",
    "run",
    "simulate",
]

INF = math.inf


# ---------------------------------------------------------------------------------------------
# The engine


@dataclass
class _Run:
    """One live attempt."""

    start: float
    end: float  # true end (from the trace), not the estimate
    slots: list[tuple[int, int]]  # (node index, GPU index)
    view: RunningView
    attempt: int
    expected: float  # end by the runtime estimate (what the planner is told)
    stopping_at: float | None = None
    warmup: float = 0.0  # restart cost of this attempt, before its work resumes


class _Engine(Stops):
    def __init__(
        self,
        trace: Sequence[TraceJob],
        plan_fn: PlanFn,
        name: str,
        cfg: SimConfig,
        progress: Callable[[dict], None] | None = None,
    ):
        if cfg.gpus <= 0 or cfg.gpus_per_node <= 0:
            raise ValueError("gpus and gpus_per_node must be positive")
        self.cfg, self.plan_fn, self.name, self.progress = cfg, plan_fn, name, progress
        # Cluster: nodes of gpus_per_node GPUs (the last one smaller if N does not divide).
        n_nodes = -(-cfg.gpus // cfg.gpus_per_node)
        racks = cfg.racks or max(1, -(-n_nodes // 32))
        self.node_ids = list(range(1, n_nodes + 1))
        self.node_index = {nid: i for i, nid in enumerate(self.node_ids)}
        sizes = [cfg.gpus_per_node] * n_nodes
        sizes[-1] = cfg.gpus - cfg.gpus_per_node * (n_nodes - 1)
        self.free = [set(range(s)) for s in sizes]
        self.node_sizes = sizes
        self.node_views = [
            NodeView(
                id=nid,
                name=f"n{nid:05d}",
                rack=f"r{i * racks // n_nodes:03d}",
                gpu_ids=tuple(i * cfg.gpus_per_node + g + 1 for g in range(sizes[i])),
                free=frozenset(self.free[i]),
            )
            for i, nid in enumerate(self.node_ids)
        ]
        self.nodes_dirty: set[int] = set()
        self.nodes_tuple = tuple(self.node_views)

        self._init_jobs(trace)
        self._init_teams()
        # Dynamic state
        self.queue: dict[int, JobView] = {}  # job id (index + 1) -> view, arrival order
        self.running: dict[int, _Run] = {}
        self.running_dirty = True
        self.running_tuple: tuple[RunningView, ...] = ()
        self.events: list[tuple[float, int, int, int, int]] = []  # t, seq, kind, job id, attempt
        self.checkpoints: list[tuple[float, int, int, int]] = []  # t, job id, attempt, number
        self.seq = 0
        self.busy = 0
        self.queued_gpus = 0
        self._init_accounting()

    def _init_jobs(self, trace: Sequence[TraceJob]) -> None:
        cfg = self.cfg
        # Jobs: the ones larger than the cluster are dropped; the rest in submit order.
        fits = [j for j in trace if j.gpus <= cfg.gpus]
        self.dropped = len(trace) - len(fits)
        self.jobs = sorted(fits, key=lambda j: j.submit_s)  # stable: trace order breaks ties
        n = len(self.jobs)
        rng = random.Random(cfg.seed)
        self.factor = [
            rng.lognormvariate(0.0, cfg.estimate_noise) if cfg.estimate_noise > 0 else 1.0
            for _ in range(n)
        ]
        self.remaining = [j.duration_s for j in self.jobs]
        self.first_start: list[float | None] = [None] * n
        self.finish: list[float | None] = [None] * n
        self.queued_since = [0.0] * n
        self.wait = [0.0] * n
        self.attempt = [0] * n
        self.preempted = [0] * n
        self.stopped_at: list[list[float]] = [[] for _ in range(n)]  # preemption stops per job
        self.reclaimed_at: list[float | None] = [None] * n
        self.filled_at: list[float] = [-INF] * n  # when a backfill claim last stopped it
        self.safety_stops: set[int] = set()  # jobs whose preemption the safety stop refused

    def _init_teams(self) -> None:
        cfg = self.cfg
        # Teams
        team_names = sorted({j.team for j in self.jobs})
        quotas = dict(cfg.quotas) if cfg.quotas else equal_quotas(team_names, cfg.gpus)
        for name in team_names:  # a team missing from --quotas gets nothing guaranteed
            quotas.setdefault(name, TeamQuota(quota=0, borrow_limit=cfg.gpus, weight=1.0))
        self.team_names = sorted(quotas)
        self.team_id = {name: i + 1 for i, name in enumerate(self.team_names)}
        self.quota = {self.team_id[n]: q for n, q in quotas.items()}
        self.used = dict.fromkeys(self.quota, 0)
        self.usage = dict.fromkeys(self.quota, 0.0)
        # Per team, its queued jobs in the policy's order: (-priority, submit, job id, GPUs).
        self.team_queue: dict[int, list[tuple[int, float, int, int]]] = {
            tid: [] for tid in self.quota
        }
        self.team_sizes: dict[int, dict[int, int]] = {tid: {} for tid in self.quota}
        self.job_team = [self.team_id[j.team] for j in self.jobs]
        self.clocks = ReclaimClocks(
            {tid: q.quota for tid, q in self.quota.items()},
            len(self.jobs),
            self.team_queue,
            self.team_sizes,
            grace_s=cfg.grace_s,
            gang_exempt_s=cfg.gang_reclaim_exempt_s,
            largest_node=max(self.node_sizes),
        )

    def _init_accounting(self) -> None:
        cfg = self.cfg
        # Accounting
        self.busy_gpu_s = 0.0
        self.backlog_s = 0.0
        self.backlog_busy_gpu_s = 0.0
        # While some queued job would fit the idle GPUs as they are (issue 4's "utilization
        # whenever work is queued that fits": a backlog of 64-GPU jobs waiting for whole
        # nodes leaves GPUs idle that nothing queued can use).
        self.fit_queued = False
        self.fit_s = 0.0
        self.fit_busy_gpu_s = 0.0
        # Why those GPUs sat idle: the wait reason (WaitReason.code) the last plan gave the
        # first queued job, in priority and submit order, whose shape fits them.
        self.fit_reason = ""
        self.idle_by_reason: dict[str, float] = {}  # code -> idle GPU-seconds
        self.last_waits: dict = {}  # the last plan's waits (job id -> WaitReason)
        self.lost_gpu_s = 0.0
        self.lost_by_kind: dict[str, float] = {}  # preemption kind -> GPU-seconds lost
        # proposed: in plans; duplicate: the victim already had an open request (or was gone);
        # withdrawn: the claimant no longer waited at approval; executed: stop begun;
        # stopped: victims requeued (the rest finished within their grace period).
        self.preemptions = dict.fromkeys(
            ("proposed", "duplicate", "refused", "withdrawn", "executed", "stopped"), 0
        )
        self.preemptions_by_kind: dict[str, int] = {}
        self.open_requests: dict[int, tuple[int, str]] = {}  # victim -> (claimant, kind)
        # claimant -> its victims told to stop; its JobView's claim_nodes are their nodes
        # until the pass after the last of them has gone (as the live snapshot's window).
        self.claims: dict[int, set[int]] = {}
        # Jobs that held nodes for jobs ending within the grace in the last pass (their
        # claim_nodes are those nodes, for the next pass only).
        self.ending_claims: set[int] = set()
        self.paused_until: dict[int, float] = {}  # team -> borrowing paused until
        self.rejected: list[str] = []
        self.missing_reasons = 0
        self.plan_calls = 0
        self.plan_time = 0.0
        self.plan_max = 0.0
        self.plan_max_queue = 0
        self.queue_max = 0
        self.series_t: list[float] = []
        self.series_busy: list[int] = []
        self.series_queued: list[int] = []
        self.promises = (
            PromiseBook(EPOCH, stop_grace_s=cfg.grace_s, approval_delay_s=cfg.approval_delay_s)
            if cfg.track_promises
            else None
        )

    # -- the loop ------------------------------------------------------------------------------

    def run(self) -> SimResult:
        wall = time.perf_counter()
        jobs, n, arr = self.jobs, len(self.jobs), 0
        t_prev = jobs[0].submit_s if jobs else 0.0
        t0 = t_prev
        next_report = wall + 10.0
        while True:
            if self.progress and time.perf_counter() > next_report:
                next_report = time.perf_counter() + 10.0
                self.progress(
                    {
                        "policy": self.name,
                        "t_days": round(t_prev / 86400, 2),
                        "arrived": arr,
                        "of": n,
                        "queued": len(self.queue),
                        "running": len(self.running),
                        "plan_calls": self.plan_calls,
                        "plan_s": round(self.plan_time, 1),
                        "wall_s": round(time.perf_counter() - wall, 1),
                    }
                )
            t_arr = jobs[arr].submit_s if arr < n else INF
            t_ev = self.events[0][0] if self.events else INF
            t = min(t_arr, t_ev)
            if t == INF:
                break
            self._advance(t_prev, t)
            t_prev = t
            while self.events and self.events[0][0] <= t:
                _, _, kind, jid, attempt = heapq.heappop(self.events)
                if kind == _COMPLETE:
                    self._complete(jid, attempt, t)
                elif kind == _STOP:
                    self._stop(jid, attempt, t)
                elif kind == _APPROVE:
                    self._approve(jid, attempt, t)
                # _WAKE: only makes the planner run (borrowing resumes)
            while arr < n and jobs[arr].submit_s <= t:
                self._enqueue(arr + 1, t)
                if self.promises:
                    self.promises.arrived(arr + 1)
                arr += 1
            if self.queue:
                self.clocks.tick(t, self.used, self.cfg.gpus - self.busy)
                self._plan(t)
            self.fit_queued = bool(self.queue) and queued_job_fits(self)
            self.fit_reason = fit_reason(self) if self.fit_queued else ""
            self._record(t)
        return self._result(t0, t_prev, time.perf_counter() - wall)

    def _advance(self, t0: float, t1: float) -> None:
        dt = t1 - t0
        if dt <= 0:
            return
        self.busy_gpu_s += self.busy * dt
        if self.queue:
            self.backlog_s += dt
            self.backlog_busy_gpu_s += self.busy * dt
            if self.fit_queued:
                self.fit_s += dt
                self.fit_busy_gpu_s += self.busy * dt
                idle = (self.cfg.gpus - self.busy) * dt
                self.idle_by_reason[self.fit_reason] = (
                    self.idle_by_reason.get(self.fit_reason, 0.0) + idle
                )
        # Exact exponential decay of GPU-seconds with GPUs in use constant over [t0, t1].
        h = self.cfg.usage_half_life_s
        decay = math.exp(-dt * math.log(2) / h)
        gain = (1.0 - decay) * h / math.log(2)
        for tid, used in self.used.items():
            self.usage[tid] = self.usage[tid] * decay + used * gain

    def _record(self, t: float) -> None:
        if len(self.queue) > self.queue_max:
            self.queue_max = len(self.queue)
        if self.series_t and self.series_t[-1] == t:
            self.series_busy[-1], self.series_queued[-1] = self.busy, len(self.queue)
            return
        self.series_t.append(t)
        self.series_busy.append(self.busy)
        self.series_queued.append(len(self.queue))

    # -- queue ---------------------------------------------------------------------------------

    def _enqueue(self, jid: int, t: float) -> None:
        i = jid - 1
        job = self.jobs[i]
        est = self.remaining[i] * self.factor[i]
        reclaimed = self.reclaimed_at[i]
        self.queue[jid] = JobView(
            id=jid,
            team_id=self.job_team[i],
            gpus=job.gpus,
            priority=job.priority,
            submitted_at=_at(job.submit_s),
            name=job.job_id,
            runtime_estimate_s=est,
            reclaimed_at=None if reclaimed is None else _at(reclaimed),
            min_run_s=min_run_s(
                self.cfg.checkpoint_interval_s, self.cfg.restart_s, self.cfg.preempt_exempt_s
            ),
            filled=self.filled_at[i] > t - 86400.0,
        )
        self.queued_since[i] = t
        self.queued_gpus += job.gpus
        tid = self.job_team[i]
        bisect.insort(self.team_queue[tid], (-job.priority, job.submit_s, jid, job.gpus))
        sizes = self.team_sizes[tid]
        sizes[job.gpus] = sizes.get(job.gpus, 0) + 1

    # -- planning ------------------------------------------------------------------------------

    def _snapshot(self, t: float) -> Snapshot:
        if self.nodes_dirty:
            for i in self.nodes_dirty:
                self.node_views[i] = replace(self.node_views[i], free=frozenset(self.free[i]))
            self.nodes_dirty.clear()
            self.nodes_tuple = tuple(self.node_views)
        self._due_checkpoints(t)
        if self.running_dirty:
            self.running_tuple = tuple(r.view for r in self.running.values())
            self.running_dirty = False
        teams = tuple(
            TeamView(
                id=tid,
                name=self.team_names[tid - 1],
                quota=q.quota,
                borrow_limit=q.borrow_limit,
                used=self.used[tid],
                weight=q.weight,
                usage_history=self.usage[tid],
                borrow_paused=self.paused_until.get(tid, -INF) > t,
            )
            for tid, q in self.quota.items()
        )
        return Snapshot(
            now=_at(t),
            nodes=self.nodes_tuple,
            queued=tuple(self.queue.values()),
            teams=teams,
            running=self.running_tuple,
            preempt_exempt_s=self.cfg.preempt_exempt_s,
            max_preemptions=self.cfg.safety_stop,
            gang_reclaim_exempt_s=self.cfg.gang_reclaim_exempt_s,
            aged_borrowed_first=self.cfg.aged_borrowed_first,
            quota_before_drain=self.cfg.quota_before_drain,
            wait_for_ending=self.cfg.wait_for_ending,
            stop_grace_s=self.cfg.grace_s,
        )

    def _due_checkpoints(self, t: float) -> None:
        interval = self.cfg.checkpoint_interval_s
        while self.checkpoints and self.checkpoints[0][0] <= t:
            _, jid, attempt, k = heapq.heappop(self.checkpoints)
            run = self.running.get(jid)
            if run is None or run.attempt != attempt:
                continue
            base = run.start + run.warmup
            while base + (k + 1) * interval <= t:  # several came due since the last pass
                k += 1
            run.view = replace(run.view, last_checkpoint_at=_at(base + k * interval))
            self.running_dirty = True
            nxt = base + (k + 1) * interval
            if nxt < run.end:
                heapq.heappush(self.checkpoints, (nxt, jid, attempt, k + 1))

    def _plan(self, t: float) -> None:
        snap = self._snapshot(t)
        began = time.perf_counter()
        plan = self.plan_fn(snap)
        took = time.perf_counter() - began
        self.plan_calls += 1
        self.plan_time += took
        if took > self.plan_max:
            self.plan_max, self.plan_max_queue = took, len(snap.queued)
        if len(snap.queued) - len(plan.placements) != len(plan.reasons):
            self.missing_reasons += 1
        self.last_waits = plan.waits
        for placement in plan.placements:
            self._start(placement, t)
        for proposal in plan.preemptions:
            self._preempt(proposal, t)
        self._expire_claims()
        self._hold_for_ends(plan.ending_holds)
        if self.promises:  # the live scheduler's estimate, from the snapshot it planned on
            for due in self.promises.after_pass(snap, self.queue, self.first_start, t):
                self._push(due, _WAKE, 0, 0)

    def _reject(self, why: str) -> None:
        self.rejected.append(why)

    def _start(self, placement, t: float) -> None:
        jid = placement.job_id
        view = self.queue.get(jid)
        if view is None:
            return self._reject(f"t={t:.0f}: job {jid} placed but not queued")
        if len(placement.slots) != view.gpus:
            return self._reject(f"t={t:.0f}: job {jid} needs {view.gpus} GPUs, got a partial gang")
        try:
            slots = [(self.node_index[s.node_id], s.index) for s in placement.slots]
        except KeyError:
            return self._reject(f"t={t:.0f}: job {jid} placed on an unknown node")
        if len(set(slots)) != len(slots) or any(g not in self.free[n] for n, g in slots):
            return self._reject(f"t={t:.0f}: job {jid} placed on GPUs that are not free")
        for n, g in slots:
            self.free[n].discard(g)
            self.nodes_dirty.add(n)
        i, tid = jid - 1, view.team_id
        del self.queue[jid]
        members = self.team_queue[tid]
        key = (-view.priority, self.jobs[i].submit_s, jid, view.gpus)
        del members[bisect.bisect_left(members, key)]
        sizes = self.team_sizes[tid]
        sizes[view.gpus] -= 1
        if not sizes[view.gpus]:
            del sizes[view.gpus]
        self.queued_gpus -= view.gpus
        self.busy += view.gpus
        self.used[tid] += view.gpus
        self.wait[i] += t - self.queued_since[i]
        if self.first_start[i] is None:
            self.first_start[i] = t
        self.clocks.started(jid, tid, t, self.used)
        self.clocks.gang_started(jid, tid, view.gpus, t)
        attempt = self.attempt[i]
        cfg = self.cfg
        warmup = cfg.restart_s if attempt > 0 else 0.0
        end = t + warmup + self.remaining[i]
        expected = t + warmup + self.remaining[i] * self.factor[i]
        protect = min_run_s(cfg.checkpoint_interval_s, cfg.restart_s, cfg.preempt_exempt_s)
        day_ago = t - 86400.0
        recent = sum(1 for s in self.stopped_at[i] if s > day_ago)
        self.running[jid] = _Run(
            start=t,
            end=end,
            slots=slots,
            attempt=attempt,
            expected=expected,
            warmup=warmup,
            view=RunningView(
                id=jid,
                team_id=tid,
                gpus=view.gpus,
                priority=view.priority,
                slots=tuple((self.node_ids[n], g) for n, g in slots),
                started_at=_at(t),
                expected_end=_at(expected),
                # Its estimate stands for its time limit (exact unless estimate_noise is set).
                frees_by=_at(expected),
                protected_until=_at(t + protect),
                restart_s=cfg.restart_s,
                preemptions=recent,
                filler=placement.filler,
            ),
        )
        self.running_dirty = True
        self._push(end, _COMPLETE, jid, attempt)
        if cfg.pass_at_protection_end:
            gang_end = t + cfg.gang_reclaim_exempt_s if jid in self.clocks.gangs else 0.0
            for until in (t + protect, gang_end):
                if t < until < end:
                    self._push(until, _WAKE, 0, 0)
        interval = cfg.checkpoint_interval_s
        if interval > 0 and t + warmup + interval < end:
            heapq.heappush(self.checkpoints, (t + warmup + interval, jid, attempt, 1))

    def _release(self, run: _Run, jid: int) -> None:
        for n, g in run.slots:
            self.free[n].add(g)
            self.nodes_dirty.add(n)
        gpus = len(run.slots)
        self.busy -= gpus
        self.used[run.view.team_id] -= gpus
        del self.running[jid]
        self.clocks.released(jid)
        self.running_dirty = True

    def _complete(self, jid: int, attempt: int, t: float) -> None:
        run = self.running.get(jid)
        if run is None or run.attempt != attempt:
            return
        self._release(run, jid)
        self.open_requests.pop(jid, None)
        self.remaining[jid - 1] = 0.0
        self.finish[jid - 1] = t

    def _push(self, t: float, kind: int, jid: int, attempt: int) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, jid, attempt))

    # -- results -------------------------------------------------------------------------------

    def _result(self, t0: float, t_end: float, wall: float) -> SimResult:
        return SimResult(
            policy=self.name,
            metrics=self.metrics(t0, t_end, wall),
            series=(self.series_t, self.series_busy, self.series_queued),
            waits=waits_by_class(self),
            records=[
                (
                    j.job_id,
                    j.submit_s,
                    j.gpus,
                    self.first_start[i],
                    self.finish[i],
                    self.preempted[i],
                )
                for i, j in enumerate(self.jobs)
            ],
            promises=self.promises.records([j.gpus for j in self.jobs], self.first_start)
            if self.promises
            else [],
        )

    def metrics(self, t0: float, t_end: float, wall: float) -> dict:
        """All numbers the CLI prints (jobs.scheduling.sim_metrics)."""
        return engine_metrics(self, t0, t_end, wall)


# ---------------------------------------------------------------------------------------------
# Entry points


def run(
    trace: Sequence[TraceJob],
    policy: str | PlanFn,
    config: SimConfig,
    progress: Callable[[dict], None] | None = None,
) -> SimResult:
    """Replay `trace` through one planner; `progress` gets a status dict every ~10 s."""
    name, fn = resolve_policy(policy)
    return _Engine(trace, fn, name, config, progress).run()


def simulate(
    trace: Sequence[TraceJob],
    policies: Iterable[str | PlanFn] = POLICIES,
    **config,
) -> dict[str, SimResult]:
    """Replay the same trace through several planners side by side (for benchmarks).

    >>> results = simulate(load_trace("trace.csv", limit=1000), ("fifo", "backfill"), gpus=64)
    >>> results["backfill"].metrics["wait_mean_s"]
    """
    cfg = SimConfig(**config)
    out = {}
    for policy in policies:
        result = run(trace, policy, cfg)
        out[result.policy] = result
    return out
