"""The simulator engine's preemption handlers (jobs.scheduling.simulate): a proposal carried out
at once or after its approval delay, the victim told to checkpoint and stop with a grace, its
stop (the work it saves or loses, its requeue), and the claims its claimant holds meanwhile
(and those of jobs waiting for ending jobs, WAIT_FOR_ENDING_JOBS). A mixin of the engine: the
handlers work on the engine's state (`running`, `queue`, `open_requests`, `claims`,
`preemptions`, the accounting of lost work) and its event queue (`_push`), as its other
handlers do."""

from __future__ import annotations

import math
from dataclasses import replace

from jobs.scheduling.sim_config import SimulationError, _at
from jobs.scheduling.vocab import AUTOMATIC_KINDS, PreemptionKind

# The kinds of the engine's events (its heap orders events by time, then by when pushed).
_COMPLETE, _STOP, _APPROVE, _WAKE = 0, 1, 2, 3


class Stops:
    def _preempt(self, proposal, t: float) -> None:
        """As the live system: one open request per victim; reclaims and starvation claims are
        carried out at once, priority preemptions when their approval deadline passes (no
        admin in a simulation)."""
        self.preemptions["proposed"] += 1
        jid = proposal.victim_job_id
        run = self.running.get(jid)
        if run is None or jid in self.open_requests:
            self.preemptions["duplicate"] += 1
            return
        if run.view.preemptions >= self.cfg.safety_stop > 0:
            # As the live action: refused, and an admin alert (counted) instead of a loop.
            self.preemptions["refused"] += 1
            self.safety_stops.add(jid)
            return
        kind = proposal.kind
        self.preemptions_by_kind[kind] = self.preemptions_by_kind.get(kind, 0) + 1
        self.open_requests[jid] = (proposal.claimant_job_id, kind)
        if kind in AUTOMATIC_KINDS or self.cfg.approval_delay_s <= 0:
            self._execute(jid, t)
        else:
            self._push(t + self.cfg.approval_delay_s, _APPROVE, jid, run.attempt)

    def _approve(self, jid: int, attempt: int, t: float) -> None:
        run = self.running.get(jid)
        if run is None or run.attempt != attempt or jid not in self.open_requests:
            self.open_requests.pop(jid, None)
            return
        if self.open_requests[jid][0] not in self.queue:
            self.preemptions["withdrawn"] += 1
            del self.open_requests[jid]
            return
        self._execute(jid, t)

    def _execute(self, jid: int, t: float) -> None:
        """Checkpoint-and-stop with a grace deadline; the victim's team stops borrowing."""
        run = self.running[jid]
        _, kind = self.open_requests[jid]
        self.preemptions["executed"] += 1
        if kind == PreemptionKind.RECLAIM and self.cfg.reclaim_backoff_s > 0:
            self.paused_until[run.view.team_id] = t + self.cfg.reclaim_backoff_s
            self._push(t + self.cfg.reclaim_backoff_s, _WAKE, 0, 0)
        stop = t + self.cfg.grace_s
        run.stopping_at = stop
        claimant = self.open_requests[jid][0]
        run.view = replace(
            run.view,
            stopping=True,
            expected_end=_at(min(run.expected, stop)),
            frees_by=_at(min(run.expected, stop)),
            claimant_id=claimant,
        )
        view = self.queue.get(claimant)
        if view is not None:
            nodes = tuple(dict.fromkeys((*view.claim_nodes, *(n for n, _ in run.view.slots))))
            self.queue[claimant] = replace(view, claim_nodes=nodes)
            self.claims.setdefault(claimant, set()).add(jid)
        self.running_dirty = True
        self._push(stop, _STOP, jid, run.attempt)

    def _stop(self, jid: int, attempt: int, t: float) -> None:
        run = self.running.get(jid)
        if run is None or run.attempt != attempt:
            return  # it finished during its grace period
        i = jid - 1
        interval = self.cfg.checkpoint_interval_s
        ran = t - run.start
        worked = max(0.0, ran - run.warmup)  # the restart cost redoes no work
        if self.cfg.checkpoint_on_stop:
            saved = worked
        elif interval > 0:
            # float times: a save at t counts
            saved = math.floor(worked / interval + 1e-9) * interval
        else:
            saved = 0.0
        saved = min(saved, self.remaining[i])
        lost = len(run.slots) * (ran - saved)
        self.lost_gpu_s += lost
        kind = str(self.open_requests.get(jid, (None, "unknown"))[1])
        self.lost_by_kind[kind] = self.lost_by_kind.get(kind, 0.0) + lost
        self.remaining[i] -= saved
        self.attempt[i] += 1
        self.preempted[i] += 1
        self.stopped_at[i].append(t)
        if self.open_requests.get(jid, (None, None))[1] == PreemptionKind.RECLAIM:
            self.reclaimed_at[i] = t
        if self.open_requests.get(jid, (None, None))[1] == PreemptionKind.BACKFILL:
            self.filled_at[i] = t
        if self.preempted[i] >= self.cfg.max_preemptions:
            raise SimulationError(
                f"job {self.jobs[i].job_id} preempted {self.preempted[i]} times by t={t:.0f}: "
                f"the policy {self.name!r} is in a preemption loop"
            )
        self.preemptions["stopped"] += 1
        self.open_requests.pop(jid, None)
        self._release(run, jid)
        self._enqueue(jid, t)

    def _expire_claims(self) -> None:
        """A claim ends when its claimant starts, or after the first pass that saw all of its
        victims gone (that pass offered the claimant their GPUs first)."""
        for claimant, victims in list(self.claims.items()):
            view = self.queue.get(claimant)
            if view is None:
                del self.claims[claimant]
                continue
            if any(
                (run := self.running.get(v)) is not None and run.view.claimant_id == claimant
                for v in victims
            ):
                continue
            self.queue[claimant] = replace(view, claim_nodes=())
            del self.claims[claimant]

    def _hold_for_ends(self, holds: dict) -> None:
        """Jobs waiting for jobs that end within the grace anyway (rule 5, ending.py) claim
        the nodes they held in the last pass, with their first wait's deadline, as the live
        reader gives them from their stored wait: the pass after those jobs have ended offers
        them their GPUs first."""
        for claimant in list(self.ending_claims):
            view = self.queue.get(claimant)
            if claimant not in holds and view is not None:
                real = claimant in self.claims  # a claim of victims keeps its nodes
                self.queue[claimant] = replace(
                    view, claim_nodes=view.claim_nodes if real else (), ending_by=None
                )
            self.ending_claims.discard(claimant)
        for claimant, (nodes, by) in holds.items():
            view = self.queue.get(claimant)
            if view is not None:
                self.queue[claimant] = replace(view, claim_nodes=nodes, ending_by=by)
                self.ending_claims.add(claimant)
