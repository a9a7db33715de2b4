"""verify, running the data pass: every file's task, largest first, on file threads of
this process (order.file_threads), or in `workers` worker processes (process.pool). Either way a
Ctrl-C ends it at once."""

from __future__ import annotations

import concurrent.futures as cf
import threading
from pathlib import Path

from mla_convert.constants import LEFT_RUNNING_THREAD_PREFIX
from mla_convert.errors import VerificationError
from mla_convert.process.pool import WorkerPool
from mla_convert.process.workers import WorkerDied, errors_intact, report
from mla_convert.settings import ProgressFactory
from mla_convert.verification.data_pass import run_file_task
from mla_convert.verification.order import file_threads, largest_first
from mla_convert.verification.tasks import FileResult, FileTask

FILE_THREADS_NAME = LEFT_RUNNING_THREAD_PREFIX + "verify-file"
FILE_THREADS: int | None = None  # files at once in this process; None: order.file_threads()


class _Stopped(Exception):
    """Raised in a file thread, between two tensors, once verify was interrupted."""


def run_files(
    tasks: list[FileTask], root: Path, workers: int, progress_factory: ProgressFactory | None
) -> dict[str, FileResult]:
    """Each task's result, by file; the progress advances by each file's size as it is read."""
    sizes = {t.rel: _size(root / t.rel) for t in tasks}
    advance = progress_factory(sum(sizes.values())) if progress_factory else None
    if workers <= 1 or len(tasks) <= 1:
        return _run_in_threads(tasks, sizes, advance)
    results: dict[str, FileResult] = {}

    def done(task: FileTask, result: FileResult) -> None:
        results[task.rel] = result

    try:
        with WorkerPool(workers, done, advance) as pool:
            for task in _largest_first(tasks, sizes):  # the workers only read: stopped where they are
                pool.submit(run_reported_file_task, task, task.rel, sizes[task.rel])
            pool.run_all()
    except WorkerDied as e:
        raise VerificationError(f"{e}; use fewer --workers" if e.out_of_memory else str(e)) from e
    return results


def run_reported_file_task(task: FileTask) -> FileResult:
    """run_file_task in a worker process: each tensor's bytes reported to the parent as they are
    checked (process.workers.report), and an error raised whole in the parent (workers.result), as
    a conversion's shard jobs do."""
    with errors_intact():
        return run_file_task(task, lambda n: report((task.rel, n)))


def _run_in_threads(tasks: list[FileTask], sizes: dict[str, int], advance) -> dict[str, FileResult]:
    """FILE_THREADS (or order.file_threads()) files at a time in this process, biggest first: the heavy parts (reads,
    sha256, the C and torch checks) release the GIL, so one file's hash overlaps another's checks.

    Interrupted (Ctrl-C in the main thread), it raises at once: the files not started are dropped,
    and each thread stops after the tensor it is checking (its memory is its own, nothing here
    waits for it)."""
    lock = threading.Lock()
    stop = threading.Event()

    def run_one(task: FileTask) -> FileResult:
        done = 0

        def step(n: int) -> None:
            nonlocal done
            if stop.is_set():
                raise _Stopped
            done += n
            if advance:
                with lock:
                    advance(n)

        result = run_file_task(task, step)
        if advance:
            with lock:
                advance(max(0, sizes[task.rel] - done))
        return result

    order = _largest_first(tasks, sizes)
    at_once = FILE_THREADS or file_threads()
    pool = cf.ThreadPoolExecutor(min(at_once, len(order)) or 1, thread_name_prefix=FILE_THREADS_NAME)
    try:
        results = {t.rel: r for t, r in zip(order, pool.map(run_one, order), strict=True)}
    except BaseException:
        stop.set()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    return {t.rel: results[t.rel] for t in tasks}


def _largest_first(tasks: list[FileTask], sizes: dict[str, int]) -> list[FileTask]:
    by_rel = {t.rel: t for t in tasks}
    return [by_rel[rel] for rel in largest_first(sizes)]


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
