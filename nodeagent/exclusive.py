"""One process per directory: one agent per work dir, one `lockstep up` per var dir.

Two agents on one work dir share an identity (nodeagent.container.agent_identity): the second's
start-up sweep removes the first's live containers as stale, and the two take turns at the
node's registration, so the jobs there are killed and restarted and the node gets strikes. A
second `lockstep up` over the same var dir did that to both local agents, and also replaced the
first one's embedded Redis socket. A lock held for the process's life rules both out.

The lock is `flock(2)` on a file in the directory: the kernel drops it when the holder dies,
however it dies (SIGKILL included), so a crash never leaves a stale lock to clear by hand. The
file says who holds it (pid, what, when), for the refusal's message; its descriptor is not
inherited by children (Python's default), so a worker or container left behind never holds it.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path

# The exit status of an agent that did not start because another holds its work dir (2 is a
# usage error, argparse's; 1 a refusal by the portal).
EXIT_WORK_DIR_HELD = 3


class HeldElsewhere(RuntimeError):
    """Another live process holds the lock; `holder` is what it wrote there (pid, what, since),
    empty if it had not written yet."""

    def __init__(self, path: Path, holder: dict):
        self.path = path
        self.holder = holder
        pid = holder.get("pid", "unknown")
        super().__init__(f"{path} is held by pid {pid} ({holder.get('what', 'another process')})")

    def describe(self) -> str:
        """'pid 1234 since 17:09:22' (what the refusal's message names)."""
        since = self.holder.get("since")
        when = time.strftime(" since %H:%M:%S", time.localtime(since)) if since else ""
        return f"pid {self.holder.get('pid', 'unknown')}{when}"


def hold(path: Path, what: str, **details) -> int:
    """Take the lock at `path` for this process's life and write who holds it (`what`, and any
    `details`: the portal's URL...). Returns the descriptor; closing it (or exiting) lets go.
    Raises HeldElsewhere if a live process holds it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read(fd)
        os.close(fd)
        raise HeldElsewhere(path, holder) from None
    except BaseException:
        os.close(fd)
        raise
    record = json.dumps({"pid": os.getpid(), "what": what, "since": time.time(), **details})
    os.ftruncate(fd, 0)
    os.pwrite(fd, record.encode() + b"\n", 0)
    return fd


def _read(fd: int) -> dict:
    try:
        text = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        found = json.loads(text) if text else {}
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}
