"""Keep freed memory in the process heap instead of handing it back to the kernel.

A conversion allocates buffers of the same few sizes for every tensor. By default glibc serves
large ones with mmap and unmaps them when freed, so each tensor page-faults its buffers in again,
at a CPU cost per byte. Here buffers up to 32 MB (glibc's largest mmap threshold; every routed
expert's weight in R1 is 14.7 MB, 29 MB as bf16) come from the heap and are reused as they are, and
the heap is not trimmed. Bigger ones (dense-layer weights, a handful per checkpoint) are still
unmapped when freed, so the heap's high-water mark, which is what RSS shows, stays low: turning
mmap off altogether saves more faults, but each dense-layer buffer then stays in the heap and
raises the peak RSS. Process-wide, so only the CLI and the converter's worker processes turn it on.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
LARGEST_MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc refuses more (HEAP_MAX_SIZE / 2 on 64-bit)


def keep_freed_pages() -> bool:
    """Turn the behaviour on for this process (again is harmless: the same two settings); False
    where the C library has no glibc mallopt."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success; the trim threshold is an int, so "never" is its largest value.
    return bool(mallopt(M_MMAP_THRESHOLD, LARGEST_MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
