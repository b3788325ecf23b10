"""What the agent gathers when the portal suspects a hang, before the attempt is killed: each
rank's own stack dump (SIGUSR1, to the ranks that catch it: the reference trainer's
faulthandler), every rank's stacks read from outside (py-spy, nodeagent/stacks.py), and every
rank's flight recorder (nodeagent/flight_recorder.py). All of it lands in the ranks' logs, which
the heartbeat ships; the portal reads it there (jobs/actions/failures.py)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from typing import Any

from nodeagent.flight_recorder import FlightRecorderDump, targets_of
from nodeagent.launch import catches
from nodeagent.stacks import TIMEOUT_S as STACKS_TIMEOUT_S
from nodeagent.stacks import OutsideDump, py_spy
from nodeagent.workers import AttemptWorkers

Log = logging.Logger | logging.LoggerAdapter  # type: ignore[type-arg]

# The signal that asks a worker to write its threads' stacks to its log and carry on; the
# reference trainer registers faulthandler for it (trainer/train.py).
DUMP_SIGNAL = signal.SIGUSR1
# How long after the signal the dump counts as written. faulthandler writes it from inside the
# signal handler, but the process must first be scheduled to run it; a second is ample even on
# a busy node and costs nothing next to the hang detection that led to the dump.
DUMP_SETTLE_S = 1.0


def ask(attempt: AttemptWorkers, host_pids: dict[int, int], log: Log, calls: Any) -> None:
    """Start everything at once: the readers run in the background, the signals return.
    `host_pids`: rank -> host pid of the live ranks; `calls` (engine_calls.EngineCalls): a
    container's signal goes through the engine off the loop."""
    attempt.flight_dump = FlightRecorderDump(targets_of(attempt.workers))
    binary = py_spy()
    targets = [
        (w.rank, host_pids[w.rank], w.log_path) for w in attempt.workers if w.rank in host_pids
    ]
    if binary is not None and targets:
        attempt.outside_dump = OutsideDump(binary, targets)
    _signal(attempt, log, calls)


def _signal(attempt: AttemptWorkers, log: Log, calls: Any) -> None:
    signalled = []
    if attempt.container is not None:
        calls.signal(attempt.container, DUMP_SIGNAL)
        signalled = [w.rank for w in attempt.workers if w.alive]
    skipped = []
    for worker in attempt.workers if attempt.container is None else ():
        if worker.alive and worker.popen is not None:
            if not catches(worker.popen.pid, DUMP_SIGNAL):
                # A script without a handler would die of it (the default action), and
                # its end would read as a signal, not as the hang it is.
                skipped.append(worker.rank)
                continue
            # The worker only, not its process group: its helpers (data loaders, a shell)
            # have no handler for it, and SIGUSR1's default action would kill them.
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.popen.pid, DUMP_SIGNAL)
                signalled.append(worker.rank)
    log.info(
        "attempt %s: %s sent to ranks %s for a stack dump%s",
        attempt.attempt_id,
        signal.Signals(DUMP_SIGNAL).name,
        signalled,
        f" (not to ranks {skipped}: no handler for it)" if skipped else "",
    )


def settled(attempt: AttemptWorkers, now: float) -> bool:
    """True once the signal went out at least DUMP_SETTLE_S ago and the readers are done (or
    have had their time)."""
    sent_at = attempt.dump_sent_at
    if sent_at is None or now - sent_at < DUMP_SETTLE_S:
        return False
    readers = [r for r in (attempt.outside_dump, attempt.flight_dump) if r is not None]
    return all(r.done for r in readers) or now - sent_at > 2 * STACKS_TIMEOUT_S
