"""Stacks sampled from outside: py-spy reads a rank's Python (and native) stacks from its memory,
with no help from the script.

The trainer dumps its own stacks on SIGUSR1 (faulthandler); any other script has no handler, and
the signal's default action would kill it. So when the portal asks for stacks (a hang), the
agent also runs `py-spy dump` on every live rank, in the background (the agent's loop never
waits on it), and appends what it prints to the rank's log under a header the portal looks for
(`MARKER`). Native frames (`--native`: where a rank sits inside NCCL, gloo or a CUDA call) where
py-spy can unwind them; inside a container it often cannot, and the Python stacks come alone.

py-spy needs ptrace rights over the rank: the agent runs as root (it must, to start containers
as the teams' uids), or as the ranks' own user under the process runtime.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

MARKER = "lockstep agent: stacks of rank"
LOOKUP_WAIT_S = 2.0  # how long the loop waits for a fresh container pid lookup (see there)
TIMEOUT_S = 4.0  # per try; a dump of a torch process with native frames took 0.65 s here


def py_spy() -> str | None:
    """The py-spy binary (a dependency: it lands next to this interpreter), else on PATH."""
    here = str(Path(sys.executable).parent)
    return shutil.which("py-spy", path=os.pathsep.join([here, os.environ.get("PATH", "")]))


def dump(binary: str, pid: int, timeout_s: float = TIMEOUT_S) -> str:
    """py-spy's dump of one process: with native frames if it can unwind them, else without;
    and, for a process that cannot be paused (one frozen by SIGSTOP: py-spy then prints its
    header and no thread), read without pausing it (`--nonblocking`)."""
    failure = ""
    for flags in (["--native"], [], ["--nonblocking"]):
        try:
            done = subprocess.run(
                [binary, "dump", *flags, "--pid", str(pid)],
                capture_output=True,
                text=True,
                timeout=timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return f"(py-spy did not answer within {timeout_s:.0f} s)\n"
        if done.returncode == 0 and "\nThread " in done.stdout:
            return done.stdout
        if done.returncode == 0:
            failure = "no thread in its dump"
            continue
        lines = (done.stderr or done.stdout).strip().splitlines()
        # py-spy follows its error with a Rust backtrace: the "Error:" line says what failed.
        failure = next((line for line in lines if line.startswith("Error")), "") or (
            lines[-1] if lines else f"exit {done.returncode}"
        )
    return f"(py-spy could not read the stacks: {failure})\n"


def process_state(pid: int) -> str:
    """The process's state letter from /proc (R running, S sleeping, D uninterruptible, T
    stopped, t traced, Z zombie), or '?' if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return "?"


class OutsideDump:
    """py-spy dumps of some ranks, each appended to its rank's log when it is done."""

    def __init__(self, binary: str, targets: list[tuple[int, int, Path]]):
        """targets: (rank, host pid, log path)."""
        self._threads = [
            threading.Thread(
                target=self._one, args=(binary, *target), name=f"py-spy-{target[0]}", daemon=True
            )
            for target in targets
        ]
        for thread in self._threads:
            thread.start()

    @staticmethod
    def _one(binary: str, rank: int, pid: int, log: Path) -> None:
        # Its scheduler state first (before py-spy may pause it): a rank frozen by SIGSTOP
        # ("T") or stuck in the kernel ("D") is told apart by that alone.
        state = process_state(pid)
        text = (
            f"\n{MARKER} {rank}, read from outside (py-spy dump), process state {state}\n"
            f"{dump(binary, pid)}"
        )
        # One append in one write: the rank may be writing its own lines meanwhile.
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, text.encode("utf-8", errors="replace"))
        finally:
            os.close(fd)

    @property
    def done(self) -> bool:
        return not any(thread.is_alive() for thread in self._threads)


def container_host_pids(init_pid: int, container_pids: set[int]) -> dict[int, int]:
    """Host pids of the given pids of a container's namespace: the processes under the
    container's init (`init_pid`, a host pid) whose innermost NSpid is one of them."""
    parents, inner = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        pid = int(entry)
        parents[pid] = int(fields.get("PPid", "0").strip() or 0)
        nspids = fields.get("NSpid", "").split()
        if len(nspids) > 1 and int(nspids[-1]) in container_pids:
            inner[pid] = int(nspids[-1])
    found = {}
    for pid, inside in inner.items():
        ancestor, hops = pid, 0
        while ancestor > 1 and ancestor != init_pid and hops < 64:
            ancestor, hops = parents.get(ancestor, 0), hops + 1
        if ancestor == init_pid:
            found[inside] = pid
    return found


def rank_pids(
    attempt: Any, engine: Any, log: Any, calls: Any
) -> dict[int, tuple[int | None, int | None]]:
    """rank -> (its pid as it sees itself, its pid on this host, None once it exited or while
    it is not known) for the attempt's (a workers.AttemptWorkers) started ranks. Inside a
    container the two differ; the host pids are found under the container's init, whose pid
    the engine is asked once (off the loop through `calls`, engine_calls.EngineCalls: until
    it answers the host pids are None)."""
    started = [w for w in attempt.workers if w.pid is not None]
    if attempt.container is None:
        return {w.rank: (w.pid, w.pid if w.alive else None) for w in started}
    missing = {w.pid for w in started if w.alive} - set(attempt.host_pids)
    if missing:
        # The launcher's pids are the container's; /proc here knows them by host pids.
        init = _container_init(attempt, engine, log, calls)
        if init:
            attempt.host_pids.update(container_host_pids(init, missing))
    return {w.rank: (w.pid, attempt.host_pids.get(w.pid) if w.alive else None) for w in started}


def _container_init(attempt: Any, engine: Any, log: Any, calls: Any) -> int | None:
    """The host pid of the attempt's container's init: it lives as long as the container, so
    the first answer is kept (`attempt.container_init`)."""
    if attempt.container_init or engine is None:
        return attempt.container_init
    lookup = attempt.init_lookup
    if lookup is None:
        # A fresh lookup is waited for a little: it takes some 50 ms, and a hang's dump that
        # asks now should reach the ranks; a wedged engine costs the loop this much per try.
        lookup = attempt.init_lookup = calls.container_pid(engine, attempt.container.name)
        calls.settle(lookup, LOOKUP_WAIT_S)
    if not lookup.done:
        return None
    attempt.init_lookup = None  # asked again at the next poll unless it answered
    if lookup.error is not None:
        log.warning("attempt %s: no container pid (%s)", attempt.attempt_id, lookup.error)
    elif lookup.result:
        attempt.container_init = lookup.result
    return attempt.container_init
