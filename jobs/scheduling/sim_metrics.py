"""The simulator's measurements: every number `lockstep simulate` prints, computed from a
finished engine's state (jobs.scheduling.simulate). Definitions are in docs/simulator.md.
`self` is the engine: these were its methods, and read its fields only."""

from __future__ import annotations

import math
from collections.abc import Sequence

from jobs.scheduling.trace import SIZE_CLASSES, size_class


def engine_metrics(self, t0: float, t_end: float, wall: float) -> dict:
    """All numbers the CLI prints; see docs/simulator.md for the definitions."""
    cfg = self.cfg
    makespan = max(0.0, t_end - t0)
    jcts, waits, ftfs = [], [], []
    by_class: dict[str, tuple[list[float], list[float]]] = {c: ([], []) for c in SIZE_CLASSES}
    by_team: dict[int, list[float]] = {tid: [] for tid in self.quota}
    team_waits: dict[int, list[float]] = {tid: [] for tid in self.quota}
    starved = never_started = unfinished = 0
    self.clocks.censor(t_end)  # clocks still open count until the end of the run
    reclaims = self.clocks.lengths()
    for i, job in enumerate(self.jobs):
        tid = self.job_team[i]
        if self.first_start[i] is None:
            never_started += 1
        if self.finish[i] is None:
            unfinished += 1
            starved += 1
            continue
        jct = self.finish[i] - job.submit_s
        wait = self.wait[i]
        if wait > cfg.starve_factor * job.duration_s:
            starved += 1
        share = self.quota[tid].quota
        if share > 0:  # a team with no quota has no fair share to compare against
            ideal = max(1.0, job.duration_s * max(1.0, job.gpus / share))
            ftfs.append(jct / ideal)
            by_team[tid].append(jct / ideal)
        jcts.append(jct)
        waits.append(wait)
        team_waits[tid].append(wait)
        by_class[size_class(job.gpus)][0].append(wait)
        by_class[size_class(job.gpus)][1].append(jct)
    all_reclaims = [r for rs in reclaims.values() for r in rs]
    teams = _team_metrics(self, team_waits, by_team, reclaims)
    gpus = cfg.gpus
    out = {
        "policy": self.name,
        "gpus": gpus,
        "nodes": len(self.node_ids),
        "jobs": len(self.jobs),
        "dropped": self.dropped,
        "completed": len(jcts),
        "makespan_s": _r(makespan),
        "utilization": _r(self.busy_gpu_s / (gpus * makespan) if makespan else 0.0, 4),
        "utilization_when_backlogged": _r(
            self.backlog_busy_gpu_s / (gpus * self.backlog_s) if self.backlog_s else 0.0, 4
        ),
        "backlogged_fraction": _r(self.backlog_s / makespan if makespan else 0.0, 4),
        "utilization_when_fit_queued": _r(
            self.fit_busy_gpu_s / (gpus * self.fit_s) if self.fit_s else 0.0, 4
        ),
        "fit_queued_fraction": _r(self.fit_s / makespan if makespan else 0.0, 4),
        "idle_gpu_hours_while_fit_queued": _r((gpus * self.fit_s - self.fit_busy_gpu_s) / 3600),
        "idle_gpu_hours_while_fit_queued_by_reason": {
            code: _r(s / 3600)
            for code, s in sorted(self.idle_by_reason.items(), key=lambda kv: -kv[1])
        },
        # The trace's work over the GPU time until the last job ended: what "utilization"
        # would be if no GPU-second went to work a preemption threw away or to restarts.
        "work_utilization": _r(
            sum(j.gpus * j.duration_s for j in self.jobs) / (gpus * makespan)
            if makespan and unfinished == 0
            else 0.0,
            4,
        ),
        "busy_gpu_hours": _r(self.busy_gpu_s / 3600),
        "jct_mean_s": _r(_mean(jcts)),
        "jct_median_s": _r(_pct(jcts, 50)),
        "jct_p99_s": _r(_pct(jcts, 99)),
        "wait_mean_s": _r(_mean(waits)),
        "wait_median_s": _r(_pct(waits, 50)),
        "wait_p99_s": _r(_pct(waits, 99)),
        "by_size": {
            c: {
                "jobs": len(w),
                "wait_mean_s": _r(_mean(w)),
                "wait_p99_s": _r(_pct(w, 99)),
                "jct_mean_s": _r(_mean(j)),
                "jct_p99_s": _r(_pct(j, 99)),
            }
            for c, (w, j) in by_class.items()
        },
        "ftf_max": _r(max(ftfs, default=0.0), 3),
        "ftf_p99": _r(_pct(ftfs, 99), 3),
        "ftf_mean": _r(_mean(ftfs), 3),
        "reclaim_max_s": _r(max(all_reclaims, default=0.0)),
        "reclaim_p99_s": _r(_pct(all_reclaims, 99)),
        # DESIGN's promise for a quota reclaim: the victims' stop grace plus one pass (a
        # pass happens at every event here, so it adds nothing).
        "reclaim_bound_s": cfg.grace_s,
        "reclaims_over_bound": sum(1 for r in all_reclaims if r > cfg.grace_s + 1e-6),
        # GPUs lent to a young gang beyond its team's quota come back by the end of its
        # exemption (protection rule 5): each clock is held to the grace, or where a reclaim
        # could not find its GPUs but in such gangs, to the end of their exemptions plus the
        # grace (jobs.scheduling.sim_reclaims); clocks held to the longer bound, and clocks
        # past their own bound.
        "reclaim_bound_gang_s": cfg.grace_s + cfg.gang_reclaim_exempt_s,
        "reclaims_gang_bounded": self.clocks.gang_bounded(),
        "reclaims_over_their_bound": self.clocks.over_their_bound(),
        "reclaims_total": len(all_reclaims),
        "preempted_gpu_hours": _r(self.lost_gpu_s / 3600),
        "preempted_gpu_hours_by_kind": {k: _r(v / 3600) for k, v in self.lost_by_kind.items()},
        "preemptions_per_job": _preemptions_per_job(self),
        "safety_stops": len(self.safety_stops),
        "preemptions": {**self.preemptions, "by_kind": dict(self.preemptions_by_kind)},
        "starved": starved,
        "never_started": never_started,
        "unfinished": unfinished,
        "teams": teams,
        "rejected_placements": len(self.rejected),
        "rejected_examples": self.rejected[:5],
        "plans_missing_reasons": self.missing_reasons,
        "queue_max_jobs": self.queue_max,
        "plan_calls": self.plan_calls,
        "plan_time_s": _r(self.plan_time, 3),
        "plan_mean_ms": _r(1000 * self.plan_time / self.plan_calls if self.plan_calls else 0, 3),
        "plan_max_s": _r(self.plan_max, 4),
        "plan_max_queue": self.plan_max_queue,
        "wall_s": _r(wall, 2),
        "config": _config_metrics(self),
    }
    if self.promises is not None:  # SimConfig.track_promises (jobs.scheduling.promises)
        out["estimates"] = self.promises.summary([j.gpus for j in self.jobs], self.first_start)
    return out


# While the engine runs: whether the idle GPUs would fit a queued job, and what kept them idle.


def queued_job_fits(self) -> bool:
    """Would some queued job's shape fit the idle GPUs now (ignoring team caps and
    reservations)? One node's worth or less: the freest node; more: whole idle nodes."""
    if self.busy >= self.cfg.gpus:
        return False
    gpn = self.cfg.gpus_per_node
    sizes = [g for team_sizes in self.team_sizes.values() for g in team_sizes]
    small = min((g for g in sizes if g <= gpn), default=None)
    large = min((g for g in sizes if g > gpn), default=None)
    if (
        small is not None
        and small <= self.cfg.gpus - self.busy
        and _fits(self, small, max(len(f) for f in self.free), 0)
    ):
        return True
    return large is not None and _fits(self, large, 0, _idle_nodes(self))


def _idle_nodes(self) -> int:
    return sum(1 for f, size in zip(self.free, self.node_sizes, strict=True) if len(f) == size)


def _fits(self, gpus: int, most_free: int, idle_nodes: int) -> bool:
    """A job of `gpus` fits the idle GPUs: one node's worth or less on the freest node
    (`most_free` GPUs), more on whole idle nodes."""
    gpn = self.cfg.gpus_per_node
    return gpus <= most_free if gpus <= gpn else idle_nodes * gpn >= gpus


def fit_reason(self) -> str:
    """The wait reason of the first queued job (priority, then submit time) whose shape
    fits the idle GPUs, as `queued_job_fits` counts them: what kept them idle."""
    most_free, idle_nodes = max(len(f) for f in self.free), _idle_nodes(self)
    first = None
    for members in self.team_queue.values():  # each in (-priority, submit, id, GPUs) order
        member = next((m for m in members if _fits(self, m[3], most_free, idle_nodes)), None)
        if member is not None and (first is None or member < first):
            first = member
    if first is None:
        return "none"
    reason = self.last_waits.get(first[2])
    if reason is None:  # a baseline (no reasons as data) or queued since the last pass
        return "unexplained"
    if reason.code == "team_limit" and reason.data.get("paused"):
        return "team_limit_paused"
    return reason.code


def waits_by_class(self) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {c: [] for c in SIZE_CLASSES}
    for i, job in enumerate(self.jobs):
        if self.finish[i] is not None:
            out[size_class(job.gpus)].append(self.wait[i])
    return out


def _preemptions_per_job(self) -> dict:
    """How often one job was stopped: the thrash measure (issue 17)."""
    counts = sorted(self.preempted)
    hit = [c for c in counts if c]
    return {
        "max": counts[-1] if counts else 0,
        "p99": _r(pct_sorted(counts, 99), 2),
        "jobs_preempted": len(hit),
        "mean_of_preempted": _r(_mean(hit), 2),
        # Within any one day: what the safety stop bounds (SimConfig.safety_stop).
        "max_in_a_day": max((_most_in_a_day(times) for times in self.stopped_at), default=0),
    }


def _most_in_a_day(times: list[float]) -> int:
    """The most of `times` (ascending) within any 24 hours."""
    most, first = 0, 0
    for last, t in enumerate(times):
        while t - times[first] >= 86400.0:
            first += 1
        most = max(most, last - first + 1)
    return most


def _config_metrics(self) -> dict:
    cfg = self.cfg
    return {
        "gpus_per_node": cfg.gpus_per_node,
        "checkpoint_interval_s": cfg.checkpoint_interval_s,
        "grace_s": cfg.grace_s,
        "checkpoint_on_stop": cfg.checkpoint_on_stop,
        "approval_delay_s": cfg.approval_delay_s,
        "reclaim_backoff_s": cfg.reclaim_backoff_s,
        "estimate_noise": cfg.estimate_noise,
        "starve_factor": cfg.starve_factor,
        "restart_s": cfg.restart_s,
        "preempt_exempt_s": cfg.preempt_exempt_s,
        "safety_stop": cfg.safety_stop,
        "gang_reclaim_exempt_s": cfg.gang_reclaim_exempt_s,
        "pass_at_protection_end": cfg.pass_at_protection_end,
        "aged_borrowed_first": cfg.aged_borrowed_first,
        "quota_before_drain": cfg.quota_before_drain,
        "wait_for_ending": cfg.wait_for_ending,
        "usage_half_life_s": cfg.usage_half_life_s,
    }


def _team_metrics(self, team_waits, by_team, reclaims) -> dict[str, dict]:
    """Per team: its jobs, waits, finish-time fairness and reclaim times."""
    teams = {}
    for tid, q in self.quota.items():
        team_jobs = sum(1 for x in self.job_team if x == tid)
        if not team_jobs:
            continue
        teams[self.team_names[tid - 1]] = {
            "jobs": team_jobs,
            "quota": q.quota,
            "completed": len(team_waits[tid]),
            "wait_mean_s": _r(_mean(team_waits[tid])),
            "wait_median_s": _r(_pct(team_waits[tid], 50)),
            "wait_p99_s": _r(_pct(team_waits[tid], 99)),
            "wait_max_s": _r(max(team_waits[tid], default=0.0)),
            "ftf_max": _r(max(by_team[tid], default=0.0)),
            "reclaim_max_s": _r(max(reclaims[tid], default=0.0)),
            "reclaim_median_s": _r(_pct(reclaims[tid], 50)),
            "reclaim_p99_s": _r(_pct(reclaims[tid], 99)),
            "reclaims": len(reclaims[tid]),
        }
    return teams


def _r(x: float, digits: int = 1) -> float:
    return x if math.isinf(x) else round(x, digits)


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _pct(xs: Sequence[float], q: float) -> float:
    """Percentile with linear interpolation between closest ranks (numpy's default)."""
    return pct_sorted(sorted(xs), q)


def pct_sorted(s: Sequence[float], q: float) -> float:
    if not s:
        return 0.0
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)
