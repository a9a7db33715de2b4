"""What a converting or verifying command does before its work, and how it ends when interrupted."""

from __future__ import annotations

import threading

from mla_convert.constants import LEFT_RUNNING_THREAD_PREFIX
from mla_convert.process.heap import keep_freed_pages
from mla_convert.process.torch_import import import_torch


def start_heavy_process(torch: bool = True) -> None:
    """What a converting or verifying command does first (its workers: process.workers.worker_init).

    Import torch (`torch`; process.torch_import: with the cyclic GC paused), then keep freed heap
    pages (process.heap). A conversion passes torch=False: it imports torch only if its kernels need
    it (conversion.compute), and one whose native kernels this machine has checked never does.
    """
    if torch:
        import_torch()
    keep_freed_pages()


def still_working() -> bool:
    """Whether threads an interrupted command leaves to finish on their own are still at it (named
    with constants.LEFT_RUNNING_THREAD_PREFIX by the modules that start them; the CLI then ends
    with os._exit rather than wait for them)."""
    return any(t.is_alive() and t.name.startswith(LEFT_RUNNING_THREAD_PREFIX) for t in threading.enumerate())
