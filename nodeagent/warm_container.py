"""Warm containers: a job's container on a node outlives its attempt, so a restart there is fast.

A restart in the container runtime used to pay a container start and every rank's imports of
torch again (5.6 s from launch to first step for 4 ranks, against 1.7 s for the process
runtime's zygote; docs/runtime.md). The agent therefore starts a job's container as a server
(`launch.py --serve`, inside the image): it imports the heavy modules once, runs the attempt
whose spec the agent drops into the job's directory, and stays up afterwards. The job's next
attempt on this node, if its container would be started exactly the same way (same image id,
same GPUs, same mounts and limits: the same `run_argv` but for the attempt's name), is handed to
that server, which forks its ranks warm.

What a warm container holds while idle is CPU memory only (an interpreter with torch imported;
no GPU context: the server never initialises CUDA, so the forked ranks can). It goes away when:
- it has been idle for `idle_s` (LOCKSTEP_WARM_CONTAINER_IDLE_S, default 600 s; the server
  itself exits at twice that, in case the agent is gone);
- another attempt starts on any of its GPUs (those GPUs are someone else's now, so its job will
  not restart here on them soon);
- its job's next attempt here needs a different container (new image, other GPUs);
- an attempt in it is killed (a stop's deadline, fencing) and the server does not report its
  ranks dead within KILL_WAIT_S (the server kills a killed attempt's ranks itself, inside, and
  the container stays for the restart);
- the node comes back after the portal declared it lost (its jobs have moved on);
- the agent stops.
An agent that starts removes every container of its predecessors, warm ones included
(`WorkerSupervisor.remove_stale_containers`). The removals but the last run off the agent's
loop (nodeagent/engine_calls.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from nodeagent.container import ContainerAttempt, Engine
from nodeagent.engine_calls import EngineCalls
from nodeagent.workers import AttemptWorkers

DEFAULT_IDLE_S = 600.0
KILL_WAIT_S = 5.0  # for the server to report an attempt's ranks killed
# Imported by the server when the image does not say what is safe to import (its
# `lockstep.preload` label); a module the image lacks is skipped.
DEFAULT_PRELOAD = "torch,torch.distributed,torch.distributed.checkpoint"
PRELOAD_LABEL = "lockstep.preload"


class WarmAttempt(ContainerAttempt):
    """One attempt served by a warm container. Its signals (a stop's SIGTERM, the stack-dump
    SIGUSR1) go to this attempt, as files the server reads, not to the container: a signal to
    the container while the server was still importing, or between two attempts, would be lost
    or reach the wrong attempt. A stop that arrives before the server took the attempt up ends
    its ranks before they start."""

    signals_by_engine = False  # a file the server reads: quick, and kept in order on the loop

    def __init__(
        self, engine, name, status_path, popen, *, serve_dir: Path, attempt_id: int, calls
    ):
        super().__init__(engine, name, status_path, popen, calls)
        self.serve_dir = serve_dir
        self.attempt_id = attempt_id
        self._sent = 0

    def kill(self) -> bool:
        """SIGKILL this attempt's ranks (fencing, a stop's deadline) and keep the container
        for the job's next attempt, unless the server does not answer within KILL_WAIT_S:
        then the container goes, as a cold attempt's does. False unless that worked."""
        if self.engine_exit() is not None:
            # Its client is gone, but it may have died alone: the engine says (`rm --force`).
            return self.remove()
        self.signal(signal.SIGKILL)
        deadline = time.monotonic() + KILL_WAIT_S
        while time.monotonic() < deadline:
            if self.status(fresh=True).get("done"):
                return True
            if self.engine_exit() is not None:
                return self.remove()
            time.sleep(0.05)
        return self.remove()

    def signal(self, sig: int) -> None:
        self._sent += 1
        base = f"signal-{self.attempt_id}-{self._sent}"
        tmp = self.serve_dir / f".{base}.tmp"
        tmp.write_text(json.dumps({"signal": int(sig)}))
        with contextlib.suppress(OSError):
            os.chown(tmp, *(2 * [os.stat(self.serve_dir).st_uid]))  # the server deletes it
        tmp.replace(self.serve_dir / f"{base}.json")


def warm_key(argv: list[str], image_digest: str, gpus: list[int]) -> str:
    """What must match for an attempt to reuse a container: its command line with the
    attempt's own parts (its name and attempt label, given as attempt 0), the image id, and
    the GPUs (the slots, on a CPU node, whose command line names no device)."""
    return hashlib.sha256(json.dumps([argv, image_digest, gpus]).encode()).hexdigest()[:16]


@dataclass
class Warm:
    """One warm container: the job it serves, on which GPUs, and the attempts it ran."""

    job_id: int
    key: str
    gpus: frozenset[int]
    container: WarmAttempt  # its first attempt's; name, engine process and directory shared
    attempts: list[AttemptWorkers] = field(default_factory=list)
    idle_since: float | None = None

    @property
    def alive(self) -> bool:
        return self.container.engine_exit() is None

    @property
    def busy(self) -> bool:
        return any(not a.all_exited for a in self.attempts)


class WarmContainers:
    """The agent's warm containers on this node (the supervisor's loop calls `tick`)."""

    def __init__(
        self,
        engine: Engine,
        root: Path,
        *,
        idle_s: float = DEFAULT_IDLE_S,
        log=None,
        calls: EngineCalls | None = None,
    ) -> None:
        self.engine = engine
        # Removals run off the agent's loop there (nodeagent/engine_calls.py); None: here.
        self.calls = calls
        self.root = root
        self.idle_s = idle_s
        self.log = log
        self.warm: list[Warm] = []
        self._preload: dict[str, str] = {}  # image id -> modules to import

    def serve_dir(self, job_id: int) -> Path:
        return self.root / f"job-{job_id}"

    def preload(self, image: str, digest: str) -> str:
        if digest not in self._preload:
            label = self.engine.image_label(image, PRELOAD_LABEL)
            self._preload[digest] = label or DEFAULT_PRELOAD
        return self._preload[digest]

    def reusable(self, job_id: int, key: str) -> Warm | None:
        for warm in self.warm:
            if warm.job_id == job_id and warm.key == key and warm.alive and not warm.busy:
                return warm
        return None

    def names(self) -> set[str]:
        """This agent's warm containers (stale-container sweeps leave them alone)."""
        return {w.container.name for w in self.warm}

    def hand_over(self, warm: Warm, attempt: AttemptWorkers, spec: dict, uid: int) -> None:
        """Give the attempt to a running server: its spec appears as request-<attempt>.json
        in one rename (the server never reads half a file)."""
        self.request(warm.container.serve_dir, attempt.attempt_id, spec, uid)
        warm.attempts.append(attempt)

    @staticmethod
    def request(serve_dir: Path, attempt_id: int, spec: dict, uid: int) -> None:
        tmp = serve_dir / f".request-{attempt_id}.tmp"
        tmp.write_text(json.dumps(spec))
        with contextlib.suppress(OSError):
            os.chown(tmp, uid, uid)  # the server runs as the team and deletes it once read
        tmp.replace(serve_dir / f"request-{attempt_id}.json")

    def add(self, job_id: int, key: str, gpus: frozenset[int], attempt: AttemptWorkers) -> None:
        self.warm.append(Warm(job_id, key, gpus, attempt.container, attempts=[attempt]))

    def evict(self, gpus: frozenset[int]) -> None:
        """Remove the idle warm containers that hold any of these GPUs (a new container is
        about to start on them)."""
        for warm in list(self.warm):
            if warm.gpus & gpus and not warm.busy:
                self._remove(warm, "its GPUs start another container")

    def moved_on(self, keep: set[int]) -> None:
        """The node is back after the portal declared it lost: every warm container that
        served no attempt in `keep` (the desired ones) goes, busy or not (the agent fences
        its attempt, whose kill takes this removal's result), since its job has moved on."""
        for warm in list(self.warm):
            if not {a.attempt_id for a in warm.attempts} & keep:
                self._remove(warm, "the node was declared lost; its job has moved on")

    def tick(self) -> None:
        """Drop the containers that are gone; remove those idle for longer than idle_s."""
        now = time.monotonic()
        for warm in list(self.warm):
            if not warm.alive:
                self.warm.remove(warm)
            elif warm.busy:
                warm.idle_since = None
            elif warm.idle_since is None:
                warm.idle_since = now
            elif now - warm.idle_since > self.idle_s:
                self._remove(warm, f"idle for {self.idle_s:.0f} s")

    def close(self) -> None:
        for warm in list(self.warm):
            self._remove(warm, "the agent is stopping", wait=True)

    def _remove(self, warm: Warm, why: str, wait: bool = False) -> None:
        name = warm.container.name
        if self.log is not None:
            self.log.info("removing warm container %s: %s", name, why)
        if wait or self.calls is None:
            warm.container.remove()
        else:  # a failure is the engine's log line; a later start-up's sweep removes it
            self.calls.start(name, f"removing warm container {name}", warm.container.remove)
        self.warm.remove(warm)
