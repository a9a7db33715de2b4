"""The one loop over worker processes, for the conversion's shard jobs and verify's files alike.

`WorkerPool` runs tasks in `workers` spawn-started processes (process.workers). Each task reports
its progress as it goes (`workers.report((key, nbytes))`); the loop wakes every REPORTS_EVERY
seconds to move the caller's progress by those reports, so the bar moves with the work, and when a
task finishes it hands its result to `on_done` and moves the progress by what the task had not
reported (a report that comes after that is already counted, and is dropped). A task's error is
raised here as the worker raised it (workers.result); a worker that ends under a task (killed by
the out-of-memory killer, or one that could not start) is `WorkerDied`, naming how it ended. On
any error or interrupt the workers are stopped at once (workers.stop).
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections.abc import Callable
from typing import Any

from mla_convert.process.interrupts import deferred
from mla_convert.process.workers import death, drain, new_reports, process_pool, result, stop

REPORTS_EVERY = 0.1  # seconds between looks at the workers' progress reports (the bar redraws at 10 Hz)


class WorkerPool:
    """`submit(fn, item, key, size)` runs fn(item) in a worker; `collect()` waits for tasks to
    finish and gives each `on_done(item, result)`. `progress(nbytes)`: the bytes done, `size` per
    task in all, moved by its reports under `key` (None: no reports)."""

    def __init__(self, workers: int, on_done: Callable[[Any, Any], None], progress: Callable[[int], None] | None):
        self._on_done, self._progress = on_done, progress
        self._reports = new_reports() if progress else None
        self._pool = process_pool(workers, self._reports)
        self._running: dict[cf.Future, tuple[Any, str, int]] = {}  # future -> (item, key, size)
        self._reported: dict[str, int] = {}  # key -> bytes reported so far, for the tasks not yet done

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self._pool.shutdown(wait=True)
        else:  # Ctrl-C or a failed task: stop the other tasks now rather than let them finish
            stop(self._pool)

    @property
    def running(self) -> int:
        return len(self._running)

    def submit(self, fn: Callable, item, key: str, size: int) -> None:
        # Not cut short by an interrupt: a submit may start a worker, which the pool must have
        # recorded (and stop() find) before the interrupt unwinds the caller.
        with deferred():
            try:
                future = self._pool.submit(fn, item)
            except cf.BrokenExecutor as e:  # a worker ended under an earlier task
                raise death(self._pool) from e
            self._reported[key] = 0
            self._running[future] = (item, key, size)

    def collect(self, timeout: float | None = None) -> None:
        """Wait up to `timeout` seconds (None: until a task finishes) and pass on every finished task."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:  # wake up often enough that reports move the bar as they come
            left = REPORTS_EVERY if deadline is None else max(0.0, min(REPORTS_EVERY, deadline - time.monotonic()))
            finished, _ = cf.wait(self._running, left, return_when=cf.FIRST_COMPLETED)
            self._take_reports()
            if finished or (deadline is not None and time.monotonic() >= deadline):
                break
        for future in finished:
            item, key, size = self._running.pop(future)
            try:
                done = result(future)  # an error raised as the worker raised it
            except cf.BrokenExecutor as e:
                raise death(self._pool) from e
            self._on_done(item, done)
            already = self._reported.pop(key)
            if self._progress:
                self._progress(max(0, size - already))

    def run_all(self) -> None:
        while self._running:
            self.collect()

    def _take_reports(self) -> None:
        for key, n in drain(self._reports) if self._reports is not None else ():
            if key in self._reported:  # a late report of a task already done is in its rest
                self._reported[key] += n
                self._progress(n)
