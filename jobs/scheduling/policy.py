"""The scheduling policy: a pure function from a Snapshot to a Plan.

Rules (DESIGN.md section 6):
1. Order: priority class; then guaranteed (the job fits within its team's quota) before
   borrowed; then the team's fair share (GPUs in use plus decayed history, per quota and
   weight); then submit time. Aging: a borrowed job that has waited more than
   max(30 min, 3 x its runtime estimate), or 4 h without one, goes first among the
   guaranteed work of its priority, so borrowed work too gets its turn at a reservation.
2. A team holds at most quota + borrow limit (quota only while its borrowing is paused after a
   reclaim). Idle GPUs are lent this way to teams with queued work.
3. Placement: a job that fits on one node goes on one node (best fit: the fullest node it fits
   on); a larger job takes whole nodes, racks with the most idle nodes first.
4. No starvation: the highest-ordered job that cannot fit reserves the nodes it will need;
   later jobs may use them only if their runtime estimate ends before those nodes free up
   (EASY backfill); elsewhere they start freely. A later job that would outlast them may
   still run there as a filler while they are expected to drain (of all but fillers) at
   least the least minimum run from now; the reservation's holder stops it
   (checkpoint-first) once the rest has drained and the filler's own minimum run is over,
   and a job is a filler at most once a day. Likewise inside a team: its first job blocked
   by the team's cap holds the team's next freed GPUs, and the team's later jobs start only
   if they end before then.
5. Reclaim: a guaranteed job that cannot fit takes back GPUs lent to other teams: victims on
   borrowed GPUs, lowest priority first, then those that did not just (re)start, then least
   work lost since their last checkpoint.
   Higher-priority jobs blocked by lower-priority ones get priority preemption proposals.
   The victims' GPUs go to their claimant: while they checkpoint it claims nothing more and
   their nodes are held for it; when they exit it is placed there before anyone else.
6. Elastic jobs (min_gpus below gpus) that cannot start at full size, and get no reclaim or
   priority preemption for it, start now on fewer GPUs where that fits: the largest divisor of
   their GPU count not below min_gpus (so the global batch splits evenly over the ranks; the
   trainer keeps it by gradient accumulation and resumes by resharding). A job within its
   team's quota reclaims for its full size instead.
7. Every job left queued gets a reason a person can read, and the same as data (a
   WaitReason: a code and its numbers).
8. Growing back: when every queued job has been placed and idle GPUs remain, a shrunk elastic
   job that has run `grow_after_s` at its smaller size, and whose full size fits on its own
   GPUs plus idle ones under its team's cap, is checkpointed and stopped; requeued, it starts
   again at full size (rule 3) and resumes resharded. Never while anyone waits: the idle GPUs
   are theirs first, and a grow would delay them by a restart.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime

from jobs.scheduling.claimants import honour_claims
from jobs.scheduling.ending import ending_runs, hold_for_ends, wait_for_ends
from jobs.scheduling.grow import grow_back
from jobs.scheduling.isolation import allowed
from jobs.scheduling.order import fifo_key, job_order_key, stretch
from jobs.scheduling.placement import (
    occupy,
    place,
    shrunk,
    to_slots,
)
from jobs.scheduling.protection import pays
from jobs.scheduling.reservations import Reservations, may_take, team_holds
from jobs.scheduling.snapshot import JobView, NodeView, RunningView, Snapshot, TeamView
from jobs.scheduling.victims import Victims
from jobs.scheduling.vocab import Placement, Plan, Preemption, PreemptionKind, WaitReason

# A job that has waited this many times its length may also stop running work for its
# GPUs (rule 4, a "starvation" claim): work of its own team beyond the team's quota, or
# borrowed work of a team whose fair share is at least its team's, never below either team's
# quota and never a job that ends before this one would. Only after every guaranteed claim
# of the pass, on what those left. Reservations alone left 8-32-GPU jobs of 10-20 minutes
# of the heaviest borrowers waiting 10-12 times their length on the msft trace at 1,280
# GPUs: the nodes that free first held jobs hours long.
STARVING_CLAIM_STRETCH = 6.0
# Victim searches for starvation claims per pass, the most starved first: each scans the
# running jobs, and a synthetic 10,000-job queue with half of it starving doubled the pass.
MAX_STARVATION_SEARCHES = 8


def plan(snapshot: Snapshot) -> Plan:
    """The policy: the rules above applied to one snapshot (pure, deterministic)."""
    return SchedulingPass(snapshot).run()


class SchedulingPass:
    """One pass of the policy over a snapshot. Its fields are what the pass has decided so
    far; its methods are the phases `run` goes through in order: claims already carried out
    (rule 5), then each queued job in rule 1's order (start, claim, shrink, reserve or wait),
    then starvation claims (rule 4), then growing back (rule 8)."""

    def __init__(self, snapshot: Snapshot):
        self.snapshot = snapshot
        self.now = snapshot.now
        self.nodes = [n for n in snapshot.nodes if n.schedulable]  # less those held for claims
        self.names = {n.id: n.name for n in self.nodes}
        self.capacity = sum(n.total for n in self.nodes)
        self.isolated_capacity = sum(n.total for n in self.nodes if n.isolated)
        self.largest = max((n.total for n in self.nodes), default=0)
        self.free = {n.id: sorted(n.free) for n in self.nodes}  # node id -> free GPU indices
        self.teams = {t.id: t for t in snapshot.teams}
        self.used = {t.id: t.used for t in snapshot.teams}  # team id -> GPUs, with placements
        self.placements: list[Placement] = []
        self.preemptions: list[Preemption] = []
        self.reasons: dict[int, str] = {}  # queued job id -> why it waits: its wait's text
        self.waits: dict[int, WaitReason] = {}
        self.ahead = 0  # queued jobs ordered before this one that are still waiting
        self.taken: set[int] = set()  # running jobs already chosen as victims this pass
        # team id -> GPUs its reclaims of this pass free
        self.claiming: dict[int, int] = defaultdict(int)
        # (team, GPUs, guaranteed, no reservation yet) of claims that found no victims
        self.claim_failed: set[tuple] = set()
        self.shrunk: dict[int, int] = {}  # elastic job id -> the smaller GPU count it starts on
        self.starving: list[tuple[JobView, TeamView]] = []  # blocked past STARVING_CLAIM_STRETCH
        self.guaranteed_waiting = False  # a job within its team's quota found no victims
        self.settled: set[int] = set()  # claimants placed or waiting on their claim
        self.head_borrowing = False  # the reservation's head job is beyond its team's quota
        self.head_team: int | None = None  # the team of the reservation's head job
        # GPUs of jobs already told to stop are as good as gone: a reclaim must not count them
        # again as the owner's lent GPUs (it would take the owner below its quota).
        lent: dict[int, int] = defaultdict(int)
        for run in snapshot.running:
            if run.stopping:
                lent[run.team_id] += run.gpus
        self.victims = Victims(
            teams=self.teams,
            used=self.used,
            free=self.free,
            running=[r for r in snapshot.running if not r.stopping],
            taken=self.taken,
            lent=lent,
            now=self.now,
            exempt_s=snapshot.preempt_exempt_s,
            max_preemptions=snapshot.max_preemptions,
            gang_exempt_s=snapshot.gang_reclaim_exempt_s,
            largest=self.largest,
        )
        # Per team, its running jobs in victim order, built once: the in-team priority search
        # runs for every job blocked by its team's cap (it was 56 % of a pass in the simulator).
        self.team_runs: dict[int, list[RunningView]] = defaultdict(list)
        for run in self.victims.running:
            self.team_runs[run.team_id].append(run)
        self.team_hold = team_holds(snapshot)
        # Teams with a queued job within their quota: a reclaim of theirs may come (protection
        # rule 2: a just-reclaimed job does not borrow again in front of them).
        self.guaranteed_teams = {
            j.team_id
            for j in snapshot.queued
            if j.team_id in self.teams
            and self.teams[j.team_id].used + j.gpus <= self.teams[j.team_id].quota
        }
        # Running jobs that free their GPUs within a stop's grace anyway (jobs.scheduling.ending).
        self.ending = ending_runs(snapshot) if snapshot.wait_for_ending else []
        self.ending_failed: set[tuple[int, int]] = set()  # (team, GPUs) with no room that way
        # job id -> (nodes held for ending jobs, its wait's deadline): its claim next pass
        self.ending_holds: dict[int, tuple[tuple[int, ...], datetime]] = {}
        # Built once the claims already carried out hold their nodes (`run`).
        self.reservations: Reservations

    def run(self) -> Plan:
        held = honour_claims(self)
        self.nodes = [n for n in self.nodes if n.id not in held]
        self.reservations = Reservations(
            self.snapshot, self.nodes, self.free, self.taken, self.largest
        )
        first = self.snapshot.aged_borrowed_first
        ordered = sorted(
            self.snapshot.queued, key=lambda j: job_order_key(j, self.teams, self.now, first)
        )
        for job in ordered:
            if job.id not in self.settled:
                self.consider(job)
        self.starvation_claims()
        placed = {p.job_id for p in self.placements}
        everyone_placed = all(job.id in placed for job in self.snapshot.queued)
        return Plan(
            placements=tuple(self.placements),
            reasons=self.reasons,
            waits=self.waits,
            reservation=self.reservations.holder,
            preemptions=tuple(self.preemptions),
            grows=tuple(grow_back(self)) if everyone_placed else (),
            order=tuple(job.id for job in ordered),
            ending_holds=self.ending_holds,
        )

    def wait(self, job: JobView, code: str, /, **data) -> None:
        """`job` stays queued for this reason; the jobs after it have one more ahead."""
        self.note(job, code, **data)
        self.ahead += 1

    def note(self, job: JobView, code: str, /, **data) -> None:
        """Why `job` waits (`WaitReason`), as data and as text."""
        reason = self.waits[job.id] = WaitReason(code, data)
        self.reasons[job.id] = reason.text()

    def stop_for(self, job: JobView, victims, kind, why: str, *, ahead: bool = True, **data):
        """Preempt `victims` for `job` (kind, and why, for each Preemption) and say so as the
        job's wait ("preempting"); `ahead`: the job counts as one more ahead of later jobs
        (`wait`), else its reason only changes (`note`)."""
        self.taken.update(v.id for v in victims)
        self.preemptions.extend(Preemption(v.id, job.id, kind, why) for v in victims)
        (self.wait if ahead else self.note)(
            job,
            "preempting",
            victims=tuple(v.id for v in victims),
            gpus=job.gpus,
            kind=kind,
            **data,
        )

    def consider(self, job: JobView) -> None:
        """One queued job in order: start it (perhaps smaller), or claim, reserve or wait."""
        team = self.teams.get(job.team_id)
        if team is None:
            self.wait(job, "no_team")
            return
        if self._behind_team_hold(job, team):
            return
        if self.used[team.id] + job.gpus > team.cap:
            self._over_cap(job, team)
            return
        if self._would_be_reclaimed(job, team):
            return
        # An elastic job may still start smaller on what is left (nodes down or cordoned).
        if min(job.min_gpus or job.gpus, job.gpus) > self.capacity:
            self.wait(job, "too_large", gpus=job.gpus, capacity=self.capacity)
            return
        if team.isolated_only and min(job.min_gpus or job.gpus, job.gpus) > self.isolated_capacity:
            self.wait(
                job, "isolation", team=team.name, gpus=job.gpus, capacity=self.isolated_capacity
            )
            return
        # EASY backfill: a job may use reserved nodes only if it is done before they free up.
        key, usable = self.reservations.usable_for(job, team)
        choice = self.reservations.place(job, key, usable)
        filler = False
        if choice is None and not key[0] and self._may_fill(job, team):
            filled = self.reservations.fill(job, team, key, usable)
            if filled is not None:
                choice, filler = filled
        if choice is None and not key[0] and self.snapshot.quota_before_drain:
            choice = self._before_the_drain(job, team, usable)
        if choice is None:
            choice = self._blocked(job, team, key, usable)
        if choice is not None:
            occupy(self.free, choice)
            self.reservations.placed()
            self.used[team.id] += self.shrunk.get(job.id, job.gpus)
            self.placements.append(Placement(job.id, job.team_id, to_slots(choice), filler))

    def _before_the_drain(self, job: JobView, team: TeamView, usable: list[NodeView]):
        """QUOTA_BEFORE_DRAIN: a borrowing head's reservation does not keep another team from
        its quota. A job within its team's quota may start on the free GPUs of the nodes the
        head is draining where the nodes outside would not do (its reclaims may take GPUs
        there too, `_claim`). Without it, such jobs waited behind the borrower's drain while
        GPUs they were promised stood free: the largest cause of reclaim waits past their bound
        on the generated traces (docs/thrash.md). The head is owed nothing: it waits, or
        reserves again next pass, and starvation claims still bound its wait. Off by default:
        the drain takes longer and utilization falls (docs/scheduling.md, rule 1)."""
        if not self.head_borrowing or team.id == self.head_team:
            return None
        if self.used[team.id] + self.claiming[team.id] + job.gpus > team.quota:
            return None
        draining = allowed(team, self._head_nodes_beyond(usable))
        if not draining:
            return None
        return place(job, self.free, usable + draining, self.largest)

    def _head_nodes_beyond(self, nodes: list[NodeView]) -> list[NodeView]:
        """The head's reserved (draining) nodes that are not among `nodes`."""
        outside = {n.id for n in nodes}
        return [
            n for n in self.nodes if n.id in self.reservations.head_nodes and n.id not in outside
        ]

    def _may_fill(self, job: JobView, team: TeamView) -> bool:
        """A job may fill the head's draining nodes only if the head may stop it then
        (`reservations.may_take`): a borrowing head takes no other team's guaranteed work."""
        if self.head_team is None:
            return True
        return may_take(
            self.head_team, self.head_borrowing, team.id, self.used[team.id], team.quota
        )

    def _behind_team_hold(self, job: JobView, team: TeamView) -> bool:
        """Rule 4 inside a team: behind the team's first job blocked by its cap, a job waits
        unless it ends before that job's GPUs free up (`team_holds`)."""
        hold = self.team_hold.get(team.id)
        if hold is None or fifo_key(job) <= hold[2]:
            return False
        held_by, team_shadow, _ = hold
        if (
            team_shadow is not None
            and job.runtime_estimate_s is not None
            and self.now.timestamp() + job.runtime_estimate_s <= team_shadow
        ):
            return False
        self.wait(job, "team_queue", job=held_by, team=team.name, cap=team.cap, until=team_shadow)
        return True

    def _would_be_reclaimed(self, job: JobView, team: TeamView) -> bool:
        """Protection rule 2: a job a reclaim stopped less than `reclaim_hold_s` ago does not
        borrow again while a guaranteed job of another team waits: that team's reclaim would
        take it back at once (on a 1,024-GPU trace such restarts were what made a 256-GPU
        job start and stop every few minutes)."""
        if job.reclaimed_at is None or self.used[team.id] + job.gpus <= team.quota:
            return False
        if (self.now - job.reclaimed_at).total_seconds() >= self.snapshot.reclaim_hold_s:
            return False
        waiting = sorted(
            self.teams[t].name for t in self.guaranteed_teams if t != team.id and t in self.teams
        )
        if not waiting:
            return False
        self.wait(job, "reclaim_risk", team=team.name, quota=team.quota, teams=tuple(waiting))
        return True

    def _over_cap(self, job: JobView, team: TeamView) -> None:
        """Rule 2: the team is at its cap. While no reservation is held, its own lower-priority
        jobs may make room (a priority proposal); else the job waits."""
        own = [
            r
            for r in self.team_runs.get(team.id, ())
            if r.priority < job.priority
            and r.id not in self.taken
            and not self.victims.protected(r)
        ]
        over = self.used[team.id] + job.gpus - team.cap

        def enough(chosen) -> bool:
            return sum(v.gpus for v in chosen) >= over

        # Its own jobs that end within the grace anyway make room before any is stopped.
        if (
            own
            and self.reservations.holder is None
            and hold_for_ends(
                self,
                job,
                team,
                [r for r in self.ending if r.team_id == team.id and r.id not in self.taken],
                enough,
            )
        ):
            return
        found = (
            self.victims.find(
                job,
                own,
                allowed(team, self.nodes),
                lambda victim, chosen: True,
                enough=enough,
            )
            if self.reservations.holder is None and own
            else None
        )
        if found is not None and not pays(job.gpus, found[0], self.now):
            found = None
        if found is None:
            self.wait(
                job,
                "team_limit",
                team=team.name,
                used=self.used[team.id],
                cap=team.cap,
                quota=team.quota,
                borrow_limit=team.borrow_limit,
                paused=team.borrow_paused,
                gpus=job.gpus,
            )
            return
        victims, choice = found
        self.reservations.reserve(job.id, (node.id for node, _ in choice), drains=False)
        self.stop_for(
            job,
            victims,
            PreemptionKind.PRIORITY,
            f"priority over lower-priority work of team {team.name}",
            same_team=True,
        )

    def _blocked(self, job: JobView, team: TeamView, key: tuple, usable):
        """Rules 4-6 for a job that does not fit now: a reclaim or priority claim; else, if
        elastic, a smaller size that fits (returned: its placement); else the reservation, a
        starving job's own, or a reason to wait (None)."""
        free_now = self.reservations.free_in(key, usable)
        # Within its team's quota counting the team's other claims of this pass: each such
        # job may reclaim in the same pass (on nodes no earlier claim reserved), so a team's
        # reclaim takes one stop grace, not one grace per queued job. A priority preemption or
        # a plain reservation stays one per pass.
        guaranteed = self.used[team.id] + self.claiming[team.id] + job.gpus <= team.quota
        if wait_for_ends(self, job, team, guaranteed):
            return None
        claimed = self._claim(job, team, guaranteed)
        if claimed is None:
            self.guaranteed_waiting |= guaranteed
            elastic = shrunk(job, self.free, usable, self.largest)
            if elastic is not None:
                size, choice = elastic
                self.shrunk[job.id] = size
                return choice
        if claimed is not None:
            self._preempt(job, team, claimed)
        elif self.reservations.holder is None:
            self._reserve(job, free_now)
        else:
            self._hold_or_wait(job, free_now)
        if claimed is None and stretch(job, self.now) >= STARVING_CLAIM_STRETCH:
            self.starving.append((job, team))
        return None

    def _claim(self, job: JobView, team: TeamView, guaranteed: bool):
        """Victims for a blocked job (`Victims.claim`) on nodes no earlier claim reserved:
        a reclaim while guaranteed, a priority preemption while no reservation is held."""
        holder = self.reservations.holder
        # A claim that failed fails again for the same team and size later in the pass:
        # victims and lendable GPUs only shrink within a pass.
        attempt = (team.id, job.gpus, guaranteed, holder is None)
        if not (holder is None or guaranteed) or attempt in self.claim_failed:
            return None
        claimed = self.victims.claim(
            job,
            team,
            allowed(team, self.reservations.claimable),
            guaranteed=guaranteed,
            allow_priority=holder is None,
        )
        if claimed is None and guaranteed and self.head_borrowing:
            # A borrowing head's reservation does not keep a team from its quota: its nodes
            # run lent GPUs a reclaim must take back (with quarter- and half-cluster borrowers
            # at the head, reclaims otherwise waited hours on generated traces). Only where
            # the nodes outside the reservation would not do.
            claimable = self.reservations.claimable
            claimed = self.victims.claim(
                job,
                team,
                allowed(team, claimable + self._head_nodes_beyond(claimable)),
                guaranteed=True,
                allow_priority=False,
            )
        if claimed is None:
            self.claim_failed.add(attempt)
        return claimed

    def _preempt(self, job: JobView, team: TeamView, claimed) -> None:
        """Stop the claim's victims. They keep their GPUs (and count against their teams)
        until they exit; the claimant is placed by a later pass, on the nodes reserved now."""
        victims, choice, kind = claimed
        if kind == PreemptionKind.RECLAIM:
            self.claiming[team.id] += job.gpus
        why = (
            "reclaiming its team's quota"
            if kind == PreemptionKind.RECLAIM
            else f"priority {job.priority} over lower-priority work"
        )
        self.stop_for(
            job, victims, kind, f"{why} for job {job.id}", same_team=False, priority=job.priority
        )
        self.reservations.reserve(job.id, (node.id for node, _ in choice))
        # The free GPUs of its placement are the claimant's from now on. The reservation
        # admits later jobs that end before its nodes drain, and a claim's node drains of its
        # other jobs long after the victims stop: a later job of this pass took the free GPU
        # a 2-GPU reclaim needed beside its victim's, and the claimant, short when the victim
        # exited, claimed again (a second grace: 94 s on msft at 1,280 GPUs, 2026-12-06).
        # Later passes hold the claim's nodes whole (JobView.claim_nodes).
        occupy(self.free, choice)
        self.reservations.placed()

    def _reserve(self, job: JobView, free_now: int) -> None:
        """The first blocked job holds the reservation."""
        team = self.teams[job.team_id]
        self.head_borrowing = self.used[team.id] + job.gpus > team.quota
        self.head_team = team.id
        self.reservations.reserve_head(job, team, borrowing=self.head_borrowing)
        fillers = self.reservations.fillers_to_stop(job)
        if fillers:
            self.stop_for(
                job,
                fillers,
                PreemptionKind.BACKFILL,
                f"job {job.id}'s reserved nodes have drained",
                same_team=False,
                priority=job.priority,
            )
            return
        reserved = sorted(self.reservations.reserved, key=self.names.get)
        self.wait(
            job,
            "reserved",
            gpus=job.gpus,
            free=free_now,
            nodes=tuple(self.names[i] for i in reserved),
            ahead=self.ahead,
        )

    def _hold_or_wait(self, job: JobView, free_now: int) -> None:
        """Behind the reservation: a starving job may hold one of its own; others wait."""
        holder = self.reservations.holder
        hold = self.reservations.hold_for_starving(job, self.teams[job.team_id])
        if hold is not None:
            self.wait(
                job,
                "reserved_starving",
                gpus=job.gpus,
                stretch=stretch(job, self.now),
                nodes=tuple(self.names[i] for i in sorted(hold, key=self.names.get)),
                beside=holder[0],
                ahead=self.ahead,
            )
            return
        self.wait(
            job,
            "behind_reservation",
            gpus=job.gpus,
            free=free_now,
            job=holder[0],
            others=bool(self.reservations.starving),
            ahead=self.ahead,
        )

    def starvation_claims(self) -> None:
        """Rule 4's starvation claims come last: a guaranteed job's reclaim must not find its
        victims taken or their nodes reserved by a borrower (that ran reclaim clocks past the
        bound in the simulator)."""
        reservations = self.reservations
        holder = reservations.holder
        searches = 0
        refused: dict[tuple[int, bool], int] = {}  # (team id, head) -> smallest job refused
        for job, team in self.starving:
            head = holder is not None and holder[0] == job.id
            # Victims and free GPUs only shrink within a pass: a larger job of the team fails
            # too.
            if job.gpus >= refused.get((team.id, head), 1 << 30):
                continue
            if searches == MAX_STARVATION_SEARCHES:
                break
            searches += 1
            claimed = None
            # Outside the head's reservation first; the head itself, failing that, on its own
            # reserved nodes (where it would otherwise wait for them to drain), unless a
            # guaranteed job waits: reclaims may not stop jobs there, so the head would take
            # the victims a reclaim could not (a reclaim clock past its bound).
            own = (
                [n for n in self.nodes if n.id in reservations.head_nodes]
                if head and not self.guaranteed_waiting
                else []
            )
            for claim_nodes in (reservations.claimable, own):
                if claimed is None and claim_nodes:
                    claimed = self.victims.starvation(job, team, allowed(team, claim_nodes))
            if claimed is None:
                refused[(team.id, head)] = job.gpus
                continue
            victims, choice = claimed
            reservations.claimed(node.id for node, _ in choice)
            waited = f"{stretch(job, self.now):.0f} times its length"
            self.stop_for(
                job,
                victims,
                PreemptionKind.STARVATION,
                f"job {job.id} has waited {waited}",
                ahead=False,
                stretch=stretch(job, self.now),
            )
