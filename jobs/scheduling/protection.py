"""What keeps preemption from thrashing (issue 17): a started job's minimum run, the weighing of
a preemption's gain against the work it costs, and the safety stop. Pure.

Without them a 256-GPU high-priority job on a 1,024-GPU trace was started and stopped about
every 7 minutes for 12 hours: each pass found the just-restarted job the cheapest victim
(little work at risk), and a claim made piecemeal over many passes stopped the same small jobs
again and again as they restarted elsewhere.

1. Minimum run. A job that starts (or restarts) is protected until it has paid its start-up
   and made progress past its next checkpoint: start-up cost plus one checkpoint interval,
   never less than the `preempt_exempt_s` floor (Slurm's PreemptExemptTime, KAI's
   minruntime). Priority and starvation claims never take a protected job. Reclaims may, but
   only when no unprotected victim will do: a team's quota comes back within its bound
   (DESIGN 6.4), and what a borrower risks is known when it borrows.
2. No restart into a reclaim. A job a reclaim stopped within its protection window does not
   start again on borrowed GPUs while a guaranteed job of another team waits: the same rule
   would take it back at once (`policy.SchedulingPass`).
3. Weighing. A priority or starvation claim is made only if the GPU-seconds of waiting it
   saves its claimant exceed the GPU-seconds it throws away: the victims' work since their
   last checkpoint plus their restart cost. A claimant saves at most until its victims would
   have ended anyway; a victim's own wait after the stop is the claimant's run, which is
   what the priority (or the starvation rule) buys, so it is not counted twice.
4. Safety stop. A job stopped by `Snapshot.max_preemptions` preemptions within a day is not
   chosen again; the scheduler raises an admin alert (jobs.actions.preemption) instead of
   looping, and the simulator counts it.
5. Drained-for gangs. A gang of whole nodes larger than its team's quota runs only on lent
   GPUs, and only after the cluster held nodes idle for it (its reservation drained them). A
   reclaim does not take it until it has run `Snapshot.gang_reclaim_exempt_s` (4 h): taken
   sooner, it queued, drained half the cluster again and was taken again. On generated traces
   at 1,024 GPUs, where such gangs carry 44 % of the work, each half-cluster job was reclaimed
   5-8 times and the drains left 30,000 GPU-hours idle (docs/thrash.md). Its lenders'
   quota comes back within that time plus the stop grace: the bound of a reclaim is
   `grace + gang_reclaim_exempt_s` for GPUs lent to such a gang, the grace for all others.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta

from jobs.scheduling.snapshot import RunningView

# The restart cost assumed for a job that never started before: pulling its image, the
# rendezvous, loading its checkpoint. Measured per job once it has run (jobs.queries).
DEFAULT_RESTART_S = 120.0


def min_run_s(checkpoint_interval_s: float | None, restart_s: float, floor_s: float) -> float:
    """How long a started attempt is protected: its start-up plus one checkpoint interval
    (it has then saved at least once), never below `floor_s`. A job that never checkpoints
    gets the floor: protecting it longer saves none of its work."""
    if not checkpoint_interval_s or checkpoint_interval_s <= 0:
        return max(floor_s, restart_s)
    return max(floor_s, restart_s + checkpoint_interval_s)


def protected_until(run: RunningView, floor_s: float) -> datetime:
    """The end of `run`'s minimum run (the floor applies when the reader gave none)."""
    floor = run.started_at + timedelta(seconds=floor_s)
    return max(run.protected_until, floor) if run.protected_until else floor


def is_protected(run: RunningView, now: datetime, floor_s: float) -> bool:
    return now < protected_until(run, floor_s)


def reclaim_exempt(run: RunningView, quota: int, largest: int, now: datetime, exempt_s: float):
    """Rule 5: `run` is a gang of whole nodes (more GPUs than the `largest` node) beyond its
    team's `quota` that started less than `exempt_s` ago: no reclaim takes it yet."""
    if exempt_s <= 0 or run.gpus <= quota or run.gpus <= largest:
        return False
    return (now - run.started_at).total_seconds() < exempt_s


def at_safety_stop(run: RunningView, limit: int) -> bool:
    return limit > 0 and run.preemptions >= limit


def work_at_risk_s(run: RunningView, now: datetime) -> float:
    """Seconds of work a stop now would throw away: since the last checkpoint, or since this
    attempt started if it resumed from an older one (nothing before the resume is at risk)."""
    since = max(run.last_checkpoint_at or run.started_at, run.started_at)
    return max(0.0, (now - since).total_seconds())


def stop_cost(victims: Iterable[RunningView], now: datetime) -> float:
    """GPU-seconds a stop of `victims` throws away: work since their checkpoints, restarts."""
    return sum(v.gpus * (work_at_risk_s(v, now) + v.restart_s) for v in victims)


def wait_saved(gpus: int, victims: Iterable[RunningView], now: datetime) -> float:
    """GPU-seconds of waiting a claim of `gpus` saves: without it the claimant waits for its
    victims to end (the last of them; unknown ends count as never)."""
    ends = [v.expected_end for v in victims]
    if any(end is None for end in ends):
        return float("inf")
    latest = max((end for end in ends if end is not None), default=now)
    return gpus * max(0.0, (latest - now).total_seconds())


def pays(gpus: int, victims: list[RunningView], now: datetime) -> bool:
    """Whether a claim of `gpus` for `victims` gains more than it costs (rule 3 above)."""
    return wait_saved(gpus, victims, now) > stop_cost(victims, now)
