"""Reused, page-aligned memory for the conversion's hot path (no torch).

A fresh buffer costs a page fault per 4 KB the first time it is written, about as much CPU as a copy
of the same bytes. The conversion touches every byte of a checkpoint, so its buffers are made once
and reused: private anonymous maps, asked for transparent huge pages (a fault per 2 MB where the
kernel grants them), and given to C by address.
"""

from __future__ import annotations

import ctypes
import mmap

PAGE = mmap.PAGESIZE
HUGE = 2 * 1024 * 1024


def new_map(nbytes: int) -> mmap.mmap:
    """A private anonymous map of at least `nbytes` (whole pages; huge pages asked for where they fit)."""
    size = max(PAGE, -(-nbytes // PAGE) * PAGE)
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    m = mmap.mmap(-1, size, flags=flags) if flags else mmap.mmap(-1, size)
    if size >= HUGE and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel without transparent huge pages: 4 KB pages
            pass
    return m


def address_of(buf) -> int:
    """The address of a writable buffer's first byte (a map, a bytearray), for C. The buffer must
    outlive every use of the address."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


class Buffer:
    """One reused buffer that grows to the largest size asked of it (never shrinks; `release()`
    lets go). `view(n)` is its first n bytes; `address` where they start."""

    def __init__(self) -> None:
        self._map: mmap.mmap | None = None
        self.address = 0
        self.capacity = 0

    def view(self, nbytes: int) -> memoryview:
        if nbytes > self.capacity:
            self._map = None  # the old map goes once nothing views it
            self._map = new_map(nbytes)
            self.capacity = len(self._map)
            self.address = address_of(self._map)
        return memoryview(self._map)[:nbytes]

    def release(self) -> None:
        self._map, self.address, self.capacity = None, 0, 0
