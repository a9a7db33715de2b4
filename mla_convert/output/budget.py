"""A disk budget (`convert --upload --max-disk SIZE`): the bytes a run may hold on --out's
filesystem at once, source shards (--stream) and output files together.

Every byte is reserved before it is written: a source shard before its download starts, a shard
job's output files before the job starts (both at once, as one ticket, in job order: a later job
can never hold the room an earlier one waits for), and released when its file is deleted (a
source shard once every job that reads it is checked, an output file once a commit holds it).
What an earlier run left on disk is reserved as it is found (`force`). A reservation that does
not fit waits; one larger than the whole budget is refused at once (the dry run names the
smallest budget that works before anything starts). `close(error)` wakes every waiter with that
error: a stage that failed stops the others.
"""

from __future__ import annotations

import threading
import time

from mla_convert.errors import OutputError
from mla_convert.units import gb


class DiskBudget:
    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0
        self.peak = 0
        self.waiting = 0  # reservations waiting for room: the uploader commits sooner while there are
        self._cond = threading.Condition()
        self._error: BaseException | None = None

    def reserve(self, nbytes: int, timeout: float | None = None) -> bool:
        """Wait until `nbytes` fit and reserve them (False when `timeout` passed first)."""
        if nbytes > self.limit:
            raise OutputError(
                f"--max-disk {gb(self.limit)}: one step needs {gb(nbytes)} on disk at once; give at least that"
            )
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self.waiting += 1
            self._cond.notify_all()  # a waiter is news to the uploader
            try:
                while self._error is None and self.used + nbytes > self.limit:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    self._cond.wait(left)
                if self._error is not None:
                    raise self._error
                self._take(nbytes)
                return True
            finally:
                self.waiting -= 1

    def force(self, nbytes: int) -> None:
        """Count `nbytes` already on disk (an earlier run's), room or not."""
        with self._cond:
            self._take(nbytes)

    def release(self, nbytes: int) -> None:
        with self._cond:
            self.used -= nbytes
            self._cond.notify_all()

    def wait_for_waiters(self, timeout: float) -> bool:
        """Whether someone waits for room, waiting up to `timeout` for one to start waiting."""
        with self._cond:
            return self._cond.wait_for(lambda: self.waiting > 0 or self._error is not None, timeout) and not self._error

    def check(self) -> None:
        """Raise the error the budget was closed with, if it was."""
        if self._error is not None:
            raise self._error

    def close(self, error: BaseException) -> None:
        """Every waiter, now and later, raises `error`."""
        with self._cond:
            self._error = error
            self._cond.notify_all()

    def _take(self, nbytes: int) -> None:
        self.used += nbytes
        self.peak = max(self.peak, self.used)
