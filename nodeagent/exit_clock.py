"""When each worker process really exited, whatever the agent's loop was doing at the time.

The agent reaps its workers in the same loop that talks to the portal, so while a heartbeat
waits on a busy portal (seconds, under load) no exit is seen. The time a rank died decides which
rank a failed attempt blames (jobs/actions/failures.py): a rank killed first but stamped late
loses the blame to the peers whose collectives broke after it. This thread only watches: it
notes the moment a child becomes waitable (`waitid` with WNOWAIT leaves it for the loop to reap,
so `Popen` keeps its return code) and never touches anything else.
"""

from __future__ import annotations

import os
import threading
import time

WATCH_INTERVAL_S = 0.05


class ExitClock:
    """Notes the wall-clock time each watched child process became waitable."""

    def __init__(self, interval_s: float = WATCH_INTERVAL_S) -> None:
        self._interval_s = interval_s
        self._watched: dict[int, float | None] = {}  # pid -> exit time, once seen
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, pid: int) -> None:
        with self._lock:
            self._watched[pid] = None
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="exit-clock", daemon=True)
                self._thread.start()

    def exited_at(self, pid: int) -> float | None:
        """The time `pid` was seen exited, and forget it (the caller has reaped it, so the
        pid may be reused)."""
        with self._lock:
            return self._watched.pop(pid, None)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            with self._lock:
                pending = [pid for pid, seen in self._watched.items() if seen is None]
            for pid in pending:
                try:
                    # WNOWAIT: look, do not reap. The pid stays ours until the loop reaps it,
                    # and it forgets the pid here (exited_at) when it does.
                    info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
                except ChildProcessError:
                    continue  # already reaped by the loop
                if info is not None:
                    now = time.time()
                    with self._lock:
                        if pid in self._watched and self._watched[pid] is None:
                            self._watched[pid] = now
