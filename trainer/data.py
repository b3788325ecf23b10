"""Datasets that need no download, chosen by a dataset URI.

- ``synthetic://addition`` (optionally ``?digits=N``, default 3): character-level addition
  problems such as ``123+456=0579\\n``: operands zero-padded to N digits, the sum to N + 1 digits.
  Problems are packed back to back into each row; only the answer characters (the sum digits and
  the newline) are scored, since the operands are random and cannot be predicted.
- ``file:///abs/path.txt`` or a plain path: byte-level language modelling over a local file
  (vocab = the 256 byte values), every position scored.

Batches are a pure function of (seed, step, rank, world_size): each batch draws from its own
random generator seeded with exactly those numbers. There is no iterator state, so the data
position of a run is just its step counter, which the checkpoint already stores; a resumed run
continues with exactly the batch the uninterrupted run would have used next.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol
from urllib.parse import parse_qs, unquote, urlparse

import numpy as np
import torch

from trainer.model import IGNORE_INDEX

DEFAULT_DATASET = "synthetic://addition"


class Dataset(Protocol):
    uri: str
    vocab_size: int

    def batch(
        self, *, seed: int, step: int, rank: int, world_size: int, batch_size: int, block_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), both (batch_size, block_size) int64; targets may hold IGNORE_INDEX."""
        ...


def batch_rng(seed: int, step: int, rank: int, world_size: int) -> np.random.Generator:
    """The random generator for one rank's batch of one step (steps count from 1)."""
    # SeedSequence mixes all four numbers into one well-spread seed, so neighbouring steps or
    # ranks do not get correlated streams.
    return np.random.default_rng([seed, step, rank, world_size])


@dataclass
class AdditionDataset:
    """Character-level N-digit addition; see the module docstring for the format."""

    uri: str = DEFAULT_DATASET
    digits: int = 3

    ALPHABET = "0123456789+=\n"
    vocab_size = len(ALPHABET)

    def __post_init__(self) -> None:
        if not 1 <= self.digits <= 9:
            raise ValueError(f"addition digits must be between 1 and 9, got {self.digits}")

    @property
    def problem_len(self) -> int:
        # "aaa+bbb=cccc\n": N + 1 + N + 1 + (N + 1) + 1
        return 3 * self.digits + 4

    def encode(self, text: str) -> list[int]:
        return [self.ALPHABET.index(ch) for ch in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.ALPHABET[i] for i in ids)

    def batch(
        self, *, seed: int, step: int, rank: int, world_size: int, batch_size: int, block_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n, L = self.digits, self.problem_len
        per_row = -(-(block_size + 1) // L)  # problems needed to fill a row of block_size + 1
        rng = batch_rng(seed, step, rank, world_size)
        a = rng.integers(0, 10**n, size=(batch_size, per_row))  # (B, P)
        b = rng.integers(0, 10**n, size=(batch_size, per_row))  # (B, P)
        rows = np.concatenate(
            [
                _digits(a, n),  # (B, P, N)
                np.full((batch_size, per_row, 1), self.ALPHABET.index("+")),
                _digits(b, n),  # (B, P, N)
                np.full((batch_size, per_row, 1), self.ALPHABET.index("=")),
                _digits(a + b, n + 1),  # (B, P, N + 1)
                np.full((batch_size, per_row, 1), self.ALPHABET.index("\n")),
            ],
            axis=2,
        ).reshape(batch_size, per_row * L)[:, : block_size + 1]  # (B, T + 1)
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

    def batch(
        self, *, seed: int, step: int, rank: int, world_size: int, batch_size: int, block_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if len(self.data) < block_size + 1:
            raise ValueError(
                f"dataset {self.path} has {len(self.data)} bytes; block_size {block_size} "
                f"needs at least {block_size + 1}"
            )
        rng = batch_rng(seed, step, rank, world_size)
        starts = rng.integers(0, len(self.data) - block_size, size=batch_size)  # (B,)
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
        return AdditionDataset(uri=uri, digits=digits)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"file URIs must be local (file:///abs/path), got {uri!r}")
        return TextFileDataset(uri=uri, path=Path(unquote(parsed.path)))
    if parsed.scheme == "" or os.path.exists(uri):
        return TextFileDataset(uri=uri, path=Path(uri).expanduser().resolve())
    raise ValueError(f"unsupported dataset URI {uri!r} (use synthetic://addition or a file path)")
