"""The Lockstep node agent: registers a node with the portal, launches and supervises the
workers of the attempts placed on it, and ships their status, metrics and logs by heartbeat.

The wire protocol and launch contract are in docs/agent-protocol.md.
"""

from nodeagent.agent import Agent
from nodeagent.supervisor import WorkerSupervisor

__all__ = ["Agent", "WorkerSupervisor"]
