"""The simulator's reclaim clocks: how long a team under its quota waits for the GPUs it lent
(DESIGN 6.4: "the time from 'team asks for its quota' to 'its job runs' is bounded and
measured"), and the bound each wait is held to.

A job's clock runs while it is queued, its team's quota has room for it, and the team has not
got its quota back:

- it starts at an event at which some team holds GPUs beyond its quota and the job fits the
  team's room, counted greedily in the policy's order (priority, then submit time): GPUs in use,
  plus the team's queued jobs ahead of it that fit, plus its own must stay within the quota
  (`owed.fitting`, as the live scheduler's clocks count);
- it stops when the job starts; when its team holds its whole quota again, whichever of the
  team's jobs took the GPUs back (the promise is the team's quota, not a start for each job);
  or when the job no longer fits the team's room because the team's own work took it (its
  other jobs started, or one of its own went ahead of it). In the last two cases the job then
  waits behind its own team's work, which no reclaim is owed for; its clock starts again if
  room opens while another team borrows. (A 64-GPU job's clock once ran 42,475 s while its
  team went from 8 to 112 of its 128 GPUs on its smaller jobs: bench/reclaim_replay.py.)

Each clock is held to the bound that protection rule 5 promises (jobs.scheduling.protection):
the stop grace, or, when the GPUs that could be reclaimed for it at its start were too few
without those of drained-for gangs (gangs of whole nodes beyond their team's quota, younger
than `gang_exempt_s`), the grace plus the time until the last of those gangs' exemptions ends.
What a reclaim could take is counted as the policy's reclaim does (victims.Victims.claim):
free GPUs, and per other team beyond its quota the most of its jobs that are not exempt gangs a
reclaim could take whole, each while the team is still beyond its quota (a reclaim takes wholly
borrowed jobs, or, when those will not do, one that straddles the quota: a team 2 GPUs over
with 8-GPU jobs lends an 8-GPU job). Before the evening of 2026-12-06 only the GPUs beyond the
quota counted, which found too few to take and held some clocks to the looser bound
(docs/thrash.md).
"""

from __future__ import annotations

from collections.abc import Mapping

from jobs.scheduling.owed import fitting


class ReclaimClocks:
    """Reclaim clocks of one simulated run. The engine tells it what happens (a job queued,
    started or censored, a gang started or released) and lets it look at its team queues (per
    team, queued jobs as (-priority, submit, job id, GPUs), sorted) and their sizes."""

    def __init__(
        self,
        quota: Mapping[int, int],
        n_jobs: int,
        team_queue: Mapping[int, list[tuple[int, float, int, int]]],
        team_sizes: Mapping[int, Mapping[int, int]],
        *,
        grace_s: float,
        gang_exempt_s: float,
        largest_node: int,
    ):
        self.quota = dict(quota)
        self.team_queue, self.team_sizes = team_queue, team_sizes
        self.grace_s, self.gang_exempt_s, self.largest_node = grace_s, gang_exempt_s, largest_node
        self.start: list[float | None] = [None] * n_jobs
        self.bound: list[float] = [grace_s] * n_jobs  # of the open clock
        self.open: dict[int, set[int]] = {tid: set() for tid in self.quota}
        # per team, each closed clock: (length, its bound)
        self.closed: dict[int, list[tuple[float, float]]] = {tid: [] for tid in self.quota}
        # running gangs under rule 5's exemption: job id -> exempt until
        self.gangs: dict[int, float] = {}
        # every running job: job id -> (team, GPUs)
        self.running: dict[int, tuple[int, int]] = {}

    # -- what the engine tells it --------------------------------------------------------------

    def gang_started(self, jid: int, tid: int, gpus: int, t: float) -> None:
        """A job started: remember it, and whether rule 5 exempts it (protection.reclaim_exempt)."""
        self.running[jid] = (tid, gpus)
        if self.gang_exempt_s > 0 and gpus > self.quota[tid] and gpus > self.largest_node:
            self.gangs[jid] = t + self.gang_exempt_s

    def released(self, jid: int) -> None:
        self.gangs.pop(jid, None)
        self.running.pop(jid, None)

    def started(self, jid: int, tid: int, t: float, used: Mapping[int, int]) -> None:
        """`jid` of team `tid` started at `t` (`used`: GPUs in use per team, with it)."""
        if jid in self.open[tid]:
            self._close(jid, tid, t)
        if used[tid] >= self.quota[tid]:
            for other in list(self.open[tid]):  # the team holds its whole quota again
                self._close(other, tid, t)
        elif self.open[tid]:
            self._team_tick(tid, t, used, lending=False, free=0)

    def tick(self, t: float, used: Mapping[int, int], free: int) -> None:
        """Before each plan: start the clocks of jobs the quotas have room for while some team
        borrows, and stop those whose room the team's own work took."""
        lending = any(used[tid] > q for tid, q in self.quota.items())
        for tid, members in self.team_queue.items():
            if self.open[tid] or (lending and len(members) > len(self.open[tid])):
                self._team_tick(tid, t, used, lending, free)

    def censor(self, t_end: float) -> None:
        """The run ended: clocks still open count until `t_end`."""
        for tid, jids in self.open.items():
            for jid in list(jids):
                self._close(jid, tid, t_end)

    # -- measures ------------------------------------------------------------------------------

    def lengths(self) -> dict[int, list[float]]:
        return {tid: [length for length, _ in clocks] for tid, clocks in self.closed.items()}

    def over_their_bound(self) -> int:
        return sum(1 for cs in self.closed.values() for length, b in cs if length > b + 1e-6)

    def gang_bounded(self) -> int:
        """Clocks held to rule 5's longer bound."""
        return sum(1 for cs in self.closed.values() for _, b in cs if b > self.grace_s + 1e-6)

    # -- inside --------------------------------------------------------------------------------

    def _team_tick(
        self, tid: int, t: float, used: Mapping[int, int], lending: bool, free: int
    ) -> None:
        members, open_ = self.team_queue[tid], self.open[tid]
        room = self.quota[tid] - used[tid]
        fits: set[int] = set()
        if room > 0 and members:
            smallest = min(self.team_sizes[tid])
            fits = set(fitting(room, ((jid, gpus) for _, _, jid, gpus in members), smallest))
            if lending:
                for _, _, jid, gpus in members:
                    if jid in fits and jid not in open_:
                        self.start[jid - 1] = t
                        self.bound[jid - 1] = self._bound_for(tid, gpus, t, used, free)
                        open_.add(jid)
        for jid in open_ - fits:
            self._close(jid, tid, t)

    def _close(self, jid: int, tid: int, t: float) -> None:
        started = self.start[jid - 1]
        self.closed[tid].append((t - started, self.bound[jid - 1]))
        self.start[jid - 1] = None
        self.open[tid].discard(jid)

    def _bound_for(self, tid: int, gpus: int, t: float, used: Mapping[int, int], free: int):
        """The grace, unless a reclaim could not find `gpus` without exempt gangs' GPUs."""
        live = {jid: until for jid, until in self.gangs.items() if until > t}
        if not live or free + self._takable(tid, used, set(live)) >= gpus:
            return self.grace_s
        return self.grace_s + min(self.gang_exempt_s, max(live.values()) - t)

    def _takable(self, tid: int, used: Mapping[int, int], exempt: set[int]) -> int:
        """GPUs a reclaim for team `tid` could stop elsewhere, at most: per other team beyond
        its quota, its jobs that are not `exempt`, each taken while the team is still beyond
        its quota (victims.Victims.claim), so the last may straddle it. The most is the
        team's largest job taken last, after the largest sum of its other jobs that stays
        below what it holds beyond its quota."""
        sizes: dict[int, list[int]] = {}
        for jid, (owner, g) in self.running.items():
            if owner != tid and jid not in exempt:
                sizes.setdefault(owner, []).append(g)
        takable = 0
        for owner, jobs in sizes.items():
            spare = used[owner] - self.quota[owner]
            if spare <= 0:
                continue
            jobs.sort()
            last = jobs.pop()
            # Bit k set: some of the other jobs sum to k GPUs (k < spare).
            sums, below = 1, (1 << spare) - 1
            for g in jobs:
                sums = (sums | (sums << g)) & below
            takable += last + sums.bit_length() - 1
        return takable
