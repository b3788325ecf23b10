"""Warm start: a process that has already imported torch and forks workers on request.

Most of a restart on a busy node is every rank importing torch and its checkpoint code: on a
2-core host with 4 ranks that is 5-10 s of the ~10 s from launch to first step, paid again by
every restart (docs/reliability.md). The agent therefore keeps one "zygote" per node: a child
interpreter that imports the heavy modules once (`PRELOAD`) and then, for each rank, forks a
worker that is already warm. Android starts apps the same way.

Only commands of the agent's own interpreter run this way (`python -m MODULE ...` or
`python SCRIPT ...` with no interpreter flags); anything else, or any trouble with the zygote,
falls back to a plain `subprocess.Popen`. What a forked worker gets is what Popen would give:
its own session (so the agent signals its whole group), stdin from /dev/null, stdout and stderr
to the rank's log, exactly the launch contract's environment, the agent's working directory,
default signal handlers, `sys.argv` and `sys.path[0]` as `python` would set them, and
`__main__` run by runpy. Process-wide state a fresh interpreter would not share with its
siblings is reset: the OpenMP thread count (libgomp read OMP_NUM_THREADS when torch was
imported in the zygote, so it is set again from the worker's environment) and the global RNGs
of `random` and numpy (reseeded from the OS).

The zygote is the workers' parent, so it reaps them and sends each exit status to the agent;
`ForkedWorker` gives the supervisor the `pid` / `poll()` / `wait()` of a Popen. When the agent
dies the zygote sees its socket close and exits; the workers live on as orphans, exactly as
Popen children would, for the next agent to fence (`WorkerSupervisor.reap_orphans`). The
zygote refuses to fork while it has more than one thread (fork copies only the calling thread,
and a lock held by another would stay held forever in the child).

Protocol (one JSON object per line over a socketpair): the agent sends
`{"id", "argv", "env", "log"}`; the zygote answers `{"id", "pid"}` or `{"id", "error"}`, and
later `{"exit": pid, "code": status}` with Popen's convention (negative for a signal).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path

logger = logging.getLogger("nodeagent.zygote")

# Room for a worker's command line and environment in what /proc shows (see _show_as).
ROOM_ARG = " " * 4096
ROOM_ENV = " " * 65536
ROOM_VAR = "LOCKSTEP_ZYGOTE_ROOM"
# One thread per math library while preloading: numpy's OpenBLAS and libgomp would otherwise
# start worker pools at import, and a process with threads must not fork. Workers only fork
# from it when they run with OMP_NUM_THREADS set too (can_fork).
SINGLE_THREADED = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint", "trainer.train")
REAP_EVERY_S = 0.05
# SIGINT's disposition as this interpreter started, before main() ignores it: the one a worker
# started cold would inherit from the agent.
_INHERITED_SIGINT = signal.getsignal(signal.SIGINT)


# -- the zygote process -----------------------------------------------------------------------


def serve(sock: socket.socket) -> None:
    """Preload, say ready, then fork workers on request and report their exits."""
    loaded = []
    for name in os.environ.get("LOCKSTEP_ZYGOTE_PRELOAD", ",".join(PRELOAD)).split(","):
        if name.strip():
            try:
                __import__(name.strip())
                loaded.append(name.strip())
            except Exception as exc:  # a module that cannot load is simply not warm
                print(f"lockstep zygote: cannot preload {name}: {exc}", file=sys.stderr)
    code = _code_stamp()
    _send(sock, {"ready": loaded, "threads": _threads()})
    buffer = b""
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ)
    while True:
        if selector.select(timeout=REAP_EVERY_S):
            data = sock.recv(1 << 20)
            if not data:  # the agent is gone
                return
            buffer += data
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                _serve_one(sock, json.loads(line), code)
        _reap(sock)


def _code_stamp() -> dict[str, float]:
    """Modification times of every module file loaded so far."""
    stamp = {}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if path:
            with contextlib.suppress(OSError):
                stamp[path] = os.stat(path).st_mtime
    return stamp


def _stale(code: dict[str, float]) -> str | None:
    """A preloaded file changed on disk since (a deploy): a fresh interpreter would run the new
    code, so forking this one would not be the same."""
    for path, mtime in code.items():
        try:
            if os.stat(path).st_mtime != mtime:
                return path
        except OSError:
            return path
    return None


def _serve_one(sock: socket.socket, request: dict, code: dict[str, float]) -> None:
    if _threads() > 1:
        _send(sock, {"id": request["id"], "error": "the zygote has threads; not forking"})
        return
    changed = _stale(code)
    if changed:
        _send(sock, {"id": request["id"], "error": f"stale: {changed} changed since preload"})
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        pid = os.fork()
    except OSError as exc:
        _send(sock, {"id": request["id"], "error": f"fork failed: {exc}"})
        return
    if pid == 0:
        try:
            sock.close()
            code = _run_worker(request["argv"], request["env"], request["log"])
        except BaseException:  # noqa: BLE001 - nothing may escape into the zygote's loop
            code = 1
        os._exit(code)
    _send(sock, {"id": request["id"], "pid": pid})


def _threads() -> int:
    """Threads of this process, native ones included (torch could start some)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = os.waitstatus_to_exitcode(status)
        _send(sock, {"exit": pid, "code": code, "at": time.time()})


def _run_worker(argv: list[str], env: dict[str, str], log: str) -> int:
    """In the forked child: become what `subprocess.Popen(argv, env=env, ...)` would have
    started, run its __main__, and return its exit status."""
    import runpy

    os.setsid()
    # The dispositions a fresh interpreter starts with: Python ignores SIGPIPE and SIGXFSZ (a
    # write to a closed socket raises BrokenPipeError instead of killing the process: with
    # SIGPIPE at its default, a rank whose gloo peer died was killed by the signal and blamed
    # for the peer's death), and SIGINT is what the zygote found when it started (the agent's
    # children inherit an ignored SIGINT, e.g. under nohup; else KeyboardInterrupt).
    for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_DFL)
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_IGN)
    signal.signal(signal.SIGINT, _INHERITED_SIGINT)
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(null)
    os.close(out)
    # New text streams on the new descriptors (the zygote's were set up for its own stdout);
    # line-buffered, so a rank's log is current even if it dies without flushing.
    sys.stdout = open(1, "w", buffering=1, closefd=False, encoding="utf-8", errors="replace")  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False, encoding="utf-8", errors="replace")  # noqa: SIM115
    os.environ.clear()
    os.environ.update(env)
    _show_as(argv, env)
    _reset_process_state(env)
    try:
        if argv[1] == "-m":
            sys.argv = [argv[2], *argv[3:]]  # runpy puts the module's path in argv[0]
            sys.path[0] = os.getcwd()
            _KEPT.append(runpy.run_module(argv[2], run_name="__main__", alter_sys=True))
        else:
            sys.argv = argv[1:]
            sys.path[0] = str(Path(argv[1]).resolve().parent)
            _KEPT.append(runpy.run_path(argv[1], run_name="__main__"))
        code = 0
    except SystemExit as exc:
        _KEPT.append(exc)  # its traceback holds the script's frames, and so its globals
        code = _exit_status(exc.code)
    except BaseException as exc:  # noqa: BLE001 - report like the interpreter would
        import traceback

        _KEPT.append(exc)
        traceback.print_exc()
        code = 1
    _finalize()
    return code


# What the worker's script left behind (its globals, or the exception that ended it), held
# until os._exit. A real interpreter frees these only during finalization, when a thread
# that asks for the GIL is ended instead of waiting; freed here, with the GIL held, a native
# destructor that joins such a thread never returns. torch's gloo process group is one:
# dropping a DDP model's Reducer joins gloo's runLoop thread, which may still be dropping a
# tensor (it needs the GIL), and the rank hung after its last line (2026-12-05).
_KEPT: list[object] = []


def _finalize() -> None:
    """What an interpreter does on its way out, before the worker's os._exit: wait for
    non-daemon threads, run atexit callbacks (a metrics client flushing, multiprocessing ending
    its daemon children), flush stdio. Not the rest of finalization: that is what warm workers
    skip, like `python -m trainer` does anyway."""
    import atexit

    with contextlib.suppress(Exception):
        threading._shutdown()  # type: ignore[attr-defined]  # joins non-daemon threads
    with contextlib.suppress(Exception):
        atexit._run_exitfuncs()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()


def _show_as(argv: list[str], env: dict[str, str]) -> None:
    """Make /proc/<pid>/cmdline and /proc/<pid>/environ (what `ps`, `pgrep -f` and operators'
    tools read) show this worker's command and environment, not the zygote's.

    The kernel reports the memory where exec placed the zygote's arguments and environment;
    a forked child still has those pages, privately, and may write into them (setproctitle's
    technique; moving the areas would need CAP_SYS_RESOURCE). The zygote was started with
    spare room in both (`ROOM_ARG`, `ROOM_ENV`). After os.environ was replaced, libc no longer
    points into the old area, so overwriting it changes nothing but what /proc shows. Anything
    beyond the room is cut at an entry boundary."""
    import ctypes

    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        arg_start, arg_end, env_start, env_end = (int(fields[i]) for i in (45, 46, 47, 48))
    except (OSError, IndexError, ValueError):
        return
    areas = (
        (arg_start, arg_end, [a.encode() for a in argv]),
        (env_start, env_end, [f"{k}={v}".encode() for k, v in env.items()]),
    )
    for start, end, entries in areas:
        room = end - start
        if room <= 1:
            continue
        data = b""
        for entry in entries:
            if len(data) + len(entry) + 1 > room:
                break
            data += entry + b"\0"
        ctypes.memmove(start, data.ljust(room, b"\0"), room)


def _exit_status(value) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


def _reset_process_state(env: dict[str, str]) -> None:
    import random

    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    torch = sys.modules.get("torch")
    threads = env.get("OMP_NUM_THREADS", "")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        # The zygote's libgomp read OMP_NUM_THREADS at import time, not this worker's value.
        torch.set_num_threads(int(threads))


def _send(sock: socket.socket, message: dict) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    # The agent's SIGINT (Ctrl-C in a terminal) reaches the whole process group; the zygote
    # ends when the agent closes the socket, not before.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    serve(sock)


# -- the agent's side -------------------------------------------------------------------------


class ZygoteError(Exception):
    pass


class ForkedWorker:
    """A worker forked by the zygote, with the parts of Popen the supervisor uses."""

    def __init__(self, zygote: Zygote, pid: int):
        self._zygote = zygote
        self.pid = pid
        self.returncode: int | None = None
        # Wall-clock time the zygote reaped it (within 50 ms of the exit), once it has.
        self.exited_at: float | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            known = self._zygote.take_exit(self.pid)
            if known is not None:
                self.returncode, self.exited_at = known
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The agent's handle on its zygote: start it, ask it to fork, learn the exits."""

    def __init__(
        self,
        env: dict[str, str] | None = None,
        ready_timeout_s: float = 120.0,
        preload: str | None = None,
    ):
        self.env = dict(os.environ if env is None else env)
        self.preload = preload or ",".join(PRELOAD)
        self._ready_timeout_s = ready_timeout_s
        self._lock = threading.Lock()
        self._replies: dict[int, dict] = {}
        self._exits: dict[int, tuple[int, float]] = {}  # pid -> (status, when it was reaped)
        self._changed = threading.Condition(self._lock)
        self._next_id = 0
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self.ready: list[str] | None = None
        self.failed = ""

    def start(self) -> None:
        """Start the zygote and wait (in the background) for its preload."""
        ours, theirs = socket.socketpair()
        self._proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "from nodeagent.zygote import main; main()",
                str(theirs.fileno()),
                ROOM_ARG,
            ],
            env={
                **self.env,
                **SINGLE_THREADED,
                ROOM_VAR: ROOM_ENV,
                "LOCKSTEP_ZYGOTE_PRELOAD": self.preload,
            },  # fmt: skip
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self._sock = ours
        threading.Thread(target=self._read, name="zygote-reader", daemon=True).start()

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None and not self.failed

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        wait_s = self._ready_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + wait_s
        with self._changed:
            while self.ready is None and not self.failed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
        return self.ready is not None and not self.failed

    def spawn(self, argv: list[str], env: dict[str, str], log: Path, timeout_s: float = 10.0):
        """A ForkedWorker running argv, or ZygoteError (the caller then uses Popen)."""
        if not self.alive() or not self.wait_ready(0 if self.ready is None else timeout_s):
            raise ZygoteError(self.failed or "the zygote is not ready")
        with self._changed:
            self._next_id += 1
            request_id = self._next_id
        request = {"id": request_id, "argv": argv, "env": env, "log": str(log)}
        try:
            self._sock.sendall(json.dumps(request).encode() + b"\n")
        except OSError as exc:
            self.failed = f"zygote socket: {exc}"
            raise ZygoteError(self.failed) from exc
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while request_id not in self._replies:
                left = deadline - time.monotonic()
                if left <= 0 or self.failed:
                    raise ZygoteError(self.failed or "the zygote did not answer")
                self._changed.wait(left)
            reply = self._replies.pop(request_id)
        if "pid" not in reply:
            raise ZygoteError(reply.get("error", "fork refused"))
        return ForkedWorker(self, int(reply["pid"]))

    def take_exit(self, pid: int) -> tuple[int, float | None] | None:
        """(status, when it was reaped) once the worker `pid` exited, else None. Handed out
        once: the entry goes, so that a later worker given the same pid (pids wrap round) is
        not taken for this one."""
        with self._lock:
            known = self._exits.pop(pid, None)
        if known is None and self.failed and not _pid_alive(pid):
            # The zygote died before reporting: the status is lost with it.
            return -signal.SIGKILL, None
        return known

    def has_live(self, workers: Iterable[ForkedWorker]) -> bool:
        """Whether any of `workers` is one of this zygote's and has not been seen to exit."""
        return any(w._zygote is self and w.poll() is None for w in workers)

    def close(self) -> None:
        if self._sock is not None:
            # shutdown, not only close: the reader thread blocked in recv() keeps the socket
            # open through a plain close, and the zygote would never see its EOF.
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                self._sock.close()
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=5)
            if self._proc.poll() is None:
                self._proc.kill()
                self._proc.wait(timeout=5)

    def _read(self) -> None:
        buffer = b""
        try:
            while True:
                data = self._sock.recv(1 << 16)
                if not data:
                    break
                buffer += data
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    self._handle(json.loads(line))
        except (OSError, ValueError) as exc:
            logger.warning("zygote connection lost: %s", exc)
        with self._changed:
            self.failed = self.failed or "the zygote exited"
            self._changed.notify_all()

    def _handle(self, message: dict) -> None:
        with self._changed:
            if "ready" in message:
                if message.get("threads", 1) > 1:
                    threads = message["threads"]
                    self.failed = f"the zygote started {threads} threads while preloading"
                else:
                    self.ready = list(message["ready"])
            elif "exit" in message:
                at = float(message.get("at") or time.time())
                self._exits[int(message["exit"])] = (int(message["code"]), at)
            elif "id" in message:
                if "pid" in message:
                    # A new worker with this pid: an exit still filed under it was an earlier
                    # worker's (pids wrap round) and would make this one look dead at once.
                    self._exits.pop(int(message["pid"]), None)
                self._replies[int(message["id"])] = message
            self._changed.notify_all()


def _pid_alive(pid: int) -> bool:
    """Running (a zombie is not: in a container whose init never reaps, it stays one)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"


def can_fork(argv: list[str], env: dict[str, str], zygote_env: dict[str, str]) -> bool:
    """Whether a (resolved) command can be forked from the zygote: this interpreter running a
    module or a script, with no interpreter options, OMP_NUM_THREADS set (the agent sets it
    when a node runs several ranks), and the same PYTHON* variables (they act when an
    interpreter starts: PYTHONPATH, PYTHONHASHSEED, ...)."""
    if len(argv) < 2 or argv[0] != sys.executable:
        return False
    # The worker's thread count is set again after the fork from OMP_NUM_THREADS; without it a
    # fresh interpreter would pick its own default, which the zygote cannot reproduce.
    if not env.get("OMP_NUM_THREADS", "").isdigit():
        return False
    python_vars = {k for k in (*env, *zygote_env) if k.startswith("PYTHON")}
    if any(env.get(k) != zygote_env.get(k) for k in python_vars):
        return False
    if argv[1] == "-m":
        return len(argv) >= 3 and bool(argv[2]) and not argv[2].startswith("-")
    return not argv[1].startswith("-")


if __name__ == "__main__":
    main()
