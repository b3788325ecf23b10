"""PyTorch's flight recorder, dumped on request under gloo the way NCCL's watchdog does it.

Every process group records its last collectives in a ring (the flight recorder): for each, its
sequence number, kind, sizes and state. Under NCCL, PyTorch's watchdog dumps that ring to
`$TORCH_NCCL_DEBUG_INFO_TEMP_FILE<rank>` on a collective timeout, or at once when a byte is
written to the named pipe `$TORCH_NCCL_DEBUG_INFO_PIPE_FILE<rank>.pipe`, which the node agent
does when the portal suspects a hang (nodeagent/flight_recorder.py). gloo records the same ring
but has no watchdog to dump it, so the reference trainer serves the same pipe itself, from a
thread: a rank blocked in a gloo collective holds no GIL, so the thread still runs. Any other
script under gloo has no such thread and its hang is told by its stacks alone.
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
from collections.abc import Mapping

# NCCL's names; TORCH_FR_DUMP_TEMP_FILE is the newer alias of the dump file's stem. The names
# and paths below are torch-free: the node agent reads them too (nodeagent/flight_recorder.py).
PIPE_STEM = "TORCH_NCCL_DEBUG_INFO_PIPE_FILE"
DUMP_STEMS = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")


def dump_path(rank: int, env: Mapping[str, str] | None = None) -> str | None:
    """Where this rank's dump goes: `<stem><rank>`, as PyTorch's DebugInfoWriter names it."""
    env = os.environ if env is None else env
    stem = next((env[name] for name in DUMP_STEMS if env.get(name)), None)
    return f"{stem}{rank}" if stem else None


def pipe_path(rank: int, env: Mapping[str, str] | None = None) -> str | None:
    """The named pipe that asks this rank for a dump: `<stem><rank>.pipe`, as NCCL's."""
    env = os.environ if env is None else env
    stem = env.get(PIPE_STEM)
    return f"{stem}{rank}.pipe" if stem else None


def write_dump(path: str) -> None:
    """The recorder's ring, pickled as the NCCL watchdog writes it, replacing `path` whole
    (the agent must never read half a dump)."""
    from torch._C._distributed_c10d import _dump_fr_trace

    data = _dump_fr_trace(True, False, False)  # collectives, no C++ stacks, not only active
    partial = f"{path}.partial"
    with open(partial, "wb") as out:
        out.write(data)
    os.replace(partial, path)


def serve_dump_pipe(rank: int) -> threading.Thread | None:
    """Under gloo, with both stems set (the agent sets them): a daemon thread that writes a
    dump each time a byte arrives on `<pipe stem><rank>.pipe`. None where NCCL's watchdog
    serves the pipe itself, or where nothing asked for it."""
    import torch.distributed as dist

    pipe, out = pipe_path(rank), dump_path(rank)
    if not pipe or not out or not dist.is_initialized() or dist.get_backend() != "gloo":
        return None
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(pipe)  # an earlier attempt's, as NCCL does
        os.mkfifo(pipe, 0o600)
    except OSError as exc:  # a directory it cannot write, a filesystem without pipes
        print(f"[rank {rank}] flight recorder: no dump pipe ({exc})", flush=True)
        return None

    def serve() -> None:
        while True:
            # Blocks until a writer opens the pipe; a writer closing without a byte is no ask.
            with open(pipe, "rb") as requests:
                if not stat.S_ISFIFO(os.fstat(requests.fileno()).st_mode):
                    return
                if requests.read(1):
                    try:
                        write_dump(out)
                    except (OSError, RuntimeError) as exc:
                        print(f"[rank {rank}] flight recorder: no dump ({exc})", flush=True)

    thread = threading.Thread(target=serve, name="flight-recorder-pipe", daemon=True)
    thread.start()
    return thread
