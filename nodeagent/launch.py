"""The launcher that runs inside a job's container: starts the node's ranks and reports on them.

The container runtime (nodeagent/container.py) starts one container per attempt and node, as
pyxis/enroot do: every local rank in one PID and IPC namespace, so CUDA IPC between local ranks
works. The engine's init process (`--init`) is PID 1 and forwards signals to this launcher,
which forwards them to the ranks, so the agent's stop (SIGTERM) is still a checkpoint-first stop
and its stack-dump request (SIGUSR1) still reaches every rank.

Standard library only, and no import of the agent: this file is mounted read-only into images
that hold nothing of Lockstep, and runs under the image's own `python3`.

    python3 launch.py SPEC.json

SPEC: {"command": [...], "status": PATH, "ranks": [{"rank": 0, "env": {...}, "log": PATH}]}.
Every rank gets the container's environment (the image's PATH, ...) plus its own `env`. The
status file is rewritten atomically on every change: {"ranks": {"0": {"pid", "state",
"exit_code", "exited_at"}}, "done": bool}; exit codes are Popen's (negative for a signal).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

POLL_S = 0.05
# The shell's convention, as the process runtime reports them.
EXIT_NOT_FOUND = 127
EXIT_NOT_EXECUTABLE = 126
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class Launcher:
    def __init__(self, spec: dict) -> None:
        self.command = [str(part) for part in spec["command"]]
        self.status_path = spec["status"]
        self.ranks = spec["ranks"]
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.report: dict[str, dict] = {}

    def start(self) -> None:
        for entry in self.ranks:
            rank = int(entry["rank"])
            env = {**os.environ, **{str(k): str(v) for k, v in entry["env"].items()}}
            with open(entry["log"], "ab") as log:
                try:
                    proc = subprocess.Popen(
                        self.command,
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                except OSError as exc:
                    code = (
                        EXIT_NOT_EXECUTABLE if isinstance(exc, PermissionError) else EXIT_NOT_FOUND
                    )
                    log.write(f"lockstep launcher: cannot start {self.command!r}: {exc}\n".encode())
                    self.report[str(rank)] = _exited(None, code)
                    continue
            self.procs[rank] = proc
            self.report[str(rank)] = {"pid": proc.pid, "state": "running", "exit_code": None}
        self.write(done=False)

    def forward(self, signum: int, _frame: object) -> None:
        # The rank only, not its group: the trainer turns SIGTERM into "checkpoint at the next
        # step", and its helpers (data loaders) would just die and break that save.
        for rank, proc in self.procs.items():
            if self.report[str(rank)]["state"] != "exited":
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGTERM if signum == signal.SIGINT else signum)

    def run(self) -> int:
        for sig in FORWARDED:
            signal.signal(sig, self.forward)
        self.start()
        while any(r["state"] != "exited" for r in self.report.values()):
            changed = False
            for rank, proc in self.procs.items():
                if self.report[str(rank)]["state"] == "exited":
                    continue
                code = proc.poll()
                if code is None:
                    continue
                self.report[str(rank)] = _exited(proc.pid, code)
                # Leftover children of a finished rank would hold memory (and on a GPU node,
                # GPU memory) the scheduler already counts as free.
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                changed = True
            if changed:
                self.write(done=False)
            time.sleep(POLL_S)
        self.write(done=True)
        return 0

    def write(self, *, done: bool) -> None:
        tmp = f"{self.status_path}.tmp"
        with open(tmp, "w") as out:
            json.dump({"ranks": self.report, "done": done}, out)
        os.replace(tmp, self.status_path)


def _exited(pid: int | None, code: int) -> dict:
    return {"pid": pid, "state": "exited", "exit_code": code, "exited_at": time.time()}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: launch.py SPEC.json", file=sys.stderr)
        return 2
    with open(argv[1]) as spec_file:
        return Launcher(json.load(spec_file)).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
