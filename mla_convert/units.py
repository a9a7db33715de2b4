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


_SIZE_UNITS = {
    "": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
    "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip


def parse_size(text: str) -> int:
    """A size as a user writes it: bytes, or a number with a unit (40G, 40GB, 1.5TB, 512MiB; G and
    GB are 10^9, GiB 2^30). ValueError naming what is expected."""
    s = text.strip().lower().replace(" ", "")
    number = s.rstrip("kmgtib")
    unit = s[len(number) :]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in _SIZE_UNITS or not value >= 0 or value == float("inf"):
        raise ValueError(f"{text!r}: expected a size such as 40G, 1.5TB or 512MiB")
    return int(value * _SIZE_UNITS[unit])
