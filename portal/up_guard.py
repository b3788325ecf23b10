"""What `lockstep up` makes sure of before it starts anything: that it is the only one over its
var dir, that its port is free, and that nothing an earlier, killed `lockstep up` started over
the same var dir still runs.

A second `lockstep up` over the same var dir started agents of the same names and work dirs,
whose start-up removed the running agents' containers as stale (the demo job was killed three
times, its restarts spent, its nodes struck), and replaced the running Redis's socket with its
own, then removed it at its stop: so one runs per var dir (`refusal`). A `lockstep up` killed
with SIGKILL (or an OOM kill) cannot stop its children, which run in sessions of their own: the
portal kept the port, the agents their jobs, and the next start could only say the port was
taken. Those are stopped first, as its Ctrl-C would have (`stop_leftovers`).
"""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

from nodeagent import exclusive

# The exit status of a start refused before anything started (another `lockstep up` over the
# same var dir, or the port taken); 2 is a usage error (argparse), as for the agent.
EXIT_REFUSED = 3
_UP_LOCK: list[int] = []  # the var dir's lock, held until this process exits
# A killed `lockstep up`'s leftovers, stopped in its own stop's order and graces (agents first:
# they checkpoint-stop their jobs and tell the portal they leave; Redis last).
LEFTOVER_STAGES: tuple[tuple[str, float], ...] = (
    ("agent", 10.0),
    ("platform", 5.0),
    ("redis", 3.0),
)


# How each of up's own children is known by its command line (with LOCKSTEP_VAR_DIR=var in its
# environment: a user's shell that exports it is none of these).
ROLES: tuple[tuple[bytes, str], ...] = (
    (b"-m\0nodeagent\0", "agent"),
    (b"portal.asgi:application", "platform"),
    (b"manage.py\0rqworker\0", "platform"),
    (b"manage.py\0run_scheduler", "platform"),
)


def refusal(var: Path, port: int, url: str, say=print, check_only: bool = False) -> str | None:
    """Why this start must not go on, or None: then the var dir is this run's from now on,
    and what a killed `lockstep up` left running over it has been stopped (and said so).
    `check_only`: the lock alone, let go at once (`lockstep up --check`, which `make up` runs
    before it builds anything)."""
    try:
        held = exclusive.hold(var / "up.lock", "lockstep up", url=url)
    except OSError as exc:  # a var dir not ours, or a file system without flock
        return f"cannot lock {var / 'up.lock'}: {exc.strerror or exc}"
    except exclusive.HeldElsewhere as exc:
        pid = exc.holder.get("pid")
        where = exc.holder.get("url", "")
        how = f"Ctrl-C where it runs, or kill -INT {pid}" if pid else "Ctrl-C where it runs"
        return (
            f"already running over {var} ({exc.describe()}"
            + (f", {where}" if where else "")
            + f"): use it, or stop it first ({how}). A second one over the same state "
            "would stop its jobs; for another, set LOCKSTEP_VAR_DIR to a directory of its own."
        )
    if check_only:
        os.close(held)
        return None
    _UP_LOCK.append(held)
    found = leftovers(var)
    count = sum(len(pids) for pids in found.values())
    if count:
        say(
            f"  stopping {count} process(es) that an earlier lockstep up over {var} left "
            "running when it was killed (its agents first: their jobs checkpoint and requeue)",
            flush=True,
        )
        stop_leftovers(found)
    if not port_free(port):
        return (
            f"port {port} is taken by another program; stop it, or start on another port "
            f"(PORT={port + 1} make up, or lockstep up --port {port + 1})"
        )
    return None


def port_free(port: int) -> bool:
    """Whether daphne could listen on `port` (as it binds: with SO_REUSEADDR, so the old
    connections' TIME_WAIT after a stop does not count)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
            probe.listen()
        except OSError:
            return False
    return True


def leftovers(var: Path) -> dict[str, dict[int, int]]:
    """The processes an earlier `lockstep up` over `var` started and that still run, by stage
    (LEFTOVER_STAGES): pid -> start time. Called with the var dir's lock held, so that up is
    gone. Its children carry LOCKSTEP_VAR_DIR=var in their environment; its Redis, which it
    started with its own, is known by its socket."""
    marker = f"LOCKSTEP_VAR_DIR={var}".encode()
    socket_arg = f"unixsocket:{var / 'redis.sock'}".encode()
    found: dict[str, dict[int, int]] = {stage: {} for stage, _grace in LEFTOVER_STAGES}
    for pid, (_ppid, start) in process_table().items():
        if pid == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:  # gone, or another user's
            continue
        if socket_arg in cmdline:
            found["redis"][pid] = start
        elif marker in environ.split(b"\0"):
            stage = next((role for mark, role in ROLES if mark in cmdline + b"\0"), None)
            if stage is not None:
                found[stage][pid] = start
    return found


def stop_leftovers(found: dict[str, dict[int, int]]) -> None:
    """Stop `found` (`leftovers`), stage by stage as up's own stop does: SIGTERM, the stage's
    grace, then SIGKILL for what is left with its process group; last, SIGKILL for every
    process that was below them (an agent's workers and podman clients, a work horse)."""
    below: dict[int, int] = {}
    for stage, grace in LEFTOVER_STAGES:
        stage_pids = found[stage]
        below.update(_below(stage_pids))
        for pid in stage_pids:
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while alive(stage_pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        below.update(_below(stage_pids))
        for pid in alive(stage_pids):
            _signal(pid, signal.SIGKILL, group=True)
        deadline = time.monotonic() + 5
        while alive(stage_pids) and time.monotonic() < deadline:
            time.sleep(0.05)
    for pid in alive(below):
        _signal(pid, signal.SIGKILL)


def process_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, start time in clock ticks) of every live process, zombies left out."""
    table = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry.name}/stat").read_text(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z":
            table[int(entry.name)] = (int(fields[1]), int(fields[19]))
    return table


def descendants(root: int) -> dict[int, int]:
    """Every live process below `root` (children in sessions of their own included): pid ->
    start time, so a pid reused later is told apart."""
    return _walk([root], process_table())


def _below(pids: dict[int, int]) -> dict[int, int]:
    """Every live process below `pids` (the live ones of them): pid -> start time."""
    table = process_table()
    return _walk(alive(pids, table), table)


def _walk(roots: list[int], table: dict[int, tuple[int, int]]) -> dict[int, int]:
    children: dict[int, list[int]] = {}
    for pid, (ppid, _start) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = {}, list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            found[child] = table[child][1]
            todo.append(child)
    return found


def alive(pids: dict[int, int], table: dict[int, tuple[int, int]] | None = None) -> list[int]:
    """Those of `pids` still running (same pid and start time: a reused pid is not ours)."""
    table = process_table() if table is None else table
    return [pid for pid, start in pids.items() if table.get(pid, (0, None))[1] == start]


def _signal(pid: int, sig: int, group: bool = False) -> None:
    """`sig` to `pid`, and with `group` to its process group too where it leads one (each of
    up's children was started in a session of its own)."""
    try:
        if group and os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
