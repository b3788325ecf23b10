"""Scheduling rule 9 (issue 18): a team an admin marked isolated-only runs only on nodes whose
agent runs each job in its own container. A "process"-runtime node (a laptop, a node with no
engine) runs jobs as the agent's user beside every other team's, so such a team's jobs, their
victims' GPUs and their reservations never land there. Pure."""

from __future__ import annotations

from jobs.scheduling.snapshot import NodeView, TeamView


def allowed(team: TeamView | None, nodes: list[NodeView]) -> list[NodeView]:
    """The nodes of `nodes` a job of `team` may run on (all of them for most teams)."""
    if team is None or not team.isolated_only:
        return nodes
    return [n for n in nodes if n.isolated]
