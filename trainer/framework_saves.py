"""What a framework's own save looks like on disk, without torch: the agent (which reports
saves as they appear, nodeagent/saves.py) and the portal (which adopts any whose report was lost
when the attempt ended first, jobs/actions/claim.py) read this one definition.

- `lightning`: a `*.ckpt` file (`last*.ckpt` excepted: Lightning rewrites it at every save, so
  it is an alias, not a save; and it is what `ckpt_path="last"` looks for);
- `hf`: a `checkpoint-N/` directory with its `trainer_state.json` (the Hugging Face Trainer
  writes that file last);
- `torch`: a `*.pt`, `*.pth` or `*.bin` file outside those directories (a script's
  `torch.save`).
A file save is whole when it is a whole zip archive (`torch.save`'s format, whose index is
written last, so a save cut short never passes). The reference trainer's `step-*/` saves are
not these (their COMMITTED marker, trainer/checkpoint_layout.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import zipfile
from pathlib import Path

SCAN_DEPTH = 5
HF_DIR = re.compile(r"^checkpoint-(\d+)$")
LIGHTNING_STEP = re.compile(r"step=(\d+)")
# A step in a file's name: a number after a separator at its end (model_000120, ckpt-30,
# epoch=3), not one that is part of a word (resnet50).
TRAILING_NUMBER = re.compile(r"[_\-=.](\d+)$")
# Not .bin: the Hugging Face Trainer's training_args.bin and weights live beside its saves.
TORCH_SUFFIXES = (".pt", ".pth")
MAX_ENTRIES = 20_000  # per scan: a checkpoint tree is walked often
DCP_DIR = re.compile(r"^step-\d+$")
ATTEMPT_DIR = re.compile(r"^attempt-\d+$")
LIGHTNING_RESUME = "last-resume.ckpt"


def classify(path: Path) -> tuple[str, int | None] | None:
    """(format, step or None) of a save at path, or None if it is not one. A symbolic link is
    never a save: the agent and the portal read saves as root, from a directory the job
    controls, and a link could name another team's files."""
    if path.is_symlink():
        return None
    if path.is_dir():
        match = HF_DIR.match(path.name)
        return ("hf", int(match.group(1))) if match else None
    if path.suffix == ".ckpt":
        if path.stem.startswith("last"):
            return None
        match = LIGHTNING_STEP.search(path.stem)
        return "lightning", int(match.group(1)) if match else None
    if path.suffix in TORCH_SUFFIXES:
        match = TRAILING_NUMBER.search(path.stem)
        return "torch", int(match.group(1)) if match else None
    return None


def candidates(root: Path, depth: int = SCAN_DEPTH) -> list[Path]:
    """Saves of any format under root, not descending into a save directory."""
    found: list[Path] = []
    level = [root]
    budget = MAX_ENTRIES
    for _ in range(depth + 1):
        below: list[Path] = []
        for directory in level:
            try:
                entries = list(os.scandir(directory))
            except OSError:
                continue
            budget -= len(entries)
            if budget < 0:
                return found
            for entry in entries:
                path = Path(entry.path)
                try:
                    if entry.is_symlink():
                        continue
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


def regular_file(path: Path) -> bool:
    """A regular file, not a link, a FIFO (which would block whoever opens it) or a device."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def complete(path: Path, fmt: str) -> bool:
    """Whether the save is whole: its last-written part exists and reads."""
    try:
        if fmt == "hf":
            state = path / "trainer_state.json"
            if not regular_file(state):
                return False
            json.loads(state.read_text(encoding="utf-8"))
            return True
        return regular_file(path) and zipfile.is_zipfile(path)
    except (OSError, ValueError):
        return False


def save_files(path: Path) -> list[Path]:
    """The regular files of a save (itself, or those under its directory; links skipped)."""
    if path.is_symlink():
        return []
    if not path.is_dir():
        return [path] if regular_file(path) else []
    return [p for p in path.rglob("*") if regular_file(p)]


def signature(path: Path) -> tuple[int, int]:
    """(bytes, newest modification in ns) of a file or a directory's files."""
    total, newest = 0, 0
    for file in save_files(path):
        with contextlib.suppress(OSError):
            st = file.stat()
            total, newest = total + st.st_size, max(newest, st.st_mtime_ns)
    return total, newest


def inside(path: Path, directory: Path) -> bool:
    """Whether path, links resolved, lies under directory (itself resolved)."""
    return Path(os.path.realpath(path)).is_relative_to(Path(os.path.realpath(directory)))


def attempt_root(path: Path) -> Path | None:
    """The `attempt-N` directory a save lies in, if any."""
    for parent in path.parents:
        if ATTEMPT_DIR.match(parent.name):
            return parent
    return None


def seeded_path(attempt_directory: Path, resumed_from: str) -> Path | None:
    """Where an attempt that resumed from `resumed_from` (a framework save of an earlier
    attempt) has it laid out: the same path relative to its own directory."""
    origin = attempt_root(Path(resumed_from))
    return attempt_directory / Path(resumed_from).relative_to(origin) if origin else None
