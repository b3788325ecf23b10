"""Rule 5's cheaper way to make room: jobs that end within a stop's grace anyway are waited for,
not stopped. A claim waits the grace for its victims in any case, and each stop costs its
victim a restart (about 85 % of the policy's stops were reclaims, docs/thrash.md). Functions
of the pass: `self` is the `policy.SchedulingPass` (not imported: the policy imports this
module), as in claimants.py."""

from __future__ import annotations

from collections.abc import Callable

from jobs.scheduling.isolation import allowed
from jobs.scheduling.placement import occupy
from jobs.scheduling.snapshot import JobView, RunningView, Snapshot, TeamView


def ending_runs(snapshot: Snapshot) -> list[RunningView]:
    """The running jobs whose GPUs are free within one stop grace without anyone stopping them
    (`RunningView.frees_by`: a time limit plus its stop's grace, or a stop deadline), soonest
    first. Not one stopping for another claimant (its GPUs are that claimant's), and not one
    whose time is already past (a late exit report: waiting again would have no bound)."""
    now = snapshot.now.timestamp()
    horizon = now + snapshot.stop_grace_s
    return sorted(
        (
            r
            for r in snapshot.running
            if r.frees_by is not None
            and now < r.frees_by.timestamp() <= horizon
            and r.claimant_id is None
        ),
        key=lambda r: r.frees_by,
    )


def wait_for_ends(self, job: JobView, team: TeamView, guaranteed: bool) -> bool:
    """A job that could claim (within its quota, or any while no reservation is held) and
    whose room jobs ending anyway would make waits for them and holds their nodes, as a claim
    would, instead of stopping anyone. True if it waits."""
    if not self.ending or not (self.reservations.holder is None or guaranteed):
        return False
    # As for claims: the ending jobs and the nodes left to claim only shrink in a pass, so a
    # size that found no room for a team finds none later (a 10,000-job pass asks often).
    attempt = (team.id, job.gpus)
    if attempt in self.ending_failed:
        return False
    if not hold_for_ends(self, job, team, [r for r in self.ending if r.id not in self.taken]):
        self.ending_failed.add(attempt)
        return False
    if guaranteed:
        self.claiming[team.id] += job.gpus  # as a reclaim of the pass counts
    return True


def hold_for_ends(
    self,
    job: JobView,
    team: TeamView,
    ending: list[RunningView],
    enough: Callable[[list[RunningView]], bool] | None = None,
) -> bool:
    """If `ending` make room for `job` on the nodes no claim of this pass holds (and
    `enough(chosen)`, where given: a team at its cap needs its own GPUs back), hold those nodes
    for it and say so ("ending"). True if it does."""
    ending = within_its_deadline(job, ending)
    if not ending:
        return False
    found = self.victims.find(
        job,
        ending,
        allowed(team, self.reservations.claimable),
        lambda run, chosen: True,
        enough=enough,
    )
    if found is None:
        return False
    chosen, choice = found
    nodes = [node.id for node, _ in choice]
    self.reservations.reserve(job.id, nodes)
    occupy(self.free, choice)  # the free GPUs beside theirs are its own from now on
    self.reservations.placed()
    consume(self, [r.id for r in chosen])
    say_ending(self, job, chosen, tuple(self.names[n] for n in nodes), tuple(nodes), self.wait)
    return True


def within_its_deadline(job: JobView, ending: list[RunningView]) -> list[RunningView]:
    """Of `ending`, those that end by the job's first wait's deadline (`JobView.ending_by`),
    if it is waiting already: a job whose first ending jobs' GPUs went elsewhere must not wait
    for later ones one grace after another (chained waits ran to 90 s on msft at 1,280 GPUs;
    it reclaims instead)."""
    if job.ending_by is None:
        return ending
    return [r for r in ending if r.frees_by <= job.ending_by]


def consume(self, ids) -> None:
    """The ending jobs `ids` are one waiting job's: no other job of the pass counts on them (a
    gang's GPUs on other nodes included) or takes them as victims (their GPUs are that job's,
    as a victim's are its claimant's); reservations count them gone, as they soon are."""
    gone = set(ids)
    self.ending = [r for r in self.ending if r.id not in gone]
    self.taken.update(gone)


def say_ending(self, job: JobView, chosen, names, node_ids, say) -> None:
    """Record the job's wait for `chosen` (`say`: the pass's wait or note) and carry its hold
    of `node_ids` to the next pass, with its first such wait's deadline. Once they have ended,
    that pass offers it their GPUs before anyone (claimants.py): a job ordered before it took
    them otherwise, and it reclaimed after all, a second grace (msft at 1,280 GPUs: 101
    reclaims past the 60 s bound, up to 140 s, 2026-12-07)."""
    until = max(r.frees_by for r in chosen)
    by = job.ending_by or until
    say(
        job,
        "ending",
        ending=tuple(r.id for r in chosen),
        gpus=job.gpus,
        until=until.timestamp(),
        by=by.timestamp(),
        nodes=names,
        node_ids=node_ids,
    )
    self.ending_holds[job.id] = (node_ids, by)
