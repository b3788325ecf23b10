"""Datasets that need no download, chosen by a dataset URI, and the global sample order.

- ``synthetic://addition`` (optionally ``?digits=N``, default 3, and ``?epoch=S``, default
  1,000,000 samples per epoch): character-level addition problems such as ``123+456=0579\\n``:
  operands zero-padded to N digits, the sum to N + 1 digits. Problems are packed back to back
  into each row (one sample = one row); only the answer characters (the sum digits and the
  newline) are scored, since the operands are random and cannot be predicted. Sample s is always
  the same row (it is drawn from a generator seeded with s).
- ``file:///abs/path.txt`` or a plain path: byte-level language modelling over a local file
  (vocab = the 256 byte values), every position scored. Sample s is the window of block_size + 1
  bytes starting at byte s * block_size; an epoch is every whole window once.

Data position: training consumes one global stream of sample positions 0, 1, 2, ... Position p
is sample ``permutation(seed, epoch)[p % S]`` of epoch ``p // S`` (S = samples per epoch), so an
epoch visits every sample exactly once in a seeded order. The global batch of a step is the next
``global_batch`` positions; data-parallel rank r takes a contiguous slice of it (`BatchPlan`),
split into micro-batches for gradient accumulation. The checkpoint stores the position reached,
so a run resumed at any world size continues at exactly the next sample: nothing in an epoch is
repeated or skipped.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol
from urllib.parse import parse_qs, unquote, urlparse

import numpy as np
import torch

from trainer.model import IGNORE_INDEX

DEFAULT_DATASET = "synthetic://addition"
DEFAULT_ADDITION_EPOCH = 1_000_000


class Dataset(Protocol):
    uri: str
    vocab_size: int

    def num_samples(self, block_size: int) -> int:
        """Samples in one epoch (rows of block_size inputs)."""
        ...

    def samples(self, ids: np.ndarray, *, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of sample ids (n,): (inputs, targets), both (n, block_size) int64; targets
        may hold IGNORE_INDEX."""
        ...


class GlobalSampler:
    """Maps global sample positions to (epoch, sample id): a seeded permutation per epoch."""

    def __init__(self, num_samples: int, seed: int) -> None:
        if num_samples < 1:
            raise ValueError("a dataset epoch needs at least one sample")
        self.num_samples = num_samples
        self.seed = seed
        self._perms: dict[int, np.ndarray] = {}

    def permutation(self, epoch: int) -> np.ndarray:
        perm = self._perms.get(epoch)
        if perm is None:
            # SeedSequence mixes the numbers into one well-spread seed; the constant keeps this
            # stream apart from any other use of (seed, epoch).
            perm = np.random.default_rng([self.seed, epoch, 0x5A3]).permutation(self.num_samples)
            self._perms = {e: p for e, p in self._perms.items() if e >= epoch - 1}
            self._perms[epoch] = perm
        return perm

    def lookup(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """(epochs, sample ids) of the global positions [start, stop)."""
        pos = np.arange(start, stop, dtype=np.int64)  # (n,)
        epochs = pos // self.num_samples
        ids = np.empty_like(pos)
        for epoch in np.unique(epochs):
            sel = epochs == epoch
            ids[sel] = self.permutation(int(epoch))[pos[sel] % self.num_samples]
        return epochs, ids


@dataclass(frozen=True)
class BatchPlan:
    """How one step's global batch is split across data-parallel ranks and micro-batches.

    Rank r takes rows [rank_start(r), rank_start(r + 1)) of the global batch (sizes differ by at
    most one when global_batch is not a multiple of dp_size) in `accum_steps` micro-batches of
    at most `micro_batch` rows; every rank runs the same number of micro-batches, as the
    gradient synchronisation on the last one needs.
    """

    global_batch: int
    dp_size: int
    micro_batch: int
    accum_steps: int = field(init=False)

    def __post_init__(self) -> None:
        if self.global_batch < self.dp_size:
            raise ValueError(
                f"global batch {self.global_batch} is smaller than the {self.dp_size} "
                "data-parallel ranks"
            )
        largest = -(-self.global_batch // self.dp_size)
        accum = -(-largest // self.micro_batch)
        if self.global_batch // self.dp_size < accum:
            raise ValueError(
                f"global batch {self.global_batch} cannot be split over {self.dp_size} ranks "
                f"in micro-batches of at most {self.micro_batch}"
            )
        object.__setattr__(self, "accum_steps", accum)

    def rank_start(self, dp_rank: int) -> int:
        base, extra = divmod(self.global_batch, self.dp_size)
        return dp_rank * base + min(dp_rank, extra)

    def micro_ranges(self, dp_rank: int) -> list[tuple[int, int]]:
        """[(start, stop)] offsets into the global batch, one per micro-batch of this rank."""
        lo, hi = self.rank_start(dp_rank), self.rank_start(dp_rank + 1)
        # np.array_split's sizes: the first (n % accum) micro-batches get one row more.
        base, extra = divmod(hi - lo, self.accum_steps)
        bounds = [lo]
        for i in range(self.accum_steps):
            bounds.append(bounds[-1] + base + (1 if i < extra else 0))
        return list(zip(bounds[:-1], bounds[1:], strict=True))


@dataclass
class AdditionDataset:
    """Character-level N-digit addition; see the module docstring for the format."""

    uri: str = DEFAULT_DATASET
    digits: int = 3
    epoch_size: int = DEFAULT_ADDITION_EPOCH

    ALPHABET = "0123456789+=\n"
    vocab_size = len(ALPHABET)

    def __post_init__(self) -> None:
        if not 1 <= self.digits <= 9:
            raise ValueError(f"addition digits must be between 1 and 9, got {self.digits}")
        if self.epoch_size < 1:
            raise ValueError(f"addition epoch must be >= 1 samples, got {self.epoch_size}")

    @property
    def problem_len(self) -> int:
        # "aaa+bbb=cccc\n": N + 1 + N + 1 + (N + 1) + 1
        return 3 * self.digits + 4

    def encode(self, text: str) -> list[int]:
        return [self.ALPHABET.index(ch) for ch in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.ALPHABET[i] for i in ids)

    def num_samples(self, block_size: int) -> int:
        return self.epoch_size

    def samples(self, ids: np.ndarray, *, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        n, L = self.digits, self.problem_len
        per_row = -(-(block_size + 1) // L)  # problems needed to fill a row of block_size + 1
        ids = np.asarray(ids, dtype=np.int64)
        B = len(ids)
        # Sample s is a pure function of s: its own generator, whatever batch it lands in.
        operands = np.stack(
            [np.random.default_rng([0xADD, n, int(s)]).integers(0, 10**n, 2 * per_row)
             for s in ids]
        ).reshape(B, 2, per_row) if B else np.zeros((0, 2, per_row), dtype=np.int64)  # fmt: skip
        a, b = operands[:, 0], operands[:, 1]  # (B, P) each
        rows = np.concatenate(
            [
                _digits(a, n),  # (B, P, N)
                np.full((B, per_row, 1), self.ALPHABET.index("+")),
                _digits(b, n),  # (B, P, N)
                np.full((B, per_row, 1), self.ALPHABET.index("=")),
                _digits(a + b, n + 1),  # (B, P, N + 1)
                np.full((B, per_row, 1), self.ALPHABET.index("\n")),
            ],
            axis=2,
        ).reshape(B, per_row * L)[:, : block_size + 1]  # (B, T + 1)
        x = torch.from_numpy(rows[:, :-1].copy())  # (B, T)
        y = torch.from_numpy(rows[:, 1:].copy())  # (B, T)
        # Target position t predicts character t + 1 of the row; score it only when that
        # character is part of an answer (offset 2N + 2 .. 3N + 3 within its problem).
        offset = (torch.arange(block_size) + 1) % L  # (T,)
        y[:, offset < 2 * n + 2] = IGNORE_INDEX
        return x, y


def _digits(values: np.ndarray, width: int) -> np.ndarray:
    """Zero-padded decimal digits, most significant first: (...,) -> (..., width)."""
    powers = 10 ** np.arange(width - 1, -1, -1)  # (width,)
    return (values[..., None] // powers) % 10


@dataclass
class TextFileDataset:
    """Byte-level language modelling over one local file."""

    uri: str
    path: Path
    vocab_size = 256

    def __post_init__(self) -> None:
        if not self.path.is_file():
            raise FileNotFoundError(f"dataset file not found: {self.path}")
        if self.path.stat().st_size < 2:
            raise ValueError(f"dataset file {self.path} is too small to train on")
        # A read-only memory map: a large file costs no RAM up front, and every rank shares the
        # page cache.
        self.data = np.memmap(self.path, dtype=np.uint8, mode="r")

    def num_samples(self, block_size: int) -> int:
        if len(self.data) < block_size + 1:
            raise ValueError(
                f"dataset {self.path} has {len(self.data)} bytes; block_size {block_size} "
                f"needs at least {block_size + 1}"
            )
        return (len(self.data) - 1) // block_size

    def samples(self, ids: np.ndarray, *, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        starts = np.asarray(ids, dtype=np.int64) * block_size  # (B,)
        index = starts[:, None] + np.arange(block_size + 1)  # (B, T + 1)
        rows = self.data[index].astype(np.int64)  # (B, T + 1)
        return torch.from_numpy(rows[:, :-1].copy()), torch.from_numpy(rows[:, 1:].copy())


def build_dataset(uri: str) -> Dataset:
    """The dataset named by uri (see the module docstring for the accepted forms)."""
    uri = uri.strip() or DEFAULT_DATASET
    parsed = urlparse(uri)
    if parsed.scheme == "synthetic":
        if parsed.netloc != "addition":
            raise ValueError(f"unknown synthetic dataset {parsed.netloc!r} in {uri!r}")
        query = parse_qs(parsed.query)
        digits = int(query.get("digits", ["3"])[0])
        epoch = int(query.get("epoch", [str(DEFAULT_ADDITION_EPOCH)])[0])
        return AdditionDataset(uri=uri, digits=digits, epoch_size=epoch)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"file URIs must be local (file:///abs/path), got {uri!r}")
        return TextFileDataset(uri=uri, path=Path(unquote(parsed.path)))
    if parsed.scheme == "" or os.path.exists(uri):
        return TextFileDataset(uri=uri, path=Path(uri).expanduser().resolve())
    raise ValueError(f"unsupported dataset URI {uri!r} (use synthetic://addition or a file path)")
