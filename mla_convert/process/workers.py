"""Worker processes shared by convert and verify: one spawn-started pool, one initializer."""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import multiprocessing.context
import os
import signal


def worker_init(threads: int) -> None:
    """Runs first in every worker: keep freed heap pages, and share the cores among the workers
    (for the native kernels, and for torch once a job imports it)."""
    from mla_convert.process import threads as shares
    from mla_convert.process.heap import keep_freed_pages

    keep_freed_pages()
    shares.share_cores(threads)


class _SpawnWithoutSigint(multiprocessing.context.SpawnContext):
    """Workers start with SIGINT blocked, and the block outlives exec: a terminal sends Ctrl-C to the
    whole process group, and a worker interrupted on its own (even while Python starts, before any
    handler could be set) would print its own traceback. The parent stops the workers (`stop`)."""

    class Process(multiprocessing.context.SpawnProcess):
        def start(self) -> None:
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            try:
                super().start()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def process_pool(workers: int) -> cf.ProcessPoolExecutor:
    """`workers` processes, each with its share of the cores for torch's thread pool."""
    threads = max(1, (os.cpu_count() or 1) // workers)
    # spawn: fork after torch's thread pools have started can hang
    return cf.ProcessPoolExecutor(
        workers, mp_context=_SpawnWithoutSigint(), initializer=worker_init, initargs=(threads,)
    )


def stop(pool: cf.ProcessPoolExecutor) -> None:
    """End the pool now (after an interrupt or an error): queued tasks are dropped and running ones
    end with their process instead of finishing first (a shard job can take minutes). What a task
    leaves behind is the caller's to clean up. Returns once every worker has exited."""
    # The executor has no public way to end a running task; its process table is the one handle.
    processes = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for p in processes:
        if p.is_alive():
            p.terminate()
    for p in processes:
        p.join()
    pool.shutdown(wait=True)
