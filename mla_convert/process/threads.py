"""How many threads this process computes on: its share of the cores.

A conversion's native kernels split each tensor over this many threads (kernels.native), and torch,
where a run imports it, gets the same count. A worker process is given its share
(process.workers); otherwise it is every CPU the process may run on (its affinity, so `taskset`
narrows it).
"""

from __future__ import annotations

import os
import sys


class _Share:
    """The process's share, set by `share_cores` (a process setting, not a run's: a worker keeps it
    for its life)."""

    n: int | None = None


_SHARE = _Share()


def cores() -> int:
    """The CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def share_cores(n: int | None) -> None:
    """Compute on `n` threads from now on (None: on every CPU this process may run on)."""
    _SHARE.n = None if n is None else max(1, int(n))
    apply_to_torch()


def count() -> int:
    return _SHARE.n if _SHARE.n is not None else cores()


def apply_to_torch() -> None:
    """Give torch the share too, if torch is imported (callers that import it later call this)."""
    torch = sys.modules.get("torch")
    if _SHARE.n is not None and torch is not None and hasattr(torch, "set_num_threads"):
        torch.set_num_threads(_SHARE.n)
