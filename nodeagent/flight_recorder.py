"""The ranks' flight recorders, read into a hang's evidence.

When the portal suspects a hang, the agent writes a byte to each rank's named pipe
(`<stem><rank>.pipe`, the stem in the rank's TORCH_NCCL_DEBUG_INFO_PIPE_FILE): NCCL's watchdog
answers by dumping the rank's flight recorder to `<stem><rank>` (TORCH_NCCL_DEBUG_INFO_TEMP_FILE),
and so does the reference trainer under gloo (trainer/flight_recorder.py). A dump NCCL wrote on
its own collective timeout is read too. Each dump is summarised per process group (the last
collective the rank entered, the last that completed, what the last one was) and appended to the
rank's log as one JSON line under MARKER, beside its stacks; the portal compares the ranks
(jobs/health.flight_recorder_verdict): the rank that never entered the collective its peers
wait in is named, with two ranks as with two thousand.

A dump is a pickle written by the job's own process, read here as root: it is unpickled with no
class allowed (the format is plain dicts, lists and numbers), from a regular file only, and only
up to MAX_DUMP_BYTES.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.flight_recorder import dump_path, pipe_path

MARKER = "lockstep agent: flight recorder of rank"
WAIT_S = 5.0  # NCCL's monitor reads its pipe about once a second; a dump of 2,000 entries is fast
MAX_DUMP_BYTES = 32 << 20


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"a flight-recorder dump holds no {module}.{name}")


def load(path: Path) -> dict[str, Any]:
    """A dump (pickle, or JSON where a job asked torch for JSON) as plain data. Raises
    ValueError for anything else: a link, a FIFO, a file too big, a class in the pickle."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError("not a regular file")
        if info.st_size > MAX_DUMP_BYTES:
            raise ValueError(f"{info.st_size} bytes, over {MAX_DUMP_BYTES}")
        with os.fdopen(os.dup(fd), "rb") as dump:
            data = dump.read(MAX_DUMP_BYTES + 1)
    finally:
        os.close(fd)
    try:
        loaded = json.loads(data) if data[:1] == b"{" else _PlainUnpickler(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, ValueError, EOFError, TypeError, IndexError) as exc:
        raise ValueError(f"not a flight-recorder dump ({exc})") from exc
    if not isinstance(loaded, dict):
        raise ValueError("not a flight-recorder dump (not a mapping)")
    return loaded


def _int(value: Any, default: int = -1) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def summarize(dump: dict[str, Any]) -> dict[str, Any]:
    """Per process group (by id): the last collective entered and completed, and what the
    last recorded collective was (its kind, sizes, state). Peer-to-peer entries are left out:
    their sequence numbers count pairs, not the group."""
    groups: dict[str, dict[str, Any]] = {}
    for pg_id, status in (dump.get("pg_status") or {}).items():
        if isinstance(status, dict):
            groups[str(pg_id)] = {
                "entered": _int(status.get("last_enqueued_collective")),
                "completed": _int(status.get("last_completed_collective")),
            }
    entries = dump.get("entries") or []
    for entry in entries if isinstance(entries, list) else ():
        if not isinstance(entry, dict) or entry.get("is_p2p"):
            continue
        group = groups.setdefault(str(entry.get("pg_id")), {"entered": -1, "completed": -1})
        seq = _int(entry.get("collective_seq_id"))
        if seq < group.get("last", {}).get("seq", -1):
            continue
        names = entry.get("process_group")
        group["desc"] = str(names[1]) if isinstance(names, list | tuple) and len(names) > 1 else ""
        group["last"] = {
            "seq": seq,
            "op": str(entry.get("profiling_name", "")),
            "sizes": entry.get("input_sizes") if isinstance(entry.get("input_sizes"), list) else [],
            "state": str(entry.get("state", "")),
        }
        # Where the status does not say (an older dump), the entries do.
        group["entered"] = max(group["entered"], seq)
        if entry.get("state") == "completed":
            group["completed"] = max(group["completed"], seq)
    return {"groups": groups, "entries": len(entries) if isinstance(entries, list) else 0}


def poke(pipe: Path) -> str | None:
    """One byte into a rank's dump pipe; None, or why not (no pipe: a script that serves none;
    no reader: the rank is gone or not listening)."""
    try:
        fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except FileNotFoundError:
        return "no dump pipe"
    except OSError as exc:
        return f"its dump pipe has no reader ({exc.strerror})"
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return "its dump pipe is not a pipe"
        os.write(fd, b"1")
    except OSError as exc:
        return f"its dump pipe refused ({exc.strerror})"
    finally:
        os.close(fd)
    return None


@dataclass(frozen=True)
class Target:
    rank: int
    pipe: Path | None
    dump: Path
    log: Path


def targets_of(workers: list[Any]) -> list[Target]:
    """The live ranks whose environment names a dump file (the agent sets one for every rank;
    a job may have set its own)."""
    found = []
    for worker in workers:
        env = worker.env or {}
        dump, pipe = dump_path(worker.rank, env), pipe_path(worker.rank, env)
        if worker.alive and dump:
            found.append(
                Target(worker.rank, Path(pipe) if pipe else None, Path(dump), worker.log_path)
            )
    return found


def _mtime(path: Path) -> float | None:
    try:
        return path.lstat().st_mtime
    except OSError:
        return None


class FlightRecorderDump:
    """Asks some ranks for their flight recorders and appends each one's summary to its log,
    in the background (the agent's loop never waits on it)."""

    def __init__(self, targets: list[Target], wait_s: float = WAIT_S):
        self._targets = targets
        self._wait_s = wait_s
        self._thread = threading.Thread(target=self._run, name="flight-recorder", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asked_at = time.time()
        before = {t.rank: _mtime(t.dump) for t in self._targets}
        waiting = {}
        for target in self._targets:
            why = poke(target.pipe) if target.pipe is not None else "no dump pipe"
            if why is None or before[target.rank] is not None:
                # Asked, or dumped already by NCCL's watchdog on a timeout: worth the wait.
                waiting[target.rank] = target
            # A rank with no pipe and no dump (a script under gloo) gets no line: its stacks
            # are the evidence.
        deadline = asked_at + self._wait_s
        while waiting:
            late = time.time() > deadline
            for rank, target in list(waiting.items()):
                mtime = _mtime(target.dump)
                if mtime is None or (mtime == before[rank] and not late):
                    continue
                # NCCL writes its dump in place: one that does not load yet may be half
                # written, and is read again until the deadline.
                summary = self._summary(target)
                if "error" not in summary or late:
                    self._append(target, summary)
                    del waiting[rank]
            if late:
                for target in waiting.values():
                    self._append(target, {"error": f"no dump within {self._wait_s:.0f} s"})
                return
            time.sleep(0.05)

    @staticmethod
    def _summary(target: Target) -> dict[str, Any]:
        try:
            return summarize(load(target.dump))
        except (OSError, ValueError) as exc:
            return {"error": str(exc)}

    @staticmethod
    def _append(target: Target, summary: dict[str, Any]) -> None:
        text = f"\n{MARKER} {target.rank}: {json.dumps(summary, separators=(',', ':'))}\n"
        fd = os.open(target.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()
