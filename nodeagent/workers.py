"""What the agent knows about the workers of each attempt on its node, whichever runtime runs
them (plain processes, the zygote's forks, or a container's ranks)."""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Pull:
    """An image pull running in the background (the agent's loop never waits on one)."""

    image: str
    popen: subprocess.Popen[bytes]
    log: Path
    auth_file: Path | None = None  # the registry credential for this pull, if any
    started: float = field(default_factory=time.monotonic)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def detail(self) -> str:
        """The engine's last line of progress ("Copying blob ...")."""
        try:
            lines = self.log.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return lines[-1][:200] if lines else ""


@dataclass
class RankWorker:
    """One worker process (one rank) of an attempt."""

    rank: int
    local_rank: int
    gpu_index: int
    log_path: Path
    metrics_path: Path
    popen: Any  # subprocess.Popen, zygote.ForkedWorker or container.ContainerRank; None: not yet
    state: str = "starting"  # starting -> running -> exited
    exit_code: int | None = None
    # Wall-clock time the exit was seen (the agent polls every 0.25 s), so the portal can tell
    # when a failure happened, not only when a heartbeat carried it.
    exited_at: float | None = None
    env: dict[str, str] = field(default_factory=dict, repr=False)
    # CPU seconds its session has used so far (a progress signal that needs nothing from the
    # script); None until read.
    cpu_s: float | None = None

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen is not None else None

    @property
    def alive(self) -> bool:
        return self.state != "exited"

    def report(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "pid": self.pid,
            "state": self.state,
            "exit_code": self.exit_code,
            **({"exited_at": self.exited_at} if self.exited_at is not None else {}),
            **({"cpu_s": self.cpu_s} if self.cpu_s is not None and self.alive else {}),
        }


@dataclass
class AttemptWorkers:
    """The local workers of one attempt and how they are being brought down, if they are."""

    attempt_id: int
    launch: dict[str, Any]
    dir: Path
    workers: list[RankWorker] = field(default_factory=list)
    stop_deadline: float | None = None  # clock() time after which survivors get SIGKILL
    killed: bool = False
    # A kill sent whose effect is not yet seen (nodeagent/kill_confirm.py); None otherwise.
    pending_kill: Any = None  # kill_confirm.PendingKill
    dump_sent_at: float | None = None  # clock() time the stack-dump signal went out (once)
    outside_dump: Any = None  # stacks.OutsideDump: py-spy reading the ranks' stacks
    flight_dump: Any = None  # flight_recorder.FlightRecorderDump: the ranks' recorders
    # The container holding the ranks (container runtime); None for plain processes.
    container: Any = None  # container.ContainerAttempt
    # The image's inspect (engine_calls.Call) under way before the container can start or be
    # pulled, or after its pull (container runtime; `pulled`).
    image_check: Any = None
    # The image pull under way before the container can start (container runtime).
    pull: Pull | None = None
    pulled: bool = False
    # Why the attempt could not start at all on this node (a missing image): reported to the
    # portal, which fails the job at once instead of restarting it into the same wall.
    error: dict[str, str] | None = None
    image_digest: str = ""  # the image id the container ran (container runtime)
    pull_s: float = 0.0  # seconds spent pulling its image before the start
    # Container ranks' host pids by the pids the launcher reports (the container's own).
    host_pids: dict[int, int] = field(default_factory=dict)
    container_init: int | None = None  # the host pid of the container's init, once known
    init_lookup: Any = None  # engine_calls.Call asking the engine for it, while one runs
    launched_at: float = field(default_factory=time.time)  # epoch seconds

    @property
    def all_exited(self) -> bool:
        return all(not w.alive for w in self.workers)

    @property
    def preparing(self) -> bool:
        """Its image is still being inspected or pulled: no container yet."""
        return self.image_check is not None or self.pull is not None

    @property
    def stopping(self) -> bool:
        return self.stop_deadline is not None or self.killed
