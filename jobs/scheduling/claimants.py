"""Rule 5 carried through, the first phase of a pass: a claimant gets the GPUs its victims free
(placed there first once they exit; while they checkpoint, the GPUs it needs beside theirs are
held from everyone else). Functions of the pass: `self` is the `policy.SchedulingPass` (not
imported: the policy imports this module)."""

from __future__ import annotations

from collections import defaultdict

from jobs.scheduling.ending import consume, say_ending, within_its_deadline
from jobs.scheduling.isolation import allowed
from jobs.scheduling.order import job_order_key
from jobs.scheduling.placement import occupy, place_on_claim, to_slots, whole_nodes
from jobs.scheduling.snapshot import RunningView
from jobs.scheduling.vocab import Placement


def honour_claims(self) -> set[int]:
    """Rule 5 carried through: a claimant gets the GPUs its victims free. Returns the node
    ids held for claimants this pass.

    Before the main pass, in the usual order, each queued job with a claim (`claim_nodes`)
    that fits under its team's cap is placed on its claimed nodes if it fits there now. If
    it does not yet, and some of its victims are still checkpointing, it waits for them: it
    claims nothing more (without this each pass stopped yet another victim for the same
    job) the free GPUs it needs beyond what its victims will free are held from everyone
    else for this pass (for a whole-node job: its claimed nodes and the idle nodes it needs
    beyond them). A claim whose victims are all gone and that still does not fit is spent:
    the job goes through the main pass like any other."""
    held: set[int] = set()
    pending: dict[int, list[RunningView]] = defaultdict(list)
    for run in self.snapshot.running:
        if run.stopping and run.claimant_id is not None:
            pending[run.claimant_id].append(run)
    by_id = {n.id: n for n in self.nodes}
    # Those whose victims are all gone first: the GPUs just freed are theirs, not those of a
    # claimant whose own victims on the same node are still stopping.
    claimants = sorted(
        (j for j in self.snapshot.queued if j.claim_nodes),
        key=lambda j: (
            j.id in pending,
            job_order_key(j, self.teams, self.now, self.snapshot.aged_borrowed_first),
        ),
    )
    for job in claimants:
        team = self.teams.get(job.team_id)
        victims = pending.get(job.id, [])
        # A priority claim inside the team: its victims' GPUs still count against the team
        # until they exit, and then make the room under its cap.
        leaving = sum(v.gpus for v in victims if v.team_id == job.team_id)
        if team is None:
            continue
        # The borrowing pause after a reclaim does not apply: it keeps a team from taking
        # more of others' GPUs, while these are GPUs another job was already stopped for.
        # Its team's later jobs may have filled its quota in the meantime (on the msft trace
        # at 4,096 GPUs and 3.5 times the load, reclaims waited out the pause: 240 s, not
        # 60).
        cap = team.quota + team.borrow_limit
        if self.used[team.id] - leaving + job.gpus > cap:
            continue
        claimed = [by_id[i] for i in dict.fromkeys(job.claim_nodes) if i in by_id]
        claimed = allowed(team, [n for n in claimed if n.id not in held])
        fits_cap = self.used[team.id] + job.gpus <= cap
        choice = (
            place_on_claim(job, self.free, claimed, allowed(team, self.nodes), self.largest)
            if claimed and fits_cap
            else None
        )
        if choice is not None:
            occupy(self.free, choice)
            self.used[team.id] += job.gpus
            self.placements.append(Placement(job.id, job.team_id, to_slots(choice)))
            self.settled.add(job.id)
            continue
        if not victims and claimed and _wait_for_ending(self, job, team, claimed, held):
            continue
        if not victims or not claimed:
            continue
        hold = _hold_for_claimant(self, job, team, victims, claimed, held)
        self.settled.add(job.id)
        if self.used[team.id] + self.claiming[team.id] + job.gpus <= team.quota:
            self.claiming[team.id] += job.gpus
        self.note(
            job,
            "stopping",
            victims=tuple(sorted(v.id for v in victims)),
            gpus=job.gpus,
            nodes=tuple(sorted(self.names[i] for i in hold)),
        )
    return held


def _hold_for_claimant(self, job, team, victims, claimed, held: set[int]) -> set[int]:
    """What a claimant waiting for its victims keeps from everyone else: on one node, the
    claimed node closest to fitting keeps back only the free GPUs the job needs beyond its
    victims' there (the rest of the node stays usable); whole nodes, its victims' and the
    idle ones it needs beyond them, added to `held`. Returns the nodes it holds."""
    if job.gpus <= self.largest:
        stopping: dict[int, int] = defaultdict(int)
        for victim in victims:
            for node_id, _ in victim.slots:
                stopping[node_id] += 1
        node = max(claimed, key=lambda n: (len(self.free[n.id]) + stopping[n.id], n.name))
        keep = max(0, job.gpus - stopping[node.id])
        self.free[node.id] = self.free[node.id][keep:]
        return {node.id}
    hold = {n.id for n in claimed}
    need = job.gpus - sum(n.total for n in claimed)
    if need > 0:
        rest = [n for n in allowed(team, self.nodes) if n.id not in held | hold]
        hold.update(node.id for node, _ in whole_nodes(need, self.free, rest) or ())
    held |= hold
    return hold


def _wait_for_ending(self, job, team, claimed, held: set[int]) -> bool:
    """A job that held nodes for jobs ending within the grace anyway (ending.py) and that
    still waits for them keeps holding what it needs beside them, as a claimant waiting for
    its victims: between passes, a job ordered before it took the free GPUs next to an ending
    job, and it had to reclaim after all. True if it waits (its hold carried to the next
    pass)."""
    on_claim = {n.id for n in claimed}
    ending = within_its_deadline(
        job,
        [
            r
            for r in self.ending
            if r.id not in self.taken and not on_claim.isdisjoint(n for n, _ in r.slots)
        ],
    )
    usable = allowed(team, [n for n in self.nodes if n.id not in held])
    found = ending and self.victims.find(job, ending, usable, lambda run, chosen: True)
    if not found:
        return False
    # Only those it needs: another job waiting on the same node may be waiting for the others
    # (taking them all made it reclaim after all: 90 s on msft at 1,280 GPUs, 2026-12-07).
    ending = found[0]
    hold = _hold_for_claimant(self, job, team, ending, claimed, held)
    consume(self, [r.id for r in ending])
    self.settled.add(job.id)
    if self.used[team.id] + self.claiming[team.id] + job.gpus <= team.quota:
        self.claiming[team.id] += job.gpus
    names = tuple(sorted(self.names[i] for i in hold))
    say_ending(self, job, ending, names, tuple(job.claim_nodes), self.note)
    return True
