"""What a converting or verifying command does before its work, and how it ends when interrupted."""

from __future__ import annotations

import sys
import threading

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


# Threads that an interrupted command leaves to finish on their own (by name prefix, in the
# module that starts them): verify's file readers (each on its tensor: seconds, on R1's largest)
# a --stream download and an upload's file transfers (minutes). Their memory is their own and nothing they do is left to
# finalize, so the process ends as soon as it has said why, without waiting for them.
_LEFT_RUNNING = {
    "mla_convert.verification.runners": "FILE_THREADS_NAME",
    "mla_convert.source.hub": "DOWNLOAD_THREAD_NAME",
    "mla_convert.publish.upload": "UPLOAD_THREAD_NAME",  # each on one file's upload (minutes)
}


def still_working() -> bool:
    """Whether threads of _LEFT_RUNNING are still at it (the CLI then ends with os._exit)."""
    names = [getattr(sys.modules[m], attr) for m, attr in _LEFT_RUNNING.items() if m in sys.modules]
    return any(t.is_alive() and t.name.startswith(tuple(names)) for t in threading.enumerate()) if names else False
