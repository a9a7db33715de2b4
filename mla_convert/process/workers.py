"""Worker processes shared by convert and verify: one spawn-started pool, one initializer.

A spawned worker is a fresh interpreter, and multiprocessing has it run the parent's main module
again (as `__mp_main__`) before its first task, so that functions defined there can be sent to it.
Nothing the pool sends is defined there, and a caller's script without an `if __name__ ==
"__main__":` guard would convert again in every worker: the workers start without it
(`_SpawnPopen`). Where that cannot be done, `unguarded_script()` says so before any work.
"""

from __future__ import annotations

import ast
import concurrent.futures as cf
import contextlib
import itertools
import multiprocessing
import multiprocessing.context
import multiprocessing.spawn
import os
import pickle
import queue
import signal
import sys
import time
import traceback
import types
from pathlib import Path

from mla_convert.process.interrupts import STOP_SIGNALS
from mla_convert.process.parent_death import die_with_parent


class _InWorker:
    """What `worker_init` gives this process for its life: the parent's queue for what its tasks
    report as they go (`report`); None in the parent."""

    reports = None


_IN_WORKER = _InWorker()


def worker_init(threads: int, reports=None) -> None:
    """Runs first in every worker: keep freed heap pages, and share the cores among the workers
    (for the native kernels, and for torch once a job imports it); `reports`: the pool's queue."""
    from mla_convert.process import threads as shares
    from mla_convert.process.heap import keep_freed_pages

    _IN_WORKER.reports = reports
    keep_freed_pages()
    shares.share_cores(threads)


class _SpawnWithoutSigint(multiprocessing.context.SpawnContext):
    """Workers start with SIGINT, SIGTERM and SIGHUP blocked, and the block outlives exec: a terminal
    (Ctrl-C, a hang-up) or `timeout`/a job scheduler (SIGTERM) signals the whole process group, and a
    worker stopped on its own (even while Python starts, before any handler could be set) would
    print its own traceback or break the pool. The parent stops the workers (`stop`), and each
    worker ends with its parent however that ends (process.parent_death), first thing in `run`.
    Every process started is kept in `started`, also one whose start an interrupt cut short
    before the pool recorded it."""

    def __init__(self) -> None:
        super().__init__()
        self.started: list[multiprocessing.process.BaseProcess] = []

    def Process(self, *args, **kwargs):
        process = _Worker(*args, **kwargs)
        process.starter = self
        return process


class _SpawnLeavingMainOut:
    """multiprocessing.spawn as spawn's Popen uses it, but the preparation data it sends a child
    names no main module to run again."""

    def __getattr__(self, name: str):
        return getattr(multiprocessing.spawn, name)

    @staticmethod
    def get_preparation_data(name: str) -> dict:
        data = multiprocessing.spawn.get_preparation_data(name)
        data.pop("init_main_from_name", None)
        data.pop("init_main_from_path", None)
        return data


def _popen_leaving_main_out() -> type | None:
    """spawn's own Popen (POSIX), its `_launch` run with `_SpawnLeavingMainOut` for the module
    `spawn` it names; None where spawn's Popen is not the one this reads."""
    try:
        from multiprocessing import popen_spawn_posix
    except ImportError:  # Windows
        return None
    launch = popen_spawn_posix.Popen._launch
    if not {"spawn", "get_preparation_data"} <= set(launch.__code__.co_names):
        return None
    scope = {**launch.__globals__, "spawn": _SpawnLeavingMainOut()}
    own = types.FunctionType(launch.__code__, scope, launch.__name__, launch.__defaults__, launch.__closure__)
    return type("_SpawnPopen", (popen_spawn_posix.Popen,), {"_launch": own})


_SpawnPopen = _popen_leaving_main_out()


def unguarded_script() -> str | None:
    """Where workers cannot start without the caller's main module (`_SpawnPopen` is None) and the
    call comes from the top level of a script, outside an `if __name__ == "__main__":` block, so
    that every worker would run it again: the one line that says what to add. Else None."""
    if _SpawnPopen is not None:
        return None
    main, path = sys.modules.get("__main__"), getattr(sys.modules.get("__main__"), "__file__", None)
    runs_again = {"init_main_from_path", "init_main_from_name"} & set(multiprocessing.spawn.get_preparation_data("?"))
    if path is None or not runs_again:
        return None
    frame, line = sys._getframe(), None
    while frame is not None:  # the script's own top level, outermost
        if frame.f_code.co_name == "<module>" and frame.f_globals is vars(main):
            line = frame.f_lineno
        frame = frame.f_back
    try:
        tree = ast.parse(Path(path).read_bytes())
    except (OSError, SyntaxError, ValueError):
        return None
    statement = next((s for s in tree.body if line is not None and s.lineno <= line <= (s.end_lineno or 0)), None)
    if statement is None or _is_main_guard(statement):
        return None
    return (
        f"{path} calls mla_convert with more than one worker from its top level, and each worker process would "
        'run it again: put the call under `if __name__ == "__main__":`'
    )


def _is_main_guard(statement: ast.stmt) -> bool:
    if not isinstance(statement, ast.If) or not isinstance(test := statement.test, ast.Compare):
        return False
    sides = [test.left, *test.comparators]
    found = {side.id if isinstance(side, ast.Name) else repr(getattr(side, "value", None)) for side in sides}
    return len(sides) == 2 and isinstance(test.ops[0], ast.Eq) and found == {"__name__", "'__main__'"}


class _Worker(multiprocessing.context.SpawnProcess):
    starter: _SpawnWithoutSigint | None = None

    @staticmethod
    def _Popen(process_obj):
        if _SpawnPopen is None:
            return multiprocessing.context.SpawnProcess._Popen(process_obj)
        return _SpawnPopen(process_obj)

    def start(self) -> None:
        self.parent_pid = os.getpid()
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, set(STOP_SIGNALS))
        try:
            super().start()
            if self.starter is not None:
                self.starter.started.append(self)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)

    def run(self) -> None:
        die_with_parent(self.parent_pid)
        super().run()

    def __getstate__(self) -> dict:  # what the child gets: not the parent's record of its siblings
        return {k: v for k, v in self.__dict__.items() if k != "starter"}


def process_pool(workers: int, reports=None) -> cf.ProcessPoolExecutor:
    """`workers` processes, each with its share of the cores for torch's thread pool; `reports`
    (from `new_reports`): where their tasks' `report` calls go."""
    threads = max(1, (os.cpu_count() or 1) // workers)
    # spawn: fork after torch's thread pools have started can hang
    return cf.ProcessPoolExecutor(
        workers, mp_context=_SpawnWithoutSigint(), initializer=worker_init, initargs=(threads, reports)
    )


def new_reports():
    """A queue for `process_pool(..., reports=)`: the parent reads it (get_nowait) while tasks run.
    Its writers never wait on the parent: a worker's feeder thread sends, the task goes on."""
    return multiprocessing.get_context("spawn").Queue()


def report(item) -> None:
    """In a worker: send `item` (small, picklable) to the pool's reports queue; without one, nothing."""
    if _IN_WORKER.reports is not None:
        _IN_WORKER.reports.put(item)


class _Carried(Exception):
    """A task's exception and its causes, pickled one by one: a process pool sends the exception
    alone, its __cause__ replaced by the worker's traceback as text, and a one-worker run's message
    (the hint that comes from an OSError's errno, say) would be lost with it."""

    def __init__(self, chain: list[bytes], where: str):
        super().__init__(chain, where)
        self.chain, self.where = chain, where


@contextlib.contextmanager
def errors_intact():
    """Around a task in a worker: an exception leaves it whole (`result` raises it again)."""
    try:
        yield
    except Exception as e:
        raise _Carried(_pickled_causes(e), traceback.format_exc()) from None


def _pickled_causes(e: BaseException | None) -> list[bytes]:
    chain, seen = [], set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        try:
            data = pickle.dumps(e)
            pickle.loads(data)
        except Exception:  # one that does not survive pickling: its type's name and message
            data = pickle.dumps(RuntimeError(f"{type(e).__name__}: {e}"))
        chain.append(data)
        e = e.__cause__
    return chain


def result(future: cf.Future):
    """future.result(); a task run under `errors_intact` raises here what it raised in the worker:
    the same type and message, with the same causes (the worker's traceback as a note)."""
    try:
        return future.result()
    except _Carried as carried:
        errors = [pickle.loads(data) for data in carried.chain]
        for e, cause in itertools.pairwise(errors):
            e.__cause__ = cause
        errors[0].add_note(f"raised in a worker process:\n{carried.where}")
        raise errors[0] from errors[0].__cause__


def drain(reports) -> list:
    """What is in `reports` now, without waiting."""
    items = []
    while True:
        try:
            items.append(reports.get_nowait())
        except queue.Empty:
            return items


class WorkerDied(Exception):
    """A worker process ended under a task: killed by `signum`, or exited (`signum` None). The
    message says which; `out_of_memory`: SIGKILL, what the out-of-memory killer sends."""

    def __init__(self, message: str, signum: int | None = None):
        super().__init__(message)
        self.signum = signum

    @property
    def out_of_memory(self) -> bool:
        return self.signum == signal.SIGKILL


def death(pool: cf.ProcessPoolExecutor, wait: float = 2.0) -> WorkerDied:
    """How a broken pool's worker ended: a signal (SIGKILL: the out-of-memory killer, most likely)
    before an exit status (a worker that could not start, or that ended itself). The pool notices
    the end before this process has reaped the worker, so its status is waited for a moment."""
    deadline = time.monotonic() + wait
    while True:
        codes = [code for p in _processes_of(pool) if (code := p.exitcode) is not None]
        if [c for c in codes if c != 0] or time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    killed, exited = [c for c in codes if c < 0], [c for c in codes if c > 0] or codes
    if killed:
        signum = -killed[0]
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        oom = " (the out-of-memory killer?)" if signum == signal.SIGKILL else ""
        return WorkerDied(f"a worker process was killed by {name}{oom}", signum)
    if exited:
        return WorkerDied(
            f"a worker process exited with status {exited[0]} before its task was done (it could not start, or "
            "ended itself: its own error is on stderr)"
        )
    return WorkerDied("a worker process ended before its task was done")


def _processes_of(pool: cf.ProcessPoolExecutor) -> list:
    """Every worker the pool started: its process table, and the context's record, which also holds
    any process started but not yet in that table (an interrupt cut its start short). The executor
    has no public way to reach them."""
    processes = list((getattr(pool, "_processes", None) or {}).values())
    return processes + [p for p in getattr(getattr(pool, "_mp_context", None), "started", ()) if p not in processes]


def stop(pool: cf.ProcessPoolExecutor) -> None:
    """End the pool now (after an interrupt or an error): queued tasks are dropped and running ones
    end with their process instead of finishing first (a shard job can take minutes). What a task
    leaves behind is the caller's to clean up. Returns once every worker has exited and the pool's
    manager thread with them."""
    # The executor has no public way to end a running task: its processes are the one handle.
    processes = _processes_of(pool)
    # shutdown(wait=False) forgets the manager thread, so a later shutdown(wait=True) waits for
    # nothing: joined here instead. Left running, it closes its wakeup pipe while the interpreter's
    # exit writes to it: "Exception ignored in: <module 'threading'> ... OSError: [Errno 9] Bad
    # file descriptor" after the command's one line.
    manager = getattr(pool, "_executor_manager_thread", None)
    pool.shutdown(wait=False, cancel_futures=True)
    for p in processes:
        if p.is_alive():
            p.kill()  # SIGKILL: workers block SIGTERM (see _SpawnWithoutSigint)
    for p in processes:
        p.join()
    if manager is not None and manager.is_alive():
        manager.join()
    pool.shutdown(wait=True)
