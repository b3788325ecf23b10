"""How the `lockstep` commands print: JSON documents, aligned tables, times and sizes."""

from __future__ import annotations

import json


def emit(data) -> None:
    print(json.dumps(data, indent=1))


def table(rows: list[list], headers: list[str]) -> None:
    cells = [[str(c) for c in headers]] + [["" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


def when(value: str | None) -> str:
    # "2026-12-01T00:20:20.123456Z" -> "2026-12-01 00:20:20"
    return value.replace("T", " ")[:19] if value else ""


def size(n: int | None) -> str:
    if n is None:
        return ""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
