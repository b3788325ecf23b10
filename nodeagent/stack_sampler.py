"""Whether a rank's stacks change: a progress signal that needs nothing from the script.

A script that reports no steps is judged by what the platform sees (jobs/actions/activity.py):
its output, its CPU use, its GPU's. A rank that waits on I/O between short bursts of work
(reading shards from a slow store, polling a service) may print nothing and use little CPU for
minutes while it is plainly moving: its main thread is somewhere else each time it is looked
at. So while an attempt has reported no step, the agent reads each live rank's Python stack
from outside every `every_s` (py-spy, `--nonblocking`: the rank is not paused) and reports the
ranks whose main thread's stack differs from the previous reading; the portal counts that as
activity. A rank parked in one call (a collective that never returns, a sleep) reads the same
every time and counts for nothing.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable

from nodeagent.stacks import TIMEOUT_S, py_spy

DEFAULT_EVERY_S = 30.0


def main_thread_stack(text: str) -> tuple[str, ...]:
    """The frames of the main thread (else the first thread) in a py-spy dump, innermost first,
    with their line numbers; () if the dump has none."""
    lines = text.splitlines()
    threads = [i for i, line in enumerate(lines) if line.startswith("Thread ")]
    if not threads:
        return ()
    main = next((i for i in threads if '"MainThread"' in lines[i]), threads[0])
    frames = []
    for line in lines[main + 1 :]:
        if not line.startswith("    "):
            break
        frames.append(line.strip())
    return tuple(frames)


class StackSampler:
    """Samples some ranks' stacks in the background, at most every `every_s`."""

    def __init__(
        self, every_s: float = DEFAULT_EVERY_S, clock: Callable[[], float] = time.monotonic
    ):
        self.every_s = every_s
        self._clock = clock
        self._started_at: float | None = None
        self._thread: threading.Thread | None = None
        self._previous: dict[int, tuple[str, ...]] = {}
        self._changed: set[int] = set()
        self._lock = threading.Lock()

    def tick(self, pids: Callable[[], dict[int, int]]) -> set[int]:
        """Start a sample if one is due and none is running (`pids`: rank -> host pid of the
        live ranks, asked only then), and return the ranks seen to change since the last
        tick."""
        now = self._clock()
        idle = self._thread is None or not self._thread.is_alive()
        due = self._started_at is None or now - self._started_at >= self.every_s
        binary = py_spy() if idle and due and self.every_s > 0 else None
        if binary is not None:
            self._started_at = now
            targets = sorted(pids().items())
            self._thread = threading.Thread(
                target=self._sample, args=(binary, targets), name="stack-sampler", daemon=True
            )
            self._thread.start()
        with self._lock:
            changed, self._changed = self._changed, set()
        return changed

    def _sample(self, binary: str, targets: list[tuple[int, int]]) -> None:
        for rank, pid in targets:
            try:
                done = subprocess.run(
                    [binary, "dump", "--nonblocking", "--pid", str(pid)],
                    capture_output=True,
                    text=True,
                    timeout=TIMEOUT_S,
                    check=False,
                )
            except subprocess.TimeoutExpired:
                continue
            stack = main_thread_stack(done.stdout) if done.returncode == 0 else ()
            if not stack:
                continue  # gone, or unreadable: no evidence either way
            with self._lock:
                before = self._previous.get(rank)
                self._previous[rank] = stack
                if before is not None and before != stack:
                    self._changed.add(rank)
