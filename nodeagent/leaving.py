"""A planned stop of the agent (the first SIGTERM/SIGINT: an upgrade, Ctrl-C on `make up`): its
workers checkpoint and stop, the portal is told the node is leaving (it requeues their jobs
without counting a failure: jobs.actions.nodes.do_node_leaving), and the agent exits once the
portal heard of their exits or its leave deadline passed (docs/agent-protocol.md, Leaving).

`Leaving` is a part of `nodeagent.agent.Agent`, kept here by concept: it uses the agent's
portal session, supervisor and state."""

from __future__ import annotations

import signal
import time

import requests

from nodeagent.heartbeat_body import tracked_for

LEAVING_PATH = "/api/v1/agent/leaving/"


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def short_error(exc: Exception) -> str:
    # requests wraps urllib3 errors several layers deep; the innermost reason is the useful one.
    reason: BaseException = exc
    for _ in range(10):
        if reason.__context__ is None:
            break
        reason = reason.__context__
    return f"{type(reason).__name__}: {reason}"[:200]


class Leaving:
    """The agent's planned stop (mixed into Agent)."""

    def tell_leaving(self) -> bool:
        """Tell the portal this agent is stopping on purpose (a planned restart): it
        checkpoint-stops the node's attempts and requeues their jobs without counting a
        failure. True once the portal has it (or refused it: retrying would not help)."""
        if self.node_token is None:
            return False
        remaining = (
            max(0.0, self._leave_deadline - time.monotonic())
            if self._leave_deadline is not None
            else self.leave_timeout_s
        )
        why = (
            signal.Signals(self._stop_signal).name
            if self._stop_signal is not None
            else "stop requested"
        )
        try:
            resp = self._http.post(
                self.portal + LEAVING_PATH,
                json={"boot_id": self.boot_id, "reason": why, "grace_s": round(remaining, 1)},
                headers=bearer(self.node_token),
                timeout=min(self.http_timeout_s, max(remaining, 1.0)),
            )
        except requests.RequestException as exc:
            self._portal_gone = isinstance(exc, requests.ConnectionError)
            self.log.warning("could not tell the portal this node is leaving: %s", short_error(exc))
            return False
        self._portal_gone = False
        if resp.status_code != 200:
            self.log.warning(
                "the portal did not take this node's leaving: HTTP %s %r",
                resp.status_code,
                resp.text[:200],
            )
            # A refusal (an unknown token or boot, a portal without this call) is final;
            # only a server error or a timeout is worth another try.
            return 400 <= resp.status_code < 500 and resp.status_code not in (408, 429)
        self.log.info("told the portal this node is leaving (a planned restart, %s)", why)
        return True

    def _begin_leave(self, now: float) -> None:
        self._leave_deadline = now + self.leave_timeout_s
        ids = self.supervisor.attempt_ids()
        for attempt_id in ids:
            # Checkpoint-and-stop, as for a preemption; survivors get SIGKILL at the deadline.
            self.supervisor.stop(attempt_id, self.leave_timeout_s)
        self.log.info(
            "leaving (planned restart): checkpoint-and-stop sent to attempt(s) %s; waiting up "
            "to %.0f s for them to exit (a second signal kills them now)",
            ids,
            self.leave_timeout_s,
        )

    def _left(self, now: float) -> bool:
        """True when a leaving agent may exit: its workers are gone and the portal heard of
        their exits (or it never had the portal's ear), or the deadline passed. Past the
        deadline it kills what is left and reports that once more, best effort."""
        ids = self.supervisor.attempt_ids()
        if self.node_token is None or self._portal_gone:
            if all(self.supervisor.all_exited(a) for a in ids):
                return True
        elif self._leave_told and all(
            self.supervisor.all_exited(a) and tracked_for(self._tracked, a).exit_reported
            for a in ids
        ):
            return True
        if self._leave_deadline is None or now < self._leave_deadline:
            return False
        if self.supervisor.kill_all():
            for attempt_id in ids:
                self.supervisor.wait(attempt_id, 2.0)
        if self.node_token is not None:
            if not self._leave_told:
                self._leave_told = self.tell_leaving()
            self.heartbeat()
        self.log.warning("leave deadline passed; exiting")
        return True

    def request_leave(self, signum: int | None = None) -> None:
        """A planned stop: checkpoint-and-stop the workers, tell the portal the node is
        leaving, wait up to `leave_timeout_s` for them, then return from `run()`."""
        self._stop_signal = signum
        self._leave.set()
