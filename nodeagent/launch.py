"""The launcher that runs inside a job's container: starts the node's ranks and reports on them.

The container runtime (nodeagent/container.py) starts one container per attempt and node, as
pyxis/enroot do: every local rank in one PID and IPC namespace, so CUDA IPC between local ranks
works. The engine's init process (`--init`) is PID 1 and forwards signals to this launcher,
which forwards them to the ranks, so the agent's stop (SIGTERM) is still a checkpoint-first stop
and its stack-dump request (SIGUSR1) still reaches every rank.

Standard library only, and no import of the agent: this file (with nodeagent/zygote.py beside
it, for the warm mode) is mounted read-only into images that hold nothing of Lockstep, and runs
under the image's own `python3`.

    python3 launch.py SPEC.json                 # one attempt, then exit
    python3 launch.py --serve DIR [--preload M,M] [--idle-s S]

The second form is the warm container (nodeagent/warm_container.py): one container per job and
node that outlives its attempts. It imports the heavy modules once (torch, and what the image's
`lockstep.preload` label names), then runs each attempt whose spec the agent drops into DIR as
`request-<attempt>.json`, forking the ranks from itself where it can (nodeagent/zygote.py's
rules: `python -m X` or `python SCRIPT` with OMP_NUM_THREADS set), so a restart of the same job
on the same node skips both the container's start and every rank's imports. It says where it
stands in DIR/warm.json and exits after S seconds without an attempt.

SPEC: {"command": [...], "status": PATH, "ranks": [{"rank": 0, "env": {...}, "log": PATH,
"command": [...] (optional: this rank's own, with $(NAME) expanded)}]}.
Every rank gets the container's environment (the image's PATH, ...) plus its own `env`. The
status file is rewritten atomically on every change: {"ranks": {"0": {"pid", "state",
"exit_code", "exited_at"}}, "done": bool}; exit codes are Popen's (negative for a signal).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time

POLL_S = 0.05
CPU_EVERY_S = 1.0  # how often the ranks' CPU time is read into the status file
# The shell's convention, as the process runtime reports them.
EXIT_NOT_FOUND = 127
EXIT_NOT_EXECUTABLE = 126
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class Launcher:
    def __init__(self, spec: dict, *, base_env: dict | None = None, fork=None) -> None:
        self.command = [str(part) for part in spec["command"]]
        self.status_path = spec["status"]
        self.ranks = spec["ranks"]
        self.base_env = dict(os.environ if base_env is None else base_env)
        # fork(argv, env, log) -> a started rank (pid, poll()) or None to start it plainly.
        self.fork = fork
        self.procs: dict[int, subprocess.Popen[bytes] | Forked] = {}
        self.report: dict[str, dict] = {}

    def start(self) -> None:
        for entry in self.ranks:
            rank = int(entry["rank"])
            env = {**self.base_env, **{str(k): str(v) for k, v in entry["env"].items()}}
            # The agent expanded $(NAME) per rank; a spec without it runs the shared command.
            command = [str(part) for part in entry.get("command") or self.command]
            forked = self.fork(command, env, entry["log"]) if self.fork else None
            if forked is not None:
                self.procs[rank] = forked
                self.report[str(rank)] = {"pid": forked.pid, "state": "running", "exit_code": None}
                continue
            with open(entry["log"], "ab") as log:
                try:
                    proc = subprocess.Popen(
                        command,
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
                    log.write(f"lockstep launcher: cannot start {command!r}: {exc}\n".encode())
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
                if signum == signal.SIGUSR1 and not catches(proc.pid, signum):
                    continue  # a stack dump asked of a script that cannot give one: no kill
                if signum == signal.SIGKILL:  # the agent's kill (fencing): the whole group
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    continue
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGTERM if signum == signal.SIGINT else signum)

    def run(self, *, install_handlers: bool = True, signals=None) -> int:
        """Start the ranks, report on them until all exited. `signals()`, if given, returns
        the signals sent to this attempt since the last call (the warm server's files)."""
        if install_handlers:
            for sig in FORWARDED:
                signal.signal(sig, self.forward)
        early = signals() if signals else []
        if any(sig in (signal.SIGTERM, signal.SIGINT, signal.SIGKILL) for sig in early):
            # Stopped before it started: nothing ran, so there is nothing to save.
            code = -signal.SIGKILL if signal.SIGKILL in early else -signal.SIGTERM
            for entry in self.ranks:
                self.report[str(int(entry["rank"]))] = _exited(None, code)
            self.write(done=True)
            return 0
        self.start()
        cpu_read_at = 0.0
        while any(r["state"] != "exited" for r in self.report.values()):
            for sig in signals() if signals else ():
                self.forward(sig, None)
            changed = False
            if time.monotonic() - cpu_read_at >= CPU_EVERY_S:
                cpu_read_at = time.monotonic()
                self.read_cpu()
                changed = True
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

    def read_cpu(self) -> None:
        running = {
            r: p.pid for r, p in self.procs.items() if self.report[str(r)]["state"] != "exited"
        }
        used = session_cpu_seconds(set(running.values()))
        for rank, pid in running.items():
            self.report[str(rank)]["cpu_s"] = round(used[pid], 2)

    def write(self, *, done: bool) -> None:
        tmp = f"{self.status_path}.tmp"
        with open(tmp, "w") as out:
            json.dump({"ranks": self.report, "done": done}, out)
        os.replace(tmp, self.status_path)


def catches(pid: int, signum: int) -> bool:
    """Whether the process has a handler for `signum` (its SigCgt mask in /proc). A stack-dump
    request (SIGUSR1) to a script without one would kill it: SIGUSR1's default action."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def session_cpu_seconds(sessions: set[int]) -> dict[int, float]:
    """CPU seconds (user + system, reaped children's included) used so far by every process
    of each session, by session id. A rank is its own session (started with setsid), so this
    is the rank with its data loaders and helpers: a progress signal that needs no help from
    the script (the agent reads it for plain processes; this launcher, for a container's ranks,
    whose pids the host cannot map)."""
    tick = os.sysconf("SC_CLK_TCK")
    used = dict.fromkeys(sessions, 0.0)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        session = int(fields[3])
        if session in used:
            used[session] += sum(int(f) for f in fields[11:15]) / tick
    return used


def _exited(pid: int | None, code: int) -> dict:
    return {"pid": pid, "state": "exited", "exit_code": code, "exited_at": time.time()}


class Forked:
    """A rank forked from the warm server, with the part of Popen the launcher uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            with contextlib.suppress(ChildProcessError):
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


class Server:
    """The warm container's main loop (see the module's docstring). `zygote` is
    nodeagent/zygote.py, mounted beside this file: its worker set-up and its fork rules."""

    def __init__(self, serve_dir: str, preload: list[str], idle_s: float, zygote) -> None:
        self.dir = serve_dir
        self.preload = preload
        self.idle_s = idle_s
        self.zygote = zygote
        # What a rank inherits: the container's environment as the image set it, not the
        # thread limits the server sets for its own imports below, nor its room.
        self.base_env = {k: v for k, v in os.environ.items() if k != zygote.ROOM_VAR}
        self.forking = False
        self.loaded: list[str] = []
        self.launcher: Launcher | None = None

    def warm_up(self) -> None:
        """Import the heavy modules once; forking is on only if that left one thread (fork
        copies only the calling thread: a lock another thread held would stay held)."""
        os.environ.update(self.zygote.SINGLE_THREADED)
        for name in self.preload:
            try:
                __import__(name)
                self.loaded.append(name)
            except Exception as exc:  # a module that cannot load is simply not warm
                print(f"lockstep launcher: cannot preload {name}: {exc}", file=sys.stderr)
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            # A CUDA context does not survive fork: the ranks start fresh instead.
            print("lockstep launcher: a preloaded module initialised CUDA; no warm start",
                  file=sys.stderr)  # fmt: skip
            return
        self.forking = self.zygote._threads() == 1

    def fork(self, argv: list[str], env: dict, log: str) -> Forked | None:
        """A rank forked from this server, or None to start it plainly: what a fresh
        `python3` of this image would run the same way (`python` on the rank's PATH is this
        interpreter, and the zygote's rules: a module or a script, no interpreter options,
        the thread count given, the same PYTHON* variables)."""
        found = shutil.which(argv[0], path=env.get("PATH")) if argv else None
        if not self.forking or found is None:
            return None
        if os.path.realpath(found) != os.path.realpath(sys.executable):
            return None
        argv = [sys.executable, *argv[1:]]
        if not self.zygote.can_fork(argv, env, self.base_env):
            return None
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            for sig in FORWARDED:  # the server's forwarding is not the rank's to run
                signal.signal(sig, signal.SIG_DFL)
            try:
                code = self.zygote._run_worker(argv, env, log)
            except BaseException:  # noqa: BLE001 - nothing may return into the server's loop
                code = 1
            os._exit(code)
        return Forked(pid)

    def forward(self, signum: int, frame: object) -> None:
        if self.launcher is not None:
            self.launcher.forward(signum, frame)

    def signals(self, attempt: int) -> list[int]:
        """The signals the agent sent this attempt (signal-<attempt>-<n>.json), each once;
        those left for earlier attempts are dropped."""
        found = []
        for name in sorted(os.listdir(self.dir)):
            if not (name.startswith("signal-") and name.endswith(".json")):
                continue
            target = name.split("-")[1]
            path = os.path.join(self.dir, name)
            if target == str(attempt):
                try:
                    with open(path) as sent:
                        found.append(int(json.load(sent)["signal"]))
                except (OSError, ValueError, KeyError):
                    continue  # not all there yet: the agent renames a finished one into place
            elif not target.isdigit() or int(target) > attempt:
                continue  # for an attempt still to come
            with contextlib.suppress(OSError):
                os.unlink(path)
        return found

    def next_request(self) -> dict | None:
        names = sorted(
            (n for n in os.listdir(self.dir) if n.startswith("request-") and n.endswith(".json")),
            key=lambda n: int(n[len("request-") : -len(".json")] or 0),
        )
        for name in names:
            path = os.path.join(self.dir, name)
            try:
                with open(path) as spec_file:
                    spec = json.load(spec_file)
            except (OSError, ValueError):
                continue  # being written (the agent renames a finished one into place)
            os.unlink(path)
            return spec
        return None

    def state(self, state: str, attempt: int | None = None) -> None:
        tmp = os.path.join(self.dir, "warm.json.tmp")
        with open(tmp, "w") as out:
            json.dump(
                {
                    "state": state,
                    "attempt": attempt,
                    "preloaded": self.loaded,
                    "forking": self.forking,
                    "pid": os.getpid(),
                    "at": time.time(),
                },
                out,
            )
        os.replace(tmp, os.path.join(self.dir, "warm.json"))

    def run(self) -> int:
        for sig in FORWARDED:
            signal.signal(sig, self.forward)
        self.warm_up()
        idle_since = time.monotonic()
        self.state("idle")
        while True:
            spec = self.next_request()
            if spec is None:
                if time.monotonic() - idle_since > self.idle_s:
                    self.state("exited")
                    return 0
                time.sleep(POLL_S)
                continue
            attempt = int(spec.get("attempt") or 0)
            self.state("busy", attempt)
            self.launcher = Launcher(spec, base_env=self.base_env, fork=self.fork)
            sent = functools.partial(self.signals, attempt)
            self.launcher.run(install_handlers=False, signals=sent)
            self.launcher = None
            idle_since = time.monotonic()
            self.state("idle")


def main(argv: list[str]) -> int:
    if len(argv) >= 3 and argv[1] == "--serve":
        import lockstep_zygote as zygote  # nodeagent/zygote.py, mounted beside this file

        if zygote.ROOM_VAR not in os.environ:
            # Spare room in the server's command line and environment, which a forked rank
            # overwrites with its own, so that /proc shows the rank, not the server.
            room = {zygote.ROOM_VAR: zygote.ROOM_ENV}
            argv = [sys.executable, *argv, zygote.ROOM_ARG]
            os.execve(sys.executable, argv, {**os.environ, **room})
        options = dict(zip(argv[3::2], argv[4::2], strict=False))
        preload = [m for m in options.get("--preload", "").split(",") if m.strip()]
        idle_s = float(options.get("--idle-s", "600"))
        return Server(argv[2], preload, idle_s, zygote).run()
    if len(argv) != 2:
        print("usage: launch.py SPEC.json | launch.py --serve DIR [--preload M,M]", file=sys.stderr)
        return 2
    with open(argv[1]) as spec_file:
        return Launcher(json.load(spec_file)).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
