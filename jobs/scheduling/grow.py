"""Scheduling rule 8, growing back: once every queued job is placed, a shrunk elastic job
returns to its full size on its own GPUs plus idle ones. Run last in a pass (`self` is the
jobs.scheduling.policy.SchedulingPass, whose free GPUs and team usage it updates)."""

from __future__ import annotations

from jobs.scheduling.isolation import allowed
from jobs.scheduling.placement import occupy, place, release
from jobs.scheduling.vocab import Grow


def grow_back(self) -> list[Grow]:
    """Rule 8, after every queued job is placed: shrunk elastic jobs whose full size fits on
    their own GPUs plus the idle ones, highest priority and longest shrunk first. Updates
    `free` and `used` as if each grown job were already placed there."""
    grows = []
    snapshot = self.snapshot
    by_order = sorted(snapshot.running, key=lambda r: (-r.priority, r.started_at, r.id))
    for run in by_order:
        held = len(run.slots)
        if run.stopping or held >= run.gpus:
            continue
        if (snapshot.now - run.started_at).total_seconds() < snapshot.grow_after_s:
            continue
        if not run.stepped:
            continue  # not trained yet at its smaller size: growing now wastes that restart
        team = self.teams.get(run.team_id)
        if team is None or self.used[team.id] - held + run.gpus > team.cap:
            continue
        trial = {node_id: list(indices) for node_id, indices in self.free.items()}
        release(trial, run)
        # its full size: run.gpus
        choice = place(run, trial, allowed(team, self.nodes), self.largest)
        if choice is None:
            continue
        idle = sum(len(self.free[n.id]) for n in self.nodes)
        occupy(trial, choice)
        self.free.update(trial)
        self.used[team.id] += run.gpus - held
        grows.append(
            Grow(
                run.id,
                run.gpus,
                held,
                f"it runs on {held}; nothing is queued and {idle} GPUs are idle",
            )
        )
    return grows
