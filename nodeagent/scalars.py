"""Scalars from any TensorBoard writer: what Lightning, the Hugging Face Trainer or a plain
`SummaryWriter` logs reaches the job's charts with no change to the script.

Where the files are: TensorBoard writes `events.out.tfevents.<time>.<host>.<pid>.<n>` files
wherever the script points it (Lightning: `<default_root_dir>/lightning_logs/version_N/`,
the Hugging Face Trainer: `<output_dir>/runs/<run>/`). The agent looks under the attempt's
checkpoint directory and under each live rank's working directory (through `/proc/<pid>/cwd`,
which reaches into a container too), a few levels deep. A file is this attempt's when the pid in
its name is one of the node's ranks (the pid as the rank sees it: inside a container, the
container's) and the time in its name is not before the attempt's launch; stale files of
earlier runs in the same directory are left alone.

How they are read: TensorBoard's own reader (`EventFileLoader`), never a parser of ours. The
writer without TensorFlow opens and closes the file for every append, so there is no descriptor
to follow; the agent opens each file once and reads it through its own descriptor
(`/proc/self/fd/N`), which keeps working after the rank has exited and its container is gone.

Delivery is the same as the metrics file's: records stay pending until a heartbeat that carried
them is accepted (`ack`), and reading pauses while MAX_PENDING are held.
"""

from __future__ import annotations

import logging
import math
import os
import re
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger("nodeagent.scalars")

# torch.utils.tensorboard and tensorboardX both name files this way (the host may hold dots).
EVENT_FILE = re.compile(r"^events\.out\.tfevents\.(\d+)\.(.+)\.(\d+)\.(\d+)")
SCAN_EVERY_S = 5.0
DCP_STEP = re.compile(r"^step-\d+$")
SCAN_DEPTH = 4  # lightning_logs/version_0/ and out/runs/<run>/ are two and three deep
SCAN_MAX_ENTRIES = 5000  # per root and scan: a working directory may be a whole repository
# Never searched: where no script's logs live, and where a walk would cost the most.
SKIP_DIRS = frozenset({"__pycache__", "node_modules", "site-packages", "venv", "wandb"})
MAX_FILES = 64  # per attempt and node: a run logs to a handful
MAX_PENDING = 20_000
MAX_READ = 5_000  # per heartbeat and rank: ~100 bytes each


@dataclass(frozen=True)
class EventFileName:
    created: int  # epoch seconds, from the name
    pid: int  # the writer's pid in its own namespace

    @classmethod
    def parse(cls, name: str) -> EventFileName | None:
        match = EVENT_FILE.match(name)
        return cls(int(match.group(1)), int(match.group(3))) if match else None


def find_event_files(root: str | os.PathLike[str], depth: int = SCAN_DEPTH) -> list[Path]:
    """Event files under root, at most `depth` directories down, skipping hidden directories
    and SKIP_DIRS, and giving up after SCAN_MAX_ENTRIES entries."""
    found: list[Path] = []
    budget = SCAN_MAX_ENTRIES
    level = [Path(root)]
    for _ in range(depth + 1):
        below: list[Path] = []
        for directory in level:
            try:
                entries = list(os.scandir(directory))
            except OSError:
                continue
            budget -= len(entries)
            for entry in entries:
                try:
                    if entry.is_dir(follow_symlinks=False):
                        if not (
                            entry.name.startswith(".")
                            or entry.name in SKIP_DIRS
                            or DCP_STEP.match(entry.name)  # the reference trainer's shards
                        ):
                            below.append(Path(entry.path))
                    elif entry.name.startswith("events.out.tfevents.") and entry.is_file(
                        follow_symlinks=False
                    ):
                        found.append(Path(entry.path))
                except OSError:
                    continue
            if budget <= 0:
                return found
        level = below
    return found


class _EventFile:
    """One event file, read forward through the agent's own descriptor."""

    def __init__(self, path: Path, rank: int) -> None:
        from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

        self.rank = rank
        # The agent may run as root in a directory the job controls: never follow a link (to
        # another team's files), never block on a FIFO, read regular files only.
        self.fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            if not stat.S_ISREG(os.fstat(self.fd).st_mode):
                raise OSError(f"{path.name} is not a regular file")
            self.loader = EventFileLoader(f"/proc/self/fd/{self.fd}")
        except BaseException:
            os.close(self.fd)
            raise
        self.events = self.loader.Load()
        self.exhausted = False
        # Tags known to be scalars: a TF2-style writer puts the plugin's name on a tag's first
        # event only.
        self.scalar_tags: set[str] = set()

    def records(self, limit: int) -> list[dict[str, Any]]:
        """Up to `limit` scalar records appended since the last call."""
        from tensorboard.util import tensor_util

        out: list[dict[str, Any]] = []
        while len(out) < limit:
            try:
                event = next(self.events)
            except StopIteration:
                # The loader stops at the end of what is written; a new Load() goes on from
                # there next time (a record cut half-way is read again whole).
                self.events = self.loader.Load()
                self.exhausted = True
                return out
            for value in event.summary.value:
                # The reader turns every scalar (simple_value or a scalar tensor) into the
                # scalars plugin's tensor form.
                if value.metadata.plugin_data.plugin_name == "scalars":
                    self.scalar_tags.add(value.tag)
                elif value.tag not in self.scalar_tags:
                    continue
                array = tensor_util.make_ndarray(value.tensor)
                if array.size != 1:
                    continue
                number = float(array.item())
                wall = float(event.wall_time)
                out.append(
                    {
                        "kind": "scalar",
                        "rank": self.rank,
                        "step": int(event.step),
                        "name": value.tag,
                        "value": number if math.isfinite(number) else None,
                        # The heartbeat is strict JSON: a non-finite time would stop it.
                        **({"time": wall} if math.isfinite(wall) and 0 < wall < 1e11 else {}),
                    }
                )
        self.exhausted = False
        return out

    def close(self) -> None:
        os.close(self.fd)


class ScalarTail:
    """The scalars of one attempt's ranks on this node."""

    def __init__(
        self,
        checkpoint_dir: str | os.PathLike[str] | None,
        started: float,
        log: logging.Logger | logging.LoggerAdapter | None = None,  # type: ignore[type-arg]
        clock: Any = time.monotonic,
    ) -> None:
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else None
        self.started = started  # epoch seconds of the launch
        self._log = log or logger
        self._clock = clock
        self._scanned_at: float | None = None
        self._files: dict[tuple[int, int], _EventFile] = {}  # (st_dev, st_ino)
        self._pending: list[dict[str, Any]] = []
        self.at_eof = True

    def discover(self, rank_pids: Any, final: bool = False) -> None:
        """Look for new event files: under the checkpoint directory at every call, under the
        ranks' working directories at most every SCAN_EVERY_S (always when `final`).
        rank_pids: a callable or a dict, rank -> (its pid as it sees it, its pid on this
        host), None where unknown."""
        # The checkpoint directory (where the docs tell scripts to log) at every heartbeat, so
        # a run that crashes seconds after it began logging still has its scalars shipped
        # before another rank's failure ends the attempt (reports of an ended attempt are not
        # taken); the ranks' working directories, a bigger walk, every SCAN_EVERY_S.
        now = self._clock()
        walk_cwd = final or self._scanned_at is None or now - self._scanned_at >= SCAN_EVERY_S
        if walk_cwd:
            self._scanned_at = now
        ranks = rank_pids() if callable(rank_pids) else rank_pids
        by_pid = {inner: rank for rank, (inner, _) in ranks.items() if inner is not None}
        roots = [self.checkpoint_dir] if self.checkpoint_dir else []
        if walk_cwd:
            roots += [Path(f"/proc/{host}/cwd") for _, host in ranks.values() if host is not None]
        for root in roots:
            for path in find_event_files(root):
                if len(self._files) >= MAX_FILES:
                    return
                name = EventFileName.parse(path.name)
                if name is None or name.pid not in by_pid or name.created < self.started - 5:
                    continue
                try:
                    st = path.stat()
                    key = (st.st_dev, st.st_ino)
                    if key not in self._files:
                        self._files[key] = _EventFile(path, by_pid[name.pid])
                        self._log.info("rank %d's scalars: %s", by_pid[name.pid], path)
                except (OSError, ImportError, ValueError) as exc:
                    self._log.warning("cannot read %s: %s", path, exc)

    def read(self, final: bool = False) -> tuple[list[dict[str, Any]], int]:
        """(records, how many to ack if they are accepted). `final`: the writers have exited,
        so what is not read yet is read now (still within MAX_PENDING)."""
        for event_file in self._files.values():
            room = MAX_PENDING - len(self._pending)
            if room <= 0:
                break
            try:
                self._pending += event_file.records(room)
            except Exception as exc:  # a corrupt file must not stop the heartbeat
                self._log.warning("stopped reading an event file: %s", exc)
                event_file.exhausted = True
        out = self._pending[:MAX_READ]
        self.at_eof = len(out) == len(self._pending) and all(
            f.exhausted for f in self._files.values()
        )
        return out, len(out)

    def ack(self, count: int) -> None:
        del self._pending[:count]

    def close(self) -> None:
        for event_file in self._files.values():
            event_file.close()
        self._files.clear()
