"""How far a run is and when it will end at its own pace.

A script that says how many steps the whole run takes (the reference trainer's `--steps`, or
`trainer.api.set_total_steps(n)` in a user's script) gets a projected end: the steps left at
the pace its live attempt has kept since its first step, measured on the portal's clock
(first and latest step records as ingested, jobs/actions/ingest.py). Determined shows a run's
progress the same way; Slurm knows only time limits.

The projection is advice: start estimates (jobs/scheduling/estimate.py) let a running job end
at it instead of after an assumed hour, and the job page, API and CLI show it. The policy
itself still plans with time limits only, as EASY backfill does: a projection can be wrong
(a slower phase, a long evaluation), a time limit is enforced.

Pure: it reads attributes of an attempt (or anything shaped like one) and imports no Django.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

# A pace measured over less than this is mostly the first step's compile and warm-up, and the
# heartbeat that carried it: no projection yet.
MIN_PACE_S = 10.0


@dataclass(frozen=True)
class Pace:
    step: int  # the latest step reported
    total_steps: int
    steps_per_s: float
    projected_end: datetime  # when the last step is expected, at this pace

    @property
    def fraction(self) -> float:
        return fraction(self.step, self.total_steps)


def fraction(step: int, total_steps: int) -> float:
    """How much of the run is done, 0 to 1."""
    return min(step / total_steps, 1.0) if total_steps else 1.0


def pace(attempt, *, min_pace_s: float = MIN_PACE_S) -> Pace | None:
    """The attempt's pace and projected end, or None: the script gave no total, or the
    attempt has not stepped long enough to tell a pace. Only a live attempt's pace means
    anything; callers pass the live one."""
    total = attempt.total_steps
    first, first_at = attempt.first_step, attempt.first_step_at
    last, last_at = attempt.last_step, attempt.last_progress_at
    if not total or first is None or first_at is None or last_at is None:
        return None
    elapsed = (last_at - first_at).total_seconds()
    rate = (last - first) / elapsed if elapsed >= min_pace_s and last > first else None
    if last >= total:  # the last step is done: it ends as soon as it saves and exits
        return Pace(last, total, rate or 0.0, last_at)
    if rate is None:
        return None
    return Pace(last, total, rate, last_at + timedelta(seconds=(total - last) / rate))
