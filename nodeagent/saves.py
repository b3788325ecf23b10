"""Checkpoints that frameworks write on their own, seen without the script's help, and laid out
for the next attempt the way each framework looks for them.

Seen (`SaveWatcher`, run by the agent of the gang's first node): the saves under the attempt's
checkpoint directory that trainer/framework_saves.py recognises (Lightning `.ckpt` files,
Hugging Face `checkpoint-N/` directories, `torch.save` files), each reported once it is whole
and settled (neither its size nor its time changed for SETTLE_S; at the attempt's end, when
nobody writes any more, at once).

Laid out (`seed_resume`): before a restarted attempt's ranks start, the save it resumes from is
placed in its new checkpoint directory at the same relative path (`seed_resume` says when by
hard link and when by copy), so that `trainer.fit(ckpt_path="last")`,
`get_last_checkpoint(output_dir)` / `trainer.train(resume_from_checkpoint=True)` and a script
that loads its file if it exists all resume unmodified; `LOCKSTEP_RESUME_FROM` names the save
itself.
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import time
from pathlib import Path
from typing import Any

from trainer.framework_saves import (
    LIGHTNING_RESUME,
    attempt_root,
    candidates,
    classify,
    complete,
    inside,
    regular_file,
    save_files,
    signature,
)

SETTLE_S = 2.0
SCAN_EVERY_S = 5.0


class SaveWatcher:
    """Framework saves under one attempt's checkpoint directory, each reported once it has
    settled, and again whenever it has changed and settled since (a script that overwrites
    `latest.pt` in place: the portal then updates that save's step)."""

    def __init__(self, checkpoint_dir: str | os.PathLike[str], clock: Any = time.monotonic):
        self.root = Path(checkpoint_dir)
        self._clock = clock
        self._scanned_at: float | None = None
        self._seen: dict[Path, tuple[tuple[int, int], float]] = {}  # signature, since when
        # The signature each save was last reported with (or laid out with, for what the
        # restart seeded from an earlier attempt: reported only once it changes).
        self._reported: dict[Path, tuple[int, int]] = {
            path: signature(path) for path in seeded_paths(self.root)
        }
        self._pending: list[dict[str, Any]] = []

    def scan(self, final: bool = False) -> None:
        """Look for settled saves, at most every SCAN_EVERY_S; `final` (the ranks have exited):
        now, and without waiting for a save to settle, since nobody writes any more."""
        now = self._clock()
        if not final and self._scanned_at is not None and now - self._scanned_at < SCAN_EVERY_S:
            return
        self._scanned_at = now
        for path in candidates(self.root):
            fmt, step = classify(path) or ("", None)
            sig = signature(path)
            if self._reported.get(path) == sig:
                continue
            seen = self._seen.get(path)
            if seen is None or seen[0] != sig:
                self._seen[path] = (sig, now)
                if not final:
                    continue
            elif not final and now - seen[1] < SETTLE_S:
                continue
            if not complete(path, fmt):
                continue
            self._reported[path] = sig
            self._pending.append(
                {
                    "kind": "checkpoint",
                    "rank": 0,
                    "format": fmt,
                    "path": str(path),
                    "bytes": sig[0],
                    **({"step": step} if step is not None else {}),
                }
            )

    def read(self) -> tuple[list[dict[str, Any]], int]:
        return list(self._pending), len(self._pending)

    def ack(self, count: int) -> None:
        del self._pending[:count]

    @property
    def at_eof(self) -> bool:
        return not self._pending


def seed_resume(checkpoint_dir: str | os.PathLike[str], resume_from: str, fmt: str) -> list[Path]:
    """Lay a framework save of an earlier attempt into this attempt's checkpoint directory at
    the same relative path. Idempotent: every node's agent does it before its ranks start, and
    whichever comes first does the work. Returns the paths made; the reference trainer's saves
    (`dcp`) need none of this.

    Hard links where the framework never writes that name again (a Hugging Face checkpoint-N/
    of a step already done; Lightning, which versions a name that exists rather than overwrite
    it), so a restart copies nothing; a copy of a plain `torch.save` file, which a script may
    well overwrite in place under the same name, which through a link would rewrite the
    earlier attempt's save. A Lightning save is also linked as `last-resume.ckpt`, which
    `ckpt_path="last"` finds (any `last*.ckpt` in the callback's directory, newest first).

    The agent does this as root in directories the job can write: only regular files inside
    the job's own directory are taken, links are never followed, and a copy is read through
    the descriptor that was checked."""
    if fmt not in ("lightning", "hf", "torch") or not resume_from:
        return []
    target_dir = Path(checkpoint_dir)
    source = Path(resume_from)
    origin = attempt_root(source)
    if origin is None or source.is_symlink() or not inside(source, target_dir.parent):
        return []
    target = target_dir / source.relative_to(origin)
    made: list[Path] = []
    if source.is_dir():
        for file in sorted(save_files(source)):
            made += _place(file, target / file.relative_to(source), link=True)
    elif regular_file(source):
        made += _place(source, target, link=fmt == "lightning")
        if fmt == "lightning":
            made += _place(source, target.with_name(LIGHTNING_RESUME), link=True)
    return made


def _place(source: Path, target: Path, *, link: bool) -> list[Path]:
    target.parent.mkdir(parents=True, exist_ok=True)
    if os.path.lexists(target):
        return []
    if link:
        try:
            os.link(source, target, follow_symlinks=False)
            return [target]
        except FileExistsError:
            return []
        except OSError:  # another filesystem, or one without hard links: copy
            pass
    # A name of this agent's own: several nodes may copy at once on a shared filesystem.
    partial = target.with_name(f".{target.name}.{socket.gethostname()}.{os.getpid()}.seeding")
    fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return []
        with os.fdopen(fd, "rb", closefd=False) as src, open(partial, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        try:
            os.link(partial, target)  # whole or not at all, and never over another's copy
        except FileExistsError:
            return []
    finally:
        os.close(fd)
        partial.unlink(missing_ok=True)
    return [target]


def seeded_paths(checkpoint_dir: Path) -> set[Path]:
    """Saves already in checkpoint_dir when its attempt starts: those seed_resume laid out
    from an earlier attempt, never reported as this attempt's."""
    return set(candidates(checkpoint_dir))
