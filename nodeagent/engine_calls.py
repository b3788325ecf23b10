"""Container engine calls that can block, run off the agent's loop.

The engine's CLI can hang or crawl (a wedged podman, a loaded Docker daemon): each call waits
up to a minute (container.REMOVE_TIMEOUT_S). Made from the loop, one such call silenced the
node's heartbeats for that long, the portal declared the node lost, and every job on it was
restarted elsewhere although only one container's removal was slow. So these calls each run
in a thread of their own:
- those that remove or kill a container: a kill's `rm --force`, its retries, a stop's
  deadline, warm containers going, stale containers;
- those that signal one: a stop's SIGTERM, a hang's stack-dump SIGUSR1 (`podman kill
  --signal`, 30 s each);
- the lookup of its init's pid (py-spy and the flight recorders need the ranks' host pids).

Image pulls run in a process of their own (nodeagent/container_launch.py). The loop starts the
calls and looks at them as it polls; what waits on one (kill_confirm's pending kill, the
stale-container sweep, a pid lookup) gets its result when it is done. A thread, not a polled
process as a pull is: a removal is the engine's `Engine.remove` (`rm --force`, then an
`inspect` when that failed) or a warm container's kill (its server asked first, then `rm
--force`), each step with its subprocess timeout.

At most one removal runs per container (`EngineCalls.start`, keyed by its name); a signal is
keyed by the container and the signal, a pid lookup by the container and "pid", so a stop's
SIGTERM neither waits behind its deadline's removal nor holds it up. A call still running
after its timeout counts as failed (`Call.overdue`); the next try starts once it has returned
(its subprocesses have timeouts, so it does), and a late success still counts: it is the
engine's word.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from nodeagent.container import REMOVE_TIMEOUT_S, Engine, EngineError

Log = logging.Logger | logging.LoggerAdapter  # type: ignore[type-arg]
logger = logging.getLogger("nodeagent.engine_calls")

STALE_RETRY_S = 5.0  # a sweep of stale containers that did not finish is tried again this often


@dataclass
class Call:
    """One engine call running in a thread; `done` once it returned or raised."""

    key: str
    what: str
    timeout_s: float
    started: float = field(default_factory=time.monotonic)
    done: bool = False
    result: Any = None
    error: BaseException | None = None
    overdue_told: bool = False  # the caller has logged it as failed for being late
    _returned: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def ok(self) -> bool:
        return self.done and self.error is None and bool(self.result)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def wait(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for it to return: True once `done`. For a call that is fast
        unless the engine is wedged, where the loop may wait that long and no longer."""
        return self._returned.wait(timeout_s)

    def overdue(self) -> bool:
        """Still running past its timeout: taken for failed (it may still succeed late)."""
        return not self.done and self.elapsed() > self.timeout_s

    def _run(self, fn: Callable[[], Any], finished: Callable[[Call], None]) -> None:
        try:
            self.result = fn()
        except BaseException as exc:  # noqa: BLE001 (the caller reads and logs it)
            self.error = exc
        finally:
            finished(self)  # sets `done`


class EngineCalls:
    """The agent's engine calls in flight, at most one per key (a container's name)."""

    def __init__(self, timeout_s: float = REMOVE_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s  # a call running longer counts as failed (`Call.overdue`)
        self._lock = threading.Lock()
        self._running: dict[str, Call] = {}
        self._idle = threading.Condition(self._lock)

    def start(self, key: str, what: str, fn: Callable[[], Any]) -> Call:
        """Run `fn()` in a thread of its own and return its call; while a call for `key` is
        still running, that one is returned instead and nothing new starts."""
        with self._lock:
            running = self._running.get(key)
            if running is not None:
                return running
            call = Call(key, what, self.timeout_s)
            self._running[key] = call
        thread = threading.Thread(
            target=call._run, args=(fn, self._finished), name=f"engine: {what}", daemon=True
        )
        thread.start()
        return call

    def signal(self, container: Any, sig: int) -> None:
        """`sig` to a container (container.ContainerAttempt) off the loop. Nothing waits on it:
        a stop's deadline kills what the signal did not stop, a dump is read when it comes.
        A warm container's attempt is signalled by a file its server reads, not through the
        engine (`signals_by_engine` False): that is done here, in order, as before."""
        if not container.signals_by_engine:
            container.signal(sig)
            return
        name = signal.Signals(sig).name
        self.start(
            f"{container.name} {name}", f"{name} to {container.name}", lambda: container.signal(sig)
        )

    def settle(self, call: Call, wait_s: float) -> bool:
        """Wait up to `wait_s` for a call that is quick unless the engine is wedged; True once
        it is done. Not at all while another call has already run longer than that: then the
        engine is wedged, and waits for each of a heartbeat's launches would add up to the
        portal's heartbeat timeout."""
        with self._lock:
            stalled = any(
                other is not call and other.elapsed() > wait_s for other in self._running.values()
            )
        return call.done if stalled else call.wait(wait_s)

    def container_pid(self, engine: Engine, name: str) -> Call:
        """The host pid of the container's init (`inspect`), off the loop; its result is None
        while the engine does not know it."""
        return self.start(f"{name} pid", f"pid of {name}", lambda: engine.container_pid(name))

    def wait(self, timeout_s: float) -> bool:
        """Wait until no call runs (the agent stopping); False if some still do after
        `timeout_s`."""
        give_up = time.monotonic() + timeout_s
        with self._idle:
            while self._running:
                left = give_up - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def _finished(self, call: Call) -> None:
        if call.error is not None:
            # Said here once for every call: a signal's caller never looks at its result.
            logger.warning("engine call failed: %s: %s", call.what, call.error)
        with self._idle:
            if self._running.get(call.key) is call:
                del self._running[call.key]
            # Only now: a caller that sees it done may start the next call for its key.
            call.done = True
            call._returned.set()
            self._idle.notify_all()


class StaleSweep:
    """Removes this agent's containers that serve nothing it keeps: at its start, before
    anything else (`run_now`, a zombie must never train beside the attempt that replaced it),
    and when the portal says the node is back after being declared lost (`request`). What
    could not be done (the engine failed to list them, or a removal failed) is tried again
    every STALE_RETRY_S off the loop (`tick`: the engine's list, then each stale container's
    removal, in threads) until a list comes back with no stale container on it.

    A container stays if it serves an attempt the agent holds (`held`, asked on the loop when
    the list is in, so an attempt launched meanwhile is seen; but not one held when the node
    came back and not desired then: `drop`, it is being fenced) or one `request` named, or is
    a warm container the agent still has (`warm`: those serve their job's later attempts and
    go their own way, nodeagent/warm_container.py). When the agent stops, every container
    of its identity goes (`close`)."""

    def __init__(
        self,
        engine: Engine,
        agent: str,
        calls: EngineCalls,
        log: Log,
        held: Callable[[], Iterable[int]],
        warm: Any = None,  # warm_container.WarmContainers (which imports this module)
    ) -> None:
        self.engine = engine
        self.agent = agent
        self.calls = calls
        self.log = log
        self.held = held
        self.warm = warm
        self.wanted = False
        self.keep: set[int] = set()  # attempts whose containers stay, beyond those held
        self.drop: set[int] = set()  # held attempts whose containers go all the same
        self.removed = 0
        self._due = 0.0
        self._listing: Call | None = None
        self._removals: list[Call] = []

    def stale(self, found: dict[str, str]) -> bool:
        attempt = found["attempt"]
        keep = (self.keep | set(self.held())) - self.drop
        kept = attempt.isdigit() and int(attempt) in keep
        return not kept and (self.warm is None or found["name"] not in self.warm.names())

    def run_now(self) -> int:
        """Remove the stale containers now, waiting on the engine (the agent's start, before
        its loop); what it could not do, `tick` tries again. Returns how many went."""
        self.removed = 0
        try:
            listed = self.engine.containers(self.agent)
        except EngineError as exc:
            self.log.error(
                "stale containers: cannot list this agent's containers (%s); trying again "
                "every %.0f s",
                exc,
                STALE_RETRY_S,
            )
            self.request()
            return 0
        stale = [found["name"] for found in listed if self.stale(found)]
        gone = [name for name in stale if self._remove(name)]
        self.removed += len(gone)
        failed = sorted(set(stale) - set(gone))
        if failed:
            self.log.error(
                "stale containers: %s not removed; trying again every %.0f s",
                ", ".join(failed),
                STALE_RETRY_S,
            )
            self.request(now=time.monotonic() + STALE_RETRY_S)
        return len(gone)

    def request(self, keep: Iterable[int] | None = None, now: float | None = None) -> None:
        """Sweep (again) from `now`, once the sweep under way, if any, is done. With `keep`
        (the node is back after being declared lost: the desired attempts), the containers
        of the attempts held now but not in it go too."""
        if not self.wanted:
            self.keep, self.drop = set(), set()
        self.wanted = True
        if keep is not None:
            self.keep |= set(keep)
            self.drop |= set(self.held()) - set(keep)
        self._due = time.monotonic() if now is None else now

    def tick(self) -> None:
        """One poll's work: start the list or the removals when due, take their results."""
        if not self.wanted:
            return
        now = time.monotonic()
        if self._listing is None and not self._removals and now >= self._due:
            self._listing = self.calls.start(
                f"ps {self.agent}", "listing containers", lambda: self.engine.containers(self.agent)
            )
        listing = self._listing
        if listing is not None and listing.done:
            self._listing = None
            if listing.error is not None:
                self.log.error(
                    "stale containers: cannot list this agent's containers (%s); trying again "
                    "in %.0f s",
                    listing.error,
                    STALE_RETRY_S,
                )
                self._due = now + STALE_RETRY_S
                return
            for found in listing.result:
                if self.stale(found):
                    name = found["name"]
                    self._removals.append(
                        self.calls.start(name, f"removing {name}", lambda n=name: self._remove(n))
                    )
            if not self._removals:
                self._end()
        elif listing is not None and listing.overdue() and not listing.overdue_told:
            listing.overdue_told = True
            self.log.error(
                "stale containers: the engine has not listed them in %.0f s; still waiting",
                listing.elapsed(),
            )
        if self._removals and all(c.done for c in self._removals):
            removals, self._removals = self._removals, []
            # A call another started (a warm container's kill, which may keep it) is no
            # word on this removal: listed again, the container goes then if still there.
            failed = [c.key for c in removals if not (c.ok and c.what == f"removing {c.key}")]
            self.removed += len(removals) - len(failed)
            if failed:
                self.log.error(
                    "stale containers: %s not removed; trying again in %.0f s",
                    ", ".join(failed),
                    STALE_RETRY_S,
                )
                self._due = now + STALE_RETRY_S
            else:
                self._end()

    def close(self) -> None:
        """The agent is stopping: every container of this agent still listed goes, waiting
        on the engine. A killed or exited attempt's container is removed by the engine
        (`--rm`), but after its process ends, not before: an agent that exited at once left it
        listed, and `make up`'s stop was not "nothing left behind" (seen under load in
        tests/test_container_runtime.py). `rm --force` waits for the removal."""
        try:
            self.engine.remove_all(self.agent)
        except EngineError as exc:
            self.log.error("removing this agent's containers: %s", exc)

    def _remove(self, name: str) -> bool:
        gone = self.engine.remove(name)
        if gone:
            self.log.warning("removed stale container %s", name)
        return gone

    def _end(self) -> None:
        self.wanted = False
        level = logging.WARNING if self.removed else logging.INFO
        self.log.log(level, "stale containers: none left (%d removed)", self.removed)
        self.removed = 0
