"""Consolidate a sharded DCP checkpoint into one `torch.save` file: `python -m trainer.export
SRC DST`. The portal's queue worker runs it as a command, so torch stays out of the platform's
own processes (the domain imports no torch)."""

from __future__ import annotations

import sys
from pathlib import Path


def export(src: str | Path, dst: str | Path) -> None:
    """Write DST whole or not at all (a temporary file, then a rename)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dst = Path(dst)
    tmp = dst.with_suffix(dst.suffix + ".tmp")
    dcp_to_torch_save(str(src), tmp)
    tmp.replace(dst)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m trainer.export SRC_CHECKPOINT_DIR DST_FILE", file=sys.stderr)
        return 2
    try:
        export(*args)
    except (KeyboardInterrupt, SystemExit):
        raise
    # DCP's CheckpointException derives from BaseException, not Exception. The caller records
    # the last line: the reason, not a traceback.
    except BaseException as exc:
        lines = str(exc).strip().splitlines() or [""]
        print(f"{type(exc).__name__}: {lines[-1]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
