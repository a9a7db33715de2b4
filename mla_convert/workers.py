"""Worker processes shared by convert and verify: one spawn-started pool, one initializer."""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import os


def worker_init(threads: int) -> None:
    """Runs first in every worker: keep freed heap pages, and share the cores among the workers."""
    import torch

    from .heap import keep_freed_pages

    keep_freed_pages()
    torch.set_num_threads(threads)


def process_pool(workers: int) -> cf.ProcessPoolExecutor:
    """`workers` processes, each with its share of the cores for torch's thread pool."""
    threads = max(1, (os.cpu_count() or 1) // workers)
    ctx = multiprocessing.get_context("spawn")  # fork after torch's thread pools have started can hang
    return cf.ProcessPoolExecutor(workers, mp_context=ctx, initializer=worker_init, initargs=(threads,))
