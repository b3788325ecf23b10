"""Checkpoints that frameworks write on their own, seen without the script's help, and laid out
for the next attempt the way each framework looks for them.

Seen (`SaveWatcher`, run by the agent of the gang's first node): under the attempt's
checkpoint directory,
- `lightning`: a `*.ckpt` file (`last*.ckpt` excepted: Lightning rewrites it at every save, so
  it is an alias, not a save);
- `hf`: a `checkpoint-N/` directory with its `trainer_state.json` (the Hugging Face Trainer
  writes that file last);
- `torch`: a `*.pt`, `*.pth` or `*.bin` file outside those directories (a script's
  `torch.save`).
A save is reported once it is complete and settled: a file save is a whole zip archive
(`torch.save`'s format, whose index is written last, so a save cut short never passes) and
neither its size nor its time changed for SETTLE_S. The reference trainer's `step-*/` saves
are its own business (it reports them when their COMMITTED marker is written) and are skipped.

Laid out (`seed_resume`): before a restarted attempt's ranks start, the save it resumes from is
placed in its new checkpoint directory at the same relative path (`seed_resume` says when by
hard link and when by copy), so that `trainer.fit(ckpt_path="last")`,
`get_last_checkpoint(output_dir)` / `trainer.train(resume_from_checkpoint=True)` and a script
that loads its file if it exists all resume unmodified; `LOCKSTEP_RESUME_FROM` names the save
itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
import zipfile
from pathlib import Path
from typing import Any

SETTLE_S = 2.0
SCAN_EVERY_S = 5.0
SCAN_DEPTH = 5
HF_DIR = re.compile(r"^checkpoint-(\d+)$")
LIGHTNING_STEP = re.compile(r"step=(\d+)")
LAST_NUMBER = re.compile(r"(\d+)(?!.*\d)")
TORCH_SUFFIXES = (".pt", ".pth", ".bin")
DCP_DIR = re.compile(r"^step-\d+$")
ATTEMPT_DIR = re.compile(r"^attempt-\d+$")
LIGHTNING_RESUME = "last-resume.ckpt"


def classify(path: Path) -> tuple[str, int | None] | None:
    """(format, step or None) of a save at path, or None if it is not one."""
    if path.is_dir():
        match = HF_DIR.match(path.name)
        return ("hf", int(match.group(1))) if match else None
    if path.suffix == ".ckpt":
        if path.stem.startswith("last"):
            return None
        match = LIGHTNING_STEP.search(path.stem)
        return "lightning", int(match.group(1)) if match else None
    if path.suffix in TORCH_SUFFIXES:
        match = LAST_NUMBER.search(path.stem)
        return "torch", int(match.group(1)) if match else None
    return None


def candidates(root: Path, depth: int = SCAN_DEPTH) -> list[Path]:
    """Saves of any format under root, not descending into a save directory."""
    found: list[Path] = []
    level = [root]
    for _ in range(depth + 1):
        below: list[Path] = []
        for directory in level:
            try:
                entries = list(os.scandir(directory))
            except OSError:
                continue
            for entry in entries:
                path = Path(entry.path)
                try:
                    is_dir = entry.is_dir(follow_symlinks=False)
                except OSError:
                    continue
                if is_dir and (DCP_DIR.match(entry.name) or entry.name.startswith(".")):
                    continue
                if classify(path) is not None:
                    found.append(path)
                elif is_dir:
                    below.append(path)
        level = below
    return found


def complete(path: Path, fmt: str) -> bool:
    """Whether the save is whole: its last-written part exists and reads."""
    try:
        if fmt == "hf":
            json.loads((path / "trainer_state.json").read_text(encoding="utf-8"))
            return True
        return zipfile.is_zipfile(path)
    except (OSError, ValueError):
        return False


def signature(path: Path) -> tuple[int, int]:
    """(bytes, newest modification in ns) of a file or a directory's files."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    total, newest = 0, 0
    for file in files:
        with contextlib.suppress(OSError):
            st = file.stat()
            total, newest = total + st.st_size, max(newest, st.st_mtime_ns)
    return total, newest


class SaveWatcher:
    """Framework saves under one attempt's checkpoint directory, each reported once."""

    def __init__(self, checkpoint_dir: str | os.PathLike[str], clock: Any = time.monotonic):
        self.root = Path(checkpoint_dir)
        self._clock = clock
        self._scanned_at: float | None = None
        self._seen: dict[Path, tuple[tuple[int, int], float]] = {}  # signature, since when
        self._reported: set[Path] = set()
        self._seeded = seeded_paths(self.root)
        self._pending: list[dict[str, Any]] = []

    def scan(self, final: bool = False) -> None:
        """Look for settled saves, at most every SCAN_EVERY_S; `final` (the ranks have exited):
        now, and without waiting for a save to settle, since nobody writes any more."""
        now = self._clock()
        if not final and self._scanned_at is not None and now - self._scanned_at < SCAN_EVERY_S:
            return
        self._scanned_at = now
        for path in candidates(self.root):
            if path in self._reported or path in self._seeded:
                continue
            fmt, step = classify(path) or ("", None)
            sig = signature(path)
            seen = self._seen.get(path)
            if seen is None or seen[0] != sig:
                self._seen[path] = (sig, now)
                if not final:
                    continue
            elif not final and now - seen[1] < SETTLE_S:
                continue
            if not complete(path, fmt):
                continue
            self._reported.add(path)
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


def _attempt_root(path: Path) -> Path | None:
    for parent in path.parents:
        if ATTEMPT_DIR.match(parent.name):
            return parent
    return None


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
    `ckpt_path="last"` finds (any `last*.ckpt` in the callback's directory, newest first)."""
    if fmt not in ("lightning", "hf", "torch") or not resume_from:
        return []
    source = Path(resume_from)
    origin = _attempt_root(source)
    if origin is None or not source.exists():
        return []
    target = Path(checkpoint_dir) / source.relative_to(origin)
    made: list[Path] = []
    if source.is_dir():
        for file in sorted(p for p in source.rglob("*") if p.is_file()):
            made += _place(file, target / file.relative_to(source), link=True)
    else:
        made += _place(source, target, link=fmt == "lightning")
        if fmt == "lightning":
            made += _place(source, target.with_name(LIGHTNING_RESUME), link=True)
    return made


def _place(source: Path, target: Path, *, link: bool) -> list[Path]:
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():
        return []
    if link:
        try:
            os.link(source, target)
            return [target]
        except FileExistsError:
            return []
        except OSError:  # another filesystem, or one without hard links: copy
            pass
    partial = target.with_name(f".{target.name}.seeding")
    shutil.copy2(source, partial)
    try:
        os.link(partial, target)  # whole or not at all, and never over another node's copy
    except FileExistsError:
        pass
    finally:
        partial.unlink(missing_ok=True)
    return [target]


def seeded_paths(checkpoint_dir: Path) -> set[Path]:
    """Saves already in checkpoint_dir when its attempt starts: those seed_resume laid out
    from an earlier attempt, never reported as this attempt's."""
    return set(candidates(checkpoint_dir))
