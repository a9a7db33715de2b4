"""Byte counts and durations as messages and tables show them."""

from __future__ import annotations


def gb(n: int) -> str:
    """A byte count: GB with three decimals, MB below 0.1 GB."""
    return f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
