"""How the pages write numbers for people."""

from __future__ import annotations


def duration(seconds) -> str:
    """A duration for people: 42 s, 12.5 min, 3.2 h, 2.1 d."""
    if seconds is None:
        return "—"
    seconds = float(seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.1f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"
