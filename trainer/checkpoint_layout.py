"""Where checkpoints live and what makes one count, without torch: the trainer, the helper API
(trainer.api), the portal (adopting and recording saves) and retention all read this module.

Layout: ``<root>/job-<id>/attempt-<n>/step-000050/``: one directory per attempt, so a zombie
of an earlier attempt can never write into the live attempt's saves; inside, a save's files
plus ``COMMITTED``, a JSON marker (``{"step", "world_size", ...}``) written last, whole or not
at all (temporary file, fsync, ``os.replace``, fsync of the directory). A step directory
without a readable marker is a save that may have been killed half-way: never used.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

MARKER = "COMMITTED"
STEP_DIR = re.compile(r"^step-(\d+)$")


def job_dir(root: str | Path, job_id: int) -> Path:
    return Path(root).resolve() / f"job-{job_id}"


def attempt_dir(root: str | Path, job_id: int, attempt_number: int) -> Path:
    """LOCKSTEP_CHECKPOINT_DIR of one attempt."""
    return job_dir(root, job_id) / f"attempt-{attempt_number}"


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def read_marker(step_dir: str | Path) -> dict[str, Any] | None:
    """The parsed COMMITTED marker of step_dir, or None if it is absent or unreadable."""
    try:
        marker = json.loads((Path(step_dir) / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) and isinstance(marker.get("step"), int) else None


def is_committed(step_dir: str | Path) -> bool:
    return read_marker(step_dir) is not None


def step_dirs(checkpoint_dir: str | Path) -> list[Path]:
    """The step-* directories under checkpoint_dir, committed or not, in step order."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), c) for c in root.iterdir() if (m := STEP_DIR.match(c.name))]
    return [path for _, path in sorted(found) if path.is_dir()]


def latest_committed(checkpoint_dir: str | Path) -> Path | None:
    """The committed step directory with the highest step under checkpoint_dir, or None."""
    committed = [path for path in step_dirs(checkpoint_dir) if is_committed(path)]
    return committed[-1] if committed else None


def dir_bytes(path: str | Path) -> int:
    """Total size of the regular files under path."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_marker(step_dir: Path, marker: Mapping[str, Any]) -> None:
    """Commit a save: the marker is durable, and appears whole or not at all."""
    tmp = step_dir / f".{MARKER}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(marker, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, step_dir / MARKER)
    fsync_dir(step_dir)


def remove_step_dir(path: str | Path, *, ignore_errors: bool = False) -> None:
    """Delete a save: the marker first (and durably), so that a removal or an overwrite cut
    short never leaves a marked but partial directory that would be resumed from."""
    path = Path(path)
    try:
        (path / MARKER).unlink(missing_ok=True)
        fsync_dir(path)
    except OSError:
        if not ignore_errors:
            raise
    shutil.rmtree(path, ignore_errors=ignore_errors)
