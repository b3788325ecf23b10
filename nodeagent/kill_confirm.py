"""Kills the agent has sent but not yet seen take effect, tried again until they have.

An attempt's ranks are reported exited only on evidence that they are gone: reaped by the
supervisor's poll; for an attempt it gave up supervising (`WorkerSupervisor.fail`), whose ranks
are not polled, a process group with no live process left; in a container, the engine's word
that the container is removed or stopped (`Engine.remove`). A SIGKILL can be slow to take (a
thread in uninterruptible sleep in a driver) and an engine can fail or hang on `rm --force`:
until then the ranks are reported as they were, running, so the portal keeps their GPUs
allocated, and every poll sends SIGKILL again. A container's removal runs off the agent's loop
(nodeagent/engine_calls.py: a hung engine must not silence the heartbeats); the pending kill
takes its result when it returns, and one that failed, or is still running past its timeout,
is tried again REMOVE_RETRY_S after (never two at once for a container). A kill still
unconfirmed KILL_CONFIRM_S after it was sent refuses launches onto the attempt's GPUs as a
failed quick health check (`refusals`): the portal may have released them already (a fenced
attempt).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from nodeagent.container import ContainerRank
from nodeagent.engine_calls import Call, EngineCalls
from nodeagent.workers import AttemptWorkers, RankWorker

Log = logging.Logger | logging.LoggerAdapter  # type: ignore[type-arg]

# Longer than a healthy kill takes (a rank freeing a large GPU context, a loaded engine's
# removal), short enough that a launch onto GPUs a live process still holds is refused.
KILL_CONFIRM_S = 30.0
REMOVE_RETRY_S = 5.0
LOG_EVERY_S = 10.0  # a kill still unconfirmed is logged this often (retried every poll)


@dataclass
class PendingKill:
    """A kill sent to an attempt's ranks whose effect is not yet seen."""

    since: float  # clock() time the first kill was sent
    removed: bool = True  # container runtime: whether the engine confirmed the removal
    removal: Call | None = None  # container runtime: the removal running off the loop
    given_up: str = ""  # why the agent gave the attempt up (its ranks are not polled then)
    tries: int = 1
    next_removal: float = 0.0
    logged_at: float = float("-inf")


def sent(attempt: AttemptWorkers, now: float, removal: Call | None = None) -> None:
    """Note a kill of the attempt's ranks (with `removal`, the call that removes their
    container); a repeat keeps the first one's time."""
    if attempt.pending_kill is None and attempt.all_exited and removal is None:
        return  # nothing was left to kill
    if attempt.pending_kill is None:
        attempt.pending_kill = PendingKill(since=now, next_removal=now + REMOVE_RETRY_S)
    if removal is not None:
        attempt.pending_kill.removed = False
        attempt.pending_kill.removal = removal


def kill(
    attempt: AttemptWorkers,
    now: float,
    signal_group: Callable[[RankWorker, int], None],
    calls: EngineCalls,
) -> None:
    """SIGKILL the attempt's live ranks, start killing its container (if it has one) off the
    loop, and note the kill (`sent`): `follow_up` takes the removal's result (that of the one
    already running, if a removal of the container is)."""
    container, removal = attempt.container, None
    if container is not None:
        removal = calls.start(container.name, f"killing {container.name}", container.kill)
    for worker in attempt.workers:
        if worker.alive:
            signal_group(worker, signal.SIGKILL)
    sent(attempt, now, removal)


def give_up(attempt: AttemptWorkers, why: str, now: float) -> None:
    """The attempt is no longer polled: its ranks are reported exited as the evidence comes,
    here at once for those already gone, else by later polls (`follow_up`)."""
    if attempt.all_exited:
        return
    if attempt.pending_kill is None:  # the kill raised before it was noted
        sent(attempt, now)
        attempt.pending_kill.removed = attempt.container is None  # removed again when due
    attempt.pending_kill.given_up = why
    _confirm_given_up(attempt)
    if attempt.all_exited and attempt.pending_kill.removed:
        attempt.pending_kill = None


def follow_up(
    attempt: AttemptWorkers,
    now: float,
    signal_group: Callable[[RankWorker, int], None],
    log: Log,
    calls: EngineCalls,
) -> None:
    """One poll's work on a pending kill, after the attempt's ranks were reaped: done if the
    kill is seen to have worked, else SIGKILL again and the container's removal followed:
    its result taken, and started again when due."""
    pending = attempt.pending_kill
    if pending is None:
        return
    if not pending.removed and attempt.container is not None:
        _follow_removal(attempt, pending, now, log, calls)
    for worker in attempt.workers:
        if worker.alive:
            signal_group(worker, signal.SIGKILL)
    if pending.given_up:
        _confirm_given_up(attempt)
    if attempt.all_exited and pending.removed:
        attempt.pending_kill = None
        if pending.tries > 1 or now - pending.since >= 1.0:
            log.info(
                "attempt %s: kill confirmed %.1f s after it was sent",
                attempt.attempt_id,
                now - pending.since,
            )
    elif now - pending.since >= 1.0 and now - pending.logged_at >= LOG_EVERY_S:
        pending.logged_at = now
        log.warning(
            "attempt %s: kill not confirmed %.0f s after it was sent: %s; SIGKILL again; its "
            "ranks are reported running until it is",
            attempt.attempt_id,
            now - pending.since,
            describe(attempt),
        )


def _follow_removal(
    attempt: AttemptWorkers, pending: PendingKill, now: float, log: Log, calls: EngineCalls
) -> None:
    container = attempt.container
    call = pending.removal
    if call is not None and call.done:
        pending.removal = None
        pending.removed = call.ok
        if call.error is not None:  # the engine's CLI is gone or broke
            log.error(
                "attempt %s: removing its container: %s: %s",
                attempt.attempt_id,
                type(call.error).__name__,
                call.error,
            )
        if not pending.removed:
            pending.next_removal = max(pending.next_removal, now + REMOVE_RETRY_S)
    elif call is not None and call.overdue() and not call.overdue_told:
        call.overdue_told = True  # failed; tried again once it returned
        pending.next_removal = max(pending.next_removal, now + REMOVE_RETRY_S)
        log.warning(
            "attempt %s: removing container %s: no answer from the engine in %.0f s; taken "
            "as failed (the agent beats on; tried again once that call returns)",
            attempt.attempt_id,
            container.name,
            call.elapsed(),
        )
    if pending.removed or pending.removal is not None or now < pending.next_removal:
        return
    pending.tries += 1
    pending.next_removal = now + REMOVE_RETRY_S
    log.warning(
        "attempt %s: container %s not removed %.0f s after its kill; removing it again (try %d)",
        attempt.attempt_id,
        container.name,
        now - pending.since,
        pending.tries,
    )
    pending.removal = calls.start(container.name, f"removing {container.name}", container.remove)


def describe(attempt: AttemptWorkers) -> str:
    """What is still there, in a few words."""
    pending = attempt.pending_kill
    if pending is not None and not pending.removed and attempt.container is not None:
        running = pending.removal
        last = f", the last still running after {running.elapsed():.0f} s" if running else ""
        return (
            f"container {attempt.container.name} not removed: {pending.tries} tries{last} "
            "(the engine's errors are in the agent's log)"
        )
    alive = [w for w in attempt.workers if w.alive]
    return (
        f"rank(s) {', '.join(str(w.rank) for w in alive)} (pid(s) "
        f"{', '.join(str(w.pid) for w in alive)}) still alive after SIGKILL"
    )


def refusals(
    attempts: Iterable[AttemptWorkers], gpus: Iterable[int], now: float
) -> list[dict[str, Any]]:
    """Failed health checks for a launch onto `gpus`: one for each attempt holding any of them
    whose kill is unconfirmed KILL_CONFIRM_S after it was sent."""
    wanted = set(gpus)
    checks = []
    for attempt in attempts:
        pending = attempt.pending_kill
        if pending is None or now - pending.since < KILL_CONFIRM_S:
            continue
        held = sorted({w.gpu_index for w in attempt.workers if w.alive} & wanted)
        if held:
            detail = (
                f"attempt {attempt.attempt_id}'s ranks could not be confirmed killed: "
                f"{describe(attempt)}, {now - pending.since:.0f} s after the kill "
                f"(GPU(s) {', '.join(map(str, held))})"
            )
            checks.append({"name": "kill", "ok": False, "detail": detail})
    return checks


def _confirm_given_up(attempt: AttemptWorkers) -> None:
    """The ranks of an attempt given up, exited (-9) where the evidence says they are gone."""
    removed = attempt.pending_kill is None or attempt.pending_kill.removed
    for worker in attempt.workers:
        if not worker.alive:
            continue
        if isinstance(worker.popen, ContainerRank):
            gone = removed
        else:
            gone = worker.popen is None or not group_alive(worker.popen.pid)
        if gone:
            worker.state, worker.exit_code = "exited", -signal.SIGKILL
            worker.exited_at = time.time()


def group_alive(pgid: int) -> bool:
    """Whether any process of the process group `pgid` still runs a thread. A zombie does not:
    it has exited and holds nothing but its exit status (a rank whose polling failed is never
    reaped). A worker is its group's leader, and Linux does not reuse a pid while it names a
    live group, so this never reads a stranger's group while any of the worker's remain."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's process is in it: look
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return True  # no way to tell: it exists
    for pid in pids:
        fields = _stat(f"/proc/{pid}/stat")
        if fields and int(fields[2]) == pgid and _threads_alive(pid):
            return True
    return False


def _threads_alive(pid: str) -> bool:
    """Whether any thread of the process has not exited (a killed process's leader can be a
    zombie while another of its threads is still stuck in the kernel)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False  # gone meanwhile
    for tid in tids:
        fields = _stat(f"/proc/{pid}/task/{tid}/stat")
        if fields and fields[0] not in ("Z", "X"):
            return True
    return False


def _stat(path: str) -> list[str]:
    """The fields of a /proc stat file after the command name (state, ppid, pgrp, ...)."""
    text = ""
    with contextlib.suppress(OSError), open(path) as stat:
        text = stat.read()
    return text[text.rfind(")") + 2 :].split() if text else []
