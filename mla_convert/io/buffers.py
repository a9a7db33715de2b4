"""Reused, page-aligned memory for the hot paths of the conversion and verify (no torch).

A fresh buffer costs a page fault per 4 KB the first time it is written, about as much CPU as a copy
of the same bytes. The conversion and verify touch every byte of a checkpoint, so their buffers are
made once and reused: private anonymous maps (`new_map`, the one allocator), asked for transparent
huge pages (a fault per 2 MB where the kernel grants them), or mapped whole in one call, and given
to C by address. `scratch()` is this thread's set of named buffers for the run in progress: a slot
of the run's owner (process.resources), let go when `convert()` or `verify()` ends.
"""

from __future__ import annotations

import ctypes
import mmap
import threading

from mla_convert.process import resources

PAGE = mmap.PAGESIZE
HUGE = 2 * 1024 * 1024


def new_map(nbytes: int, *, populate: bool = False) -> mmap.mmap:
    """A private anonymous map of at least `nbytes` (whole pages, zero-filled). `populate`: its pages
    mapped now, in one call (MAP_POPULATE), for memory read into at once; otherwise as they are first
    written, huge pages asked for where they fit."""
    size = max(PAGE, -(-nbytes // PAGE) * PAGE)
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    if populate and flags and hasattr(mmap, "MAP_POPULATE"):
        return mmap.mmap(-1, size, flags=flags | mmap.MAP_POPULATE)
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


class Scratch:
    """One thread's reused memory in a run: `scratch().NAME` is its Buffer NAME (made on first use),
    `kept(name, make)` a structure of buffers made once by `make()` (verify's read buffers)."""

    def __init__(self, made: list[Buffer]) -> None:
        self._made = made  # every Buffer of the run's threads, let go when the run ends
        self._kept: dict[str, object] = {}

    def __getattr__(self, name: str) -> Buffer:
        if name.startswith("_"):
            raise AttributeError(name)
        buf = Buffer()
        setattr(self, name, buf)
        self._made.append(buf)
        return buf

    def kept(self, name: str, make):
        if name not in self._kept:
            self._kept[name] = make()
        return self._kept[name]


class _RunScratch:
    """The run's slot: a Scratch per thread, and every Buffer they made, released together."""

    def __init__(self) -> None:
        self._per_thread = threading.local()
        self._made: list[Buffer] = []

    def mine(self) -> Scratch:
        if not hasattr(self._per_thread, "scratch"):
            self._per_thread.scratch = Scratch(self._made)
        return self._per_thread.scratch

    def release(self) -> None:
        for buf in self._made:
            buf.release()


_SCRATCH = "io.buffers.scratch"  # the run's slot (process.resources)


def scratch() -> Scratch:
    """This thread's reused buffers for the run in progress (made on first use, let go with the run)."""
    return resources.current().slot(_SCRATCH, _RunScratch, _RunScratch.release).mine()
