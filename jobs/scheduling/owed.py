"""Which queued jobs their team's quota owes GPUs to, and for how long (DESIGN 6.4: "the time
from 'team asks for its quota' to 'its job runs' is bounded and measured"). Pure.

A job's clock starts when it is queued, some team holds GPUs beyond its quota, and its own
team's quota has room for it, counted greedily in the team's priority and submit order: GPUs
in use, plus the team's queued jobs ahead of it that fit, plus its own must stay within the
quota. It runs while the job is queued and fits that room (also once nobody borrows: the job
may still wait for the GPUs to come back in its shape), and stops when the job starts or the
room no longer holds it. The live scheduler keeps these clocks (`OwedClocks`, each pass) and
says when one runs past the reclaim bound; the simulator counts the same way
(sim_reclaims.py). A team at its whole quota has no room: its clocks stop. Unlike a
preemption request's `reclaim_s`, which starts at the request, this clock also runs for a job
that waits with no request at all (behind another job's reservation, say), where a team's
quota is as late.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime

from jobs.scheduling.order import fifo_key
from jobs.scheduling.protection import reclaim_exempt
from jobs.scheduling.snapshot import Snapshot


def fitting(room: int, jobs: Iterable[tuple[int, int]], smallest: int = 1) -> list[int]:
    """The ids of `jobs` ((id, GPUs) in the team's order) that fit `room` GPUs, taken greedily:
    a job that does not fit is passed over and later smaller ones may still fit. `smallest`,
    the fewest GPUs any of them asks, ends the walk once the room is below it."""
    taken = []
    for job_id, gpus in jobs:
        if room < smallest:
            break
        if gpus <= room:
            room -= gpus
            taken.append(job_id)
    return taken


def lending(snapshot: Snapshot) -> bool:
    """Some team holds GPUs beyond its quota: GPUs are lent, and clocks may start."""
    return any(team.used > team.quota for team in snapshot.teams)


def owed_jobs(snapshot: Snapshot) -> dict[int, int]:
    """Queued job id -> its team id, for each job its team's quota has room for now (whether
    or not anyone borrows: `lending` says when a clock may start)."""
    by_team: dict[int, list] = {}
    for job in snapshot.queued:
        by_team.setdefault(job.team_id, []).append(job)
    owed = {}
    for team in snapshot.teams:
        jobs = sorted(by_team.get(team.id, ()), key=fifo_key)
        if not jobs or team.used >= team.quota:
            continue
        smallest = min(job.gpus for job in jobs)
        for job_id in fitting(team.quota - team.used, ((j.id, j.gpus) for j in jobs), smallest):
            owed[job_id] = team.id
    return owed


def drained_for_gangs(snapshot: Snapshot) -> int:
    """Running gangs that protection rule 5 keeps from reclaims now: while one holds lent
    GPUs, a team's quota may come back only when its exemption ends (plus the grace)."""
    teams = {team.id: team for team in snapshot.teams}
    largest = max((node.total for node in snapshot.nodes), default=0)
    return sum(
        1
        for run in snapshot.running
        if run.team_id in teams
        and reclaim_exempt(
            run, teams[run.team_id].quota, largest, snapshot.now, snapshot.gang_reclaim_exempt_s
        )
    )


@dataclass
class Overdue:
    job_id: int
    team_id: int
    since: datetime
    ended: datetime | None = None  # None: still owed


@dataclass
class OwedClocks:
    """The live clocks of one leadership term: when each owed job was first seen owed, and
    which have run past `bound_s`. A new term starts them afresh (a job still owed is seen
    again at its first pass)."""

    bound_s: float
    since: dict[int, tuple[int, datetime]] = field(default_factory=dict)  # job -> team, since
    overdue: set[int] = field(default_factory=set)

    def adopt(self, overdue: list[Overdue]) -> None:
        """A new term takes over the clocks the last one left overdue (their alerts are out,
        their ends not): the first pass continues or ends them, without a second alert."""
        for o in overdue:
            self.since[o.job_id] = (o.team_id, o.since)
            self.overdue.add(o.job_id)

    def update(
        self, owed: dict[int, int], now: datetime, *, lent: bool = True
    ) -> tuple[list[Overdue], list[Overdue]]:
        """One pass's jobs within their team's room (`owed_jobs`, those the pass started left
        out), and whether GPUs are `lent` (`lending`): clocks start only then. Returns the
        clocks that ran past the bound at this pass, and the overdue ones that ended (the job
        started, left the queue, or its team's own work took the room)."""
        if lent:
            for job_id, team_id in owed.items():
                self.since.setdefault(job_id, (team_id, now))
        ended = []
        for job_id in [j for j in self.since if j not in owed]:
            team_id, since = self.since.pop(job_id)
            # Overdue, or past the bound at the pass that ends it (no alert went out for it).
            if job_id in self.overdue or (now - since).total_seconds() > self.bound_s:
                self.overdue.discard(job_id)
                ended.append(Overdue(job_id, team_id, since, now))
        newly = [
            Overdue(job_id, team_id, since)
            for job_id, (team_id, since) in self.since.items()
            if job_id not in self.overdue and (now - since).total_seconds() > self.bound_s
        ]
        self.overdue.update(o.job_id for o in newly)
        return newly, ended
