"""Incremental readers of a rank's metrics JSONL and log file, for shipping by heartbeat.

Each tail remembers the offset the portal has acknowledged, and every `read()` starts there, so
data sent in a heartbeat that failed is simply read and sent again with the next one. Nothing is
buffered in memory: the files on disk are the buffer, which keeps an agent cut off from the
portal for hours at a constant size.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

logger = logging.getLogger("nodeagent.tail")

LOG_CHUNK_BYTES = 64 * 1024
# A step record is ~150 bytes, so this ships well over a thousand records per rank per beat.
METRICS_CHUNK_BYTES = 256 * 1024


Log = logging.Logger | logging.LoggerAdapter  # type: ignore[type-arg]


class _FileTail:
    def __init__(self, path: str | os.PathLike[str], rank: int, max_bytes: int, log: Log | None):
        self.path = Path(path)
        self.rank = rank
        self.max_bytes = max_bytes
        self._log = log or logger
        self.acked = 0  # bytes the portal has accepted
        self.at_eof = False  # the last read() reached the end of what the file held

    def _read_from_acked(self) -> bytes:
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < self.acked:
                    # Truncated and rewritten (a relaunch into the same directory).
                    self.acked = 0
                f.seek(self.acked)
                data = f.read(self.max_bytes)
        except FileNotFoundError:
            self.at_eof = True
            return b""
        self.at_eof = self.acked + len(data) >= size
        return data

    def ack(self, offset: int) -> None:
        """The portal accepted everything before `offset` (as returned by `read()`)."""
        self.acked = max(self.acked, offset)


def _not_a_number(_constant: str) -> None:
    """NaN, Infinity and -Infinity, which Python's json.dumps writes by default (a diverged
    loss), become null. Kept as floats they would make the heartbeat body invalid JSON: the
    agent could not send it, would hold it unacked and retry it forever, and the node would be
    lost for a metric."""
    return None


def _finite(text: str) -> float | None:
    value = float(text)  # 1e999 parses as infinity
    return value if math.isfinite(value) else None


class MetricsTail(_FileTail):
    """Complete JSON lines appended to one rank's metrics file since the last ack."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        rank: int,
        max_bytes: int = METRICS_CHUNK_BYTES,
        log: Log | None = None,
    ) -> None:
        super().__init__(path, rank, max_bytes, log)

    def read(self, final: bool = False) -> tuple[list[dict[str, Any]], int]:
        """Return (records, end offset).

        A trailing line without its newline is left for a later read, since the trainer may be
        half-way through writing it, unless `final` (the writer has exited): then it is parsed
        if it can be and skipped if not once the read reaches the end of the file, so a worker
        killed mid-write cannot stall the tail.
        """
        data = self._read_from_acked()
        end = len(data) if final and self.at_eof else data.rfind(b"\n") + 1
        if end == 0 and len(data) >= self.max_bytes:
            # One line longer than a whole chunk would stall the tail forever; skip it.
            self._log.warning(
                "%s: dropping an over-long metrics line at offset %d", self.path, self.acked
            )
            end = len(data)
        if end < len(data):
            self.at_eof = False
        records: list[dict[str, Any]] = []
        for line in data[:end].splitlines():
            if not line.strip():
                continue
            try:
                record = json.loads(line, parse_constant=_not_a_number, parse_float=_finite)
            except ValueError:
                self._log.warning("%s: skipping a line that is not JSON: %r", self.path, line[:200])
                continue
            if not isinstance(record, dict):
                self._log.warning("%s: skipping a record that is not an object", self.path)
                continue
            record.setdefault("rank", self.rank)
            records.append(record)
        return records, self.acked + end


class LogTail(_FileTail):
    """New bytes of one rank's stdout+stderr log since the last ack, at most 64 KiB a read."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        rank: int,
        max_bytes: int = LOG_CHUNK_BYTES,
        log: Log | None = None,
    ) -> None:
        super().__init__(path, rank, max_bytes, log)

    def read(self, final: bool = False) -> tuple[str, int]:
        """Return (text, end offset).

        A UTF-8 character cut by the chunk limit or by a write in progress is left for the next
        read rather than sent as two replacement marks, unless `final` (the writer has exited).
        """
        data = self._read_from_acked()
        end = len(data) if final and self.at_eof else _complete_utf8_end(data)
        if end < len(data):
            self.at_eof = False
        return data[:end].decode("utf-8", errors="replace"), self.acked + end


def _complete_utf8_end(data: bytes) -> int:
    """Length of `data` without a trailing, incomplete UTF-8 sequence."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte < 0x80:
            return len(data)  # ASCII: nothing is cut
        if byte >= 0xC0:  # the lead byte of the last sequence
            need = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return len(data) - back if back < need else len(data)
    return len(data)  # continuation bytes only: not UTF-8 anyway, errors="replace" copes
