"""The node agent's main loop: register with the portal, heartbeat, and carry out the desired
attempts each heartbeat response lists (docs/agent-protocol.md).

The portal never calls the agent; everything it wants rides on heartbeat responses. Between
beats the loop keeps polling the supervisor so exits are noticed and stop deadlines are enforced
even while the portal is unreachable.
"""

from __future__ import annotations

import logging
import math
import os
import random
import signal
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import requests

from nodeagent import stack_sampler
from nodeagent.attempt_report import RankTails, Tracked
from nodeagent.container import Engine
from nodeagent.contract import inheritable_env
from nodeagent.health_check import HealthChecker
from nodeagent.heartbeat_body import build_heartbeat, tracked_for
from nodeagent.leaving import Leaving, bearer, short_error
from nodeagent.saves import SaveWatcher
from nodeagent.scalars import ScalarTail
from nodeagent.supervisor import WorkerSupervisor
from nodeagent.tail import LogTail, MetricsTail
from nodeagent.telemetry import Telemetry

logger = logging.getLogger("nodeagent")

REGISTER_PATH = "/api/v1/agent/register/"
HEARTBEAT_PATH = "/api/v1/agent/heartbeat/"
HTTP_TIMEOUT_S = 10.0
POLL_INTERVAL_S = 0.25  # how often workers are reaped and deadlines checked between beats
MAX_REGISTER_BACKOFF_S = 30.0
DEFAULT_STOP_DEADLINE_S = 30.0
# How long a stopping agent (first SIGTERM/SIGINT) waits for its workers to checkpoint and exit
# and for the portal to hear of it, before it kills what is left and exits.
DEFAULT_LEAVE_TIMEOUT_S = 30.0
# Each wait between beats is drawn from the interval times [1 - JITTER, 1 + JITTER]: agents
# that registered together (a portal restart, a rack powered on) otherwise beat in step,
# every node's heartbeat at the same instant and none between. The hollow-node harness
# measured 512 nodes in step at a 16 s interval: heartbeat p50 5.8 s where their average
# rate needed well under one.
JITTER = 0.2


def jittered(interval_s: float, rng: random.Random | None = None) -> float:
    """A wait of `interval_s` on average, spread so that agents drift out of step."""
    return interval_s * (rng or random).uniform(1.0 - JITTER, 1.0 + JITTER)


def pick_engine(runtime: str) -> Engine | None:
    """The engine for `runtime`: "container" needs one (podman, else Docker), "process" uses
    none, "auto" the container runtime where an engine works and plain processes elsewhere."""
    if runtime == "process":
        return None
    if runtime not in ("auto", "container", "podman", "docker"):
        raise ValueError(f"runtime must be auto, container, podman, docker or process: {runtime!r}")
    engine = Engine.detect(runtime if runtime in ("podman", "docker") else "auto")
    if engine is None and runtime != "auto":
        raise AgentFatal(f"runtime {runtime!r}: no working container engine (podman or docker)")
    return engine


class AgentFatal(Exception):
    """The portal refused the agent in a way retrying cannot fix (a bad cluster token)."""


class _NodeLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """Prefixes every line with the node name: many agents may log to one terminal."""

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        return f"[{self.extra['node']}] {msg}", kwargs


class Agent(Leaving):
    """One node's agent. `run()` is the whole life of the process; `register()` and
    `heartbeat()` are single exchanges with the portal, usable on their own."""

    def __init__(
        self,
        portal: str,
        token: str,
        gpus: int,
        *,
        name: str,
        work_dir: str | os.PathLike[str],
        rack: str = "default",
        address: str = "127.0.0.1",
        heartbeat_s: float = 2.0,
        gpu_kind: str = "auto",
        http_timeout_s: float = HTTP_TIMEOUT_S,
        warm_start: bool = False,
        leave_timeout_s: float = DEFAULT_LEAVE_TIMEOUT_S,
        runtime: str = "process",
        pull_policy: str = "if-not-present",
        node_env: dict[str, str] | None = None,
        health_check_s: float = 0.0,
        stack_sample_s: float = stack_sampler.DEFAULT_EVERY_S,
    ) -> None:
        if gpus < 1:
            raise ValueError("gpus must be at least 1")
        self.portal = portal.rstrip("/")
        self.cluster_token = token
        self.gpus = gpus
        self.name = name
        self.rack = rack
        self.address = address
        self.heartbeat_s = heartbeat_s
        self.http_timeout_s = http_timeout_s
        self.leave_timeout_s = max(0.0, leave_timeout_s)
        self.stack_sample_s = stack_sample_s  # how often a step-less attempt's stacks are read
        self.boot_id = uuid.uuid4().hex
        self.killed_orphans = 0
        self.node_id: int | None = None
        self.node_token: str | None = None
        self.log = _NodeLog(logger, {"node": name})
        self.engine = pick_engine(runtime)
        self.runtime = "process" if self.engine is None else "container"
        self.supervisor = WorkerSupervisor(
            work_dir,
            gpu_kind=gpu_kind,
            log=self.log,
            warm_start=warm_start,
            engine=self.engine,
            node=name,
            pull_policy=pull_policy,
            node_env=node_env,
        )
        self.telemetry = Telemetry(gpus, self.supervisor.gpu_kind, log=self.log)
        # Health checks (nodeagent/health_check.py): the collective runs over the node's own
        # network settings, as the jobs' ranks will.
        self.health = HealthChecker(
            gpus=gpus,
            gpu_kind=self.supervisor.gpu_kind,
            dirs=[self.supervisor.work_dir],
            env={**inheritable_env(os.environ), **(node_env or {})},
            every_s=health_check_s,
            log=self.log,
            engine=self.engine,
        )
        self._health_asked = False
        self._http = requests.Session()
        self._tracked: dict[int, Tracked] = {}
        # Attempt ids forgotten after their exit was recorded; an attempt runs once, so a `run`
        # for one of these is a portal bug and must not start a second copy.
        self._finished: set[int] = set()
        self._stop = threading.Event()
        self._stop_signal: int | None = None
        # A planned stop (the first SIGTERM/SIGINT): workers checkpoint and stop, the portal is
        # told the node is leaving, and the loop ends once that is done or the deadline passed.
        self._leave = threading.Event()
        self._leave_deadline: float | None = None
        self._leave_told = False
        # The portal did not answer the last try at all (it is gone too, e.g. `make up` stopping
        # everything): once the workers are gone there is no one to wait for.
        self._portal_gone = False
        self._failed_beats = 0
        self._last_register_error = ""
        self._backoff = 1.0

    # -- portal exchanges ----------------------------------------------------------------------

    def register(self) -> bool:
        """One registration try. True on success; False if the portal is unreachable or
        answered with a server error (retry later); raises AgentFatal when retrying is futile."""
        body = {
            "name": self.name,
            "gpus": self.gpus,
            "gpu_kind": self.supervisor.gpu_kind,
            "hostname": socket.gethostname(),
            "address": self.address,
            "rack": self.rack,
            "boot_id": self.boot_id,
            # Workers an earlier agent process left behind are killed, not re-adopted (their
            # pipes and deadlines died with it); the portal records that this happened.
            "killed_orphans": self.killed_orphans,
            # "process": jobs run as the agent's user beside each other (not isolated).
            "runtime": self.runtime,
            "engine": self.engine.name if self.engine is not None else "",
        }
        try:
            resp = self._http.post(
                self.portal + REGISTER_PATH,
                json=body,
                headers=bearer(self.cluster_token),
                timeout=self.http_timeout_s,
            )
        except requests.RequestException as exc:
            self._last_register_error = f"cannot reach {self.portal}: {short_error(exc)}"
            return False
        if resp.status_code in (401, 403):
            raise AgentFatal(
                f"the portal at {self.portal} rejected the cluster agent token "
                f"(HTTP {resp.status_code}); check --token / LOCKSTEP_AGENT_TOKEN"
            )
        if resp.status_code != 200:
            detail = f"HTTP {resp.status_code} from {self.portal}: {resp.text[:300]!r}"
            if 400 <= resp.status_code < 500 and resp.status_code not in (408, 429):
                raise AgentFatal(f"registration refused: {detail}")
            self._last_register_error = detail
            return False
        try:
            data = resp.json()
            self.node_id = int(data["node_id"])
            self.node_token = str(data["node_token"])
        except (ValueError, KeyError, TypeError) as exc:
            self._last_register_error = f"unreadable registration response: {exc}"
            return False
        self._set_heartbeat_s(data.get("heartbeat_s"))
        self.log.info(
            "registered with %s as node %s (%d %s slot(s), boot %s)",
            self.portal,
            self.node_id,
            self.gpus,
            self.supervisor.gpu_kind,
            self.boot_id[:8],
        )
        return True

    def heartbeat(self) -> bool:
        """Send one heartbeat and apply the response. True if the portal accepted it."""
        if self.node_token is None:
            raise RuntimeError("heartbeat before registration")
        body, acks, exits = self._build_heartbeat()
        try:
            resp = self._http.post(
                self.portal + HEARTBEAT_PATH,
                json=body,
                headers=bearer(self.node_token),
                timeout=self.http_timeout_s,
            )
        except requests.RequestException as exc:
            self._beat_failed(f"cannot reach {self.portal}: {short_error(exc)}")
            return False
        if resp.status_code == 401:
            self.log.warning("the portal no longer knows this node's token; re-registering")
            self.node_token = None
            return False
        if resp.status_code == 409:
            alive = self.supervisor.kill_all()
            self.log.error(
                "the portal says this agent's boot is stale (another agent "
                "registered as %r?); killed %d worker(s); re-registering",
                self.name,
                alive,
            )
            self.node_token = None
            return False
        if resp.status_code != 200:
            self._beat_failed(f"HTTP {resp.status_code}: {resp.text[:300]!r}")
            return False
        try:
            data = resp.json()
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
        except ValueError as exc:
            self._beat_failed(f"unreadable heartbeat response: {exc}")
            return False
        if self._failed_beats:
            self.log.info("portal reachable again after %d failed heartbeat(s)", self._failed_beats)
            self._failed_beats = 0
        # Only now is the data in this beat the portal's; until here a retry re-sends it.
        for tail, offset in acks:
            tail.ack(offset)
        for attempt_id in exits:
            tracked_for(self._tracked, attempt_id).exit_reported = True
        self.apply(data)
        return True

    # -- the loop ------------------------------------------------------------------------------

    def run(self) -> int:
        """Register, heartbeat until asked to stop, then kill every worker. Returns the exit
        status for the process: 0 after a stop request, 1 when the portal refused the agent."""
        status = 0
        self.log.info(
            "agent starting: portal %s, %d %s slot(s), work dir %s",
            self.portal,
            self.gpus,
            self.supervisor.gpu_kind,
            self.supervisor.work_dir,
        )
        # Before anything else: no container or worker of an earlier agent process may train
        # beside the attempts the portal has since given to others.
        orphans = self.supervisor.remove_stale_containers() + self.supervisor.reap_orphans()
        self.killed_orphans = orphans
        if orphans:
            self.log.warning("killed %d worker(s) left by an earlier agent process", orphans)
        self._backoff = 1.0
        next_exchange = time.monotonic()
        try:
            while not self._stop.is_set():
                try:
                    self.supervisor.poll()
                except Exception:
                    # Each attempt is polled in its own try (WorkerSupervisor.poll); nothing
                    # else there may end this loop either, whose end kills every job here.
                    self.log.exception("unexpected error polling the workers")
                now = time.monotonic()
                if self._leave.is_set():
                    if self._leave_deadline is None:
                        self._begin_leave(now)
                        next_exchange = now
                    if self._left(now):
                        break
                if now >= next_exchange:
                    try:
                        next_exchange = self._exchange(now)
                    except AgentFatal:
                        raise
                    except Exception:
                        # A bug or a surprising response must not take the node's workers
                        # down with the agent; the next beat tries again.
                        self.log.exception("unexpected error talking to the portal")
                        next_exchange = now + self.heartbeat_s
                wait = min(POLL_INTERVAL_S, max(0.0, next_exchange - time.monotonic()))
                self._stop.wait(wait)
        except AgentFatal as exc:
            self.log.error("%s", exc)
            status = 1
        finally:
            alive = self.supervisor.kill_all()
            self.supervisor.close()
            if self._stop_signal is not None:
                reason = signal.Signals(self._stop_signal).name
            else:
                reason = "stop requested" if status == 0 else "fatal error"
            self.log.info(
                "agent stopping (%s): killed %d worker(s); exiting with %d", reason, alive, status
            )
        return status

    def _exchange(self, now: float) -> float:
        """Register or heartbeat, whichever is due; returns when the next exchange is due.
        While leaving: say so first (until the portal has it), and never register."""
        if self._leave.is_set():
            if self.node_token is None:
                return now + self.heartbeat_s
            if not self._leave_told:
                self._leave_told = self.tell_leaving()
            if self.node_token is not None:
                self.heartbeat()
            return now + min(self.heartbeat_s, 0.5)
        if self.node_token is not None:
            self.heartbeat()
            if self.health.due(idle=not self.supervisor.attempt_ids(), asked=self._health_asked):
                self._health_asked = False
                self.health.start_full(self._own_pids())
            return now + jittered(self.heartbeat_s)
        if self.register():
            self._backoff = 1.0
            return now  # heartbeat straight away: the portal is waiting to hear from us
        self.log.warning(
            "%s; is the portal running? retrying in %.0f s",
            self._last_register_error,
            self._backoff,
        )
        # Jittered too: agents that lost the portal together must not all come back at once.
        retry_at = now + jittered(self._backoff)
        self._backoff = min(MAX_REGISTER_BACKOFF_S, self._backoff * 2)
        return retry_at

    def request_stop(self, signum: int | None = None) -> None:
        """Ask `run()` to return after its current exchange (at most one HTTP timeout)."""
        if self._stop.is_set() and signum is not None:
            # A second signal: the operator is impatient; the loop exits as soon as it can.
            self.supervisor.kill_all()
        self._stop_signal = signum
        self._stop.set()

    def install_signal_handlers(self) -> None:
        """The first SIGTERM/SIGINT is a planned stop (`request_leave`: workers checkpoint
        and stop, the portal requeues their jobs without counting a failure); a second one
        stops at once, killing the workers. Main thread only."""

        def handle(signum: int, _frame: Any) -> None:
            if self._leave.is_set() or self._stop.is_set():
                self.supervisor.kill_all()
                self._stop_signal = signum
                self._stop.set()
            else:
                self.request_leave(signum)

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, handle)

    # -- heartbeat contents and response -------------------------------------------------------

    def _build_heartbeat(self) -> tuple[dict[str, Any], list[tuple[Any, Any]], list[int]]:
        return build_heartbeat(
            self.supervisor,
            self._tracked,
            boot_id=self.boot_id,
            telemetry=self.telemetry,
            health=self.health,
            leaving=self._leave.is_set(),
            log=self.log,
        )

    def apply(self, response: dict[str, Any]) -> None:
        """Carry out a heartbeat response: fence, stop, dump, launch, forget."""
        self._set_heartbeat_s(response.get("heartbeat_s"))
        # The node is held until a full health check passes: run one (after this beat).
        self._health_asked = bool(response.get("health_check"))
        run: dict[int, Any] = {}
        stop: dict[int, float] = {}
        dump: set[int] = set()
        desired: set[int] = set()
        for item in response.get("desired") or []:
            try:
                attempt_id = int(item["attempt_id"])
            except (KeyError, TypeError, ValueError):
                self.log.error("ignoring a desired entry without an attempt id: %r", item)
                continue
            desired.add(attempt_id)
            action = item.get("action")
            if action == "run":
                run[attempt_id] = item.get("launch")
            elif action == "stop":
                stop[attempt_id] = _number(item.get("deadline_s"), DEFAULT_STOP_DEADLINE_S)
            elif action == "dump":
                # The portal suspects a hang: stacks first, then it drops the attempt (fencing).
                dump.add(attempt_id)
            else:
                self.log.warning(
                    "attempt %s: unknown action %r; leaving it as it is", attempt_id, action
                )

        # Fencing (invariant 4) comes first: a worker the portal no longer wants may hold GPUs
        # it has already handed to someone else.
        if response.get("rejoined"):
            # This node had been declared lost (the agent froze, or the network cut it off):
            # every container not in the desired set goes (off the loop), warm ones with
            # their idle servers too, since their jobs have moved on.
            self.log.warning("back after being declared lost: removing stale containers")
            self.supervisor.sweep_stale_containers(keep=desired)
        for attempt_id in self.supervisor.attempt_ids():
            attempt = self.supervisor.get(attempt_id)
            if attempt_id in desired or attempt is None or attempt.all_exited or attempt.killed:
                continue
            self.log.warning(
                "fencing attempt %s: not in the portal's desired set; SIGKILL to ranks %s",
                attempt_id,
                [w.rank for w in attempt.workers if w.alive],
            )
            self.supervisor.kill(attempt_id)

        for attempt_id, deadline_s in stop.items():
            if attempt_id in self.supervisor:
                self.supervisor.stop(attempt_id, deadline_s)

        for attempt_id in dump:
            # Nothing to dump for an attempt with no workers here; it is never launched by it.
            if attempt_id in self.supervisor:
                self.supervisor.dump_stacks(attempt_id)

        for attempt_id, launch in run.items():
            if attempt_id in self.supervisor:
                continue
            if self._leave.is_set():
                self.log.info("attempt %s: not started, this agent is leaving", attempt_id)
                continue
            if attempt_id in self._finished:
                self.log.error(
                    "attempt %s already ran here and ended; not starting it again", attempt_id
                )
                continue
            if launch is None:
                # The portal sends the spec only for attempts this agent did not report; the
                # next beat, which will not report it, brings the spec.
                self.log.warning("attempt %s: wanted here but no launch spec yet", attempt_id)
                continue
            self._launch(attempt_id, launch)

        acked = set()
        for value in response.get("acked") or []:
            try:
                acked.add(int(value))
            except (TypeError, ValueError):
                continue
        for attempt_id in self.supervisor.attempt_ids():
            tracked = tracked_for(self._tracked, attempt_id)
            if (
                self.supervisor.all_exited(attempt_id)
                and tracked.exit_reported
                and (attempt_id not in run or attempt_id in acked)
            ):
                self.supervisor.forget(attempt_id)
                if tracked.scalars is not None:
                    tracked.scalars.close()
                self._tracked.pop(attempt_id, None)
                self._finished.add(attempt_id)
                self.log.info("attempt %s: exit recorded by the portal; forgotten", attempt_id)

    def _own_pids(self) -> set[int]:
        """Host pids of this agent's live ranks: allowed on their GPUs."""
        return {
            host
            for attempt_id in self.supervisor.attempt_ids()
            for host in self.supervisor.live_host_pids(attempt_id).values()
        }

    def _launch(self, attempt_id: int, launch: Any) -> None:
        try:
            ranks = launch["ranks"]
            gpus = [int(r.get("gpu_index", r["local_rank"])) for r in ranks]
            dirs = (
                [Path(launch["checkpoint_dir"]).parent.parent]
                if launch.get("checkpoint_dir")
                else []
            )
        except (KeyError, TypeError, ValueError):
            gpus, dirs = [], []
        # A kill not confirmed on these GPUs fails it too: a live process may still hold them.
        stuck = self.supervisor.stuck_kills(gpus)
        quick = self.health.quick(gpus, self._own_pids(), extra_dirs=dirs, failing=stuck)
        if not quick["ok"]:
            # Before a gang starts here: a node that cannot run it says so, and the portal
            # cordons it and starts the job elsewhere, with no restart used.
            self.log.error(
                "attempt %s: not started, health check failed: %s", attempt_id, quick["reason"]
            )
            self.health.pending = quick
            attempt = self.supervisor.refuse(
                attempt_id, launch, {"kind": "health", "message": quick["reason"]}
            )
            self._tracked[attempt_id] = Tracked()
            return
        try:
            attempt = self.supervisor.launch(attempt_id, launch)
        except (KeyError, TypeError, ValueError, OSError) as exc:
            # A plain-process launch turns an OSError part-way into a failed attempt itself;
            # one that still gets here (the container runtime's) must not end the beat.
            self.log.error(
                "attempt %s: %s (%s: %s); not started",
                attempt_id,
                "cannot launch" if isinstance(exc, OSError) else "malformed launch",
                type(exc).__name__,
                exc,
            )
            return
        self._tracked[attempt_id] = Tracked(
            tails=[
                RankTails(
                    worker=w,
                    metrics=MetricsTail(w.metrics_path, w.rank, log=self.log),
                    log=LogTail(w.log_path, w.rank, log=self.log),
                )
                for w in attempt.workers
            ],
            scalars=ScalarTail(launch.get("checkpoint_dir"), attempt.launched_at, log=self.log),
            saves=(
                SaveWatcher(launch["checkpoint_dir"])
                if launch.get("checkpoint_dir") and int(launch.get("group_rank", 0)) == 0
                else None
            ),
            stacks=stack_sampler.StackSampler(self.stack_sample_s),
        )

    def _set_heartbeat_s(self, value: Any) -> None:
        # Bounded so a bad response can neither spin the loop nor silence the node.
        self.heartbeat_s = min(60.0, max(0.1, _number(value, self.heartbeat_s)))

    def _beat_failed(self, why: str) -> None:
        self._failed_beats += 1
        if self._failed_beats == 1 or self._failed_beats % 10 == 0:
            self.log.warning(
                "heartbeat failed (%d in a row): %s; unsent data is kept and re-sent",
                self._failed_beats,
                why,
            )


def _number(value: Any, default: float) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return default
    return number if math.isfinite(number) else default


def default_work_dir(name: str) -> Path:
    return Path("var") / "agents" / name
