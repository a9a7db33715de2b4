"""Worker processes end with their parent however it ends, kill -9 included, and `stop` leaves
nothing of a pool running: a real SIGKILL of the parent alone, with --workers 2."""

import os
import signal
import threading
import time

import pytest

from mla_convert.process import parent_death
from mla_convert.process.pool import WorkerPool
from mla_convert.process.workers import WorkerDied, process_pool, stop
from support.checkpoints import SHARD1
from support.processes import group_members, start_cli, wait_until, workers_of


def _running(pool, n: int) -> list:
    futures = [pool.submit(time.sleep, 60) for _ in range(n)]
    wait_until(lambda: all(f.running() for f in futures), what="the tasks to run")
    return futures


@pytest.mark.slow
def test_stop_returns_once_the_pools_manager_thread_has_ended():
    """Before, the manager thread was left closing its wakeup pipe while the interpreter's exit
    wrote to it: 'Exception ignored in: <module threading> ... Bad file descriptor' after the one
    line of an interrupted run (the flaky test_ctrl_c_to_the_process_group_stops_the_workers)."""
    for _ in range(3):
        pool = process_pool(2)
        _running(pool, 2)
        manager = pool._executor_manager_thread
        stop(pool)
        assert not manager.is_alive()
        assert not [t for t in threading.enumerate() if t is manager]


@pytest.mark.slow
def test_stop_also_ends_a_worker_the_pool_had_not_recorded():
    """A worker whose start an interrupt cut short is alive but not in the pool's table."""
    pool = process_pool(1)
    _running(pool, 1)
    stray = pool._mp_context.Process(target=time.sleep, args=(60,))
    stray.start()
    stop(pool)
    assert not stray.is_alive() and stray.exitcode == -signal.SIGKILL


def test_a_process_not_started_by_multiprocessing_has_no_parent_to_watch():
    assert parent_death.watch_parent() is False
    assert not [t for t in threading.enumerate() if t.name == parent_death.WATCH_THREAD_NAME]


@pytest.mark.slow
def test_workers_die_with_a_parent_killed_by_sigkill(tiny_src, tmp_path):
    """Before: both workers (~400 MB each for R1) and the resource tracker idled on under PID 1."""
    out, gate = tmp_path / "out", tmp_path / "gate"
    p = start_cli("convert", tiny_src, "--out", out, "--quiet", "--workers", 2, group=True,
                  pause_at=(f"after-job:{SHARD1}", gate))  # fmt: skip
    wait_until(lambda: os.path.exists(f"{gate}.reached") or p.poll() is not None, what="the first job")
    assert p.poll() is None and len(workers_of(p.pid)) == 2, group_members(p.pid)
    os.kill(p.pid, signal.SIGKILL)  # the parent alone
    p.wait(timeout=10)
    t0 = time.monotonic()
    # Within seconds (the kernel's SIGKILL is at once; the tracker then reads end-of-file), on a busy machine too.
    wait_until(lambda: not group_members(p.pid), timeout=10, what="the workers and the resource tracker to end")
    assert time.monotonic() - t0 < 10


def _died(start) -> WorkerDied:
    """The WorkerDied of a one-worker pool whose task `start(pool)` submits and ends as it likes."""
    with pytest.raises(WorkerDied) as died, WorkerPool(1, lambda item, result: None, None) as pool:
        start(pool)
        pool.run_all()
    return died.value


def test_a_worker_killed_under_its_task_is_named_by_its_signal():
    """Before: every ended worker was 'killed (by the out-of-memory killer?)', whatever ended it."""

    def kill_it(pool, signum=signal.SIGKILL):
        pool.submit(time.sleep, 60, "sleep", 0)
        wait_until(lambda: _pids(pool), what="the worker")
        os.kill(_pids(pool)[0], signum)

    died = _died(kill_it)
    assert str(died) == "a worker process was killed by SIGKILL (the out-of-memory killer?)" and died.out_of_memory
    died = _died(lambda pool: kill_it(pool, signal.SIGSEGV))
    assert str(died) == "a worker process was killed by SIGSEGV" and not died.out_of_memory


def test_a_worker_that_exits_is_named_by_its_status():
    died = _died(lambda pool: pool.submit(os._exit, 3, "exit", 0))
    assert str(died).startswith("a worker process exited with status 3 before its task was done ")
    assert died.signum is None and not died.out_of_memory


def _pids(pool) -> list[int]:
    return [p.pid for p in pool._pool._processes.values()]
