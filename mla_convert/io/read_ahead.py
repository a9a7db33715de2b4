"""Ask the kernel to read file ranges into the page cache ahead of use (posix_fadvise WILLNEED).

No torch here: the CLI starts the disk on a command's first files while Python is still importing
torch, which takes long enough for a cold disk to read gigabytes.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

STARTUP_BUDGET = 2 * 1024**3  # most bytes asked for during start-up, in all
STARTUP_STEP = 64 * 1024 * 1024  # asked for in turns between the files that are read at once


def will_need(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start reading a byte range into the page cache, without waiting: the
    disk reads the next tensor while this one is worked on (a no-op where unsupported)."""
    if length > 0 and hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass


def startup_budget() -> int:
    """STARTUP_BUDGET, or an eighth of the free memory if that is less: pages read ahead must
    still be cached when the command reaches them."""
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return STARTUP_BUDGET
    return min(STARTUP_BUDGET, free // 8)


def plan_startup_reads(
    sizes: list[int], streams: int, budget: int, step: int = STARTUP_STEP
) -> list[tuple[int, int, int]]:
    """(file index, offset, length) requests for the first `streams` of these files, which are
    read at once and front to back: each gets an equal share of `budget`, asked for `step` bytes
    at a time in turns, so every file's front is read first."""
    active = list(range(min(streams, len(sizes))))
    share = budget // max(1, len(active))
    ends = {i: min(sizes[i], share) for i in active}
    requests, offset = [], 0
    while any(offset < ends[i] for i in active):
        requests += [(i, offset, min(step, ends[i] - offset)) for i in active if offset < ends[i]]
        offset += step
    return requests


def read_ahead_in_background(paths: list[Path], streams: int, budget: int | None = None) -> threading.Thread:
    """Start reading the fronts of `paths` (in the order the command reads them, `streams` at a
    time) on a daemon thread; the command does not wait for it. Unreadable files are skipped."""
    budget = startup_budget() if budget is None else budget

    def run() -> None:
        fds: dict[int, int] = {}
        try:
            sizes = []
            for i, p in enumerate(paths[:streams]):
                try:
                    fds[i] = os.open(p, os.O_RDONLY)
                    sizes.append(os.fstat(fds[i]).st_size)
                except OSError:
                    sizes.append(0)
            for i, offset, length in plan_startup_reads(sizes, streams, budget):
                will_need(fds[i], offset, length)
        finally:
            for fd in fds.values():
                os.close(fd)

    thread = threading.Thread(target=run, name="startup-read-ahead", daemon=True)
    thread.start()
    return thread
