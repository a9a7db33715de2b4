"""Who owns what a run holds: the kernels' library and thread pool, staging buffers, caches.

One owner, `RunResources`. `convert()` and `verify()` open one (`with run_scope():`) and close it
when they end, which releases what it holds in the reverse order it was made. A module asks the
current owner for its slot (`current().slot(key, make, close)`) instead of keeping a module-level
variable. Outside a run (a library call from a test or a REPL) a process default owns the slots;
`reset()` closes it: the one way a test starts clean. A worker process has its own owner, as it
has its own memory. Standard library only.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any


class RunResources:
    """Named slots made on first use and closed together, last made first."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._slots: dict[str, Any] = {}
        self._closers: dict[str, Callable[[Any], None]] = {}

    def slot(self, key: str, make: Callable[[], Any], close: Callable[[Any], None] | None = None) -> Any:
        """The value under `key`, made by `make()` the first time; `close(value)` runs when the owner closes."""
        with self._lock:
            if key not in self._slots:
                self._slots[key] = make()
                if close is not None:
                    self._closers[key] = close
            return self._slots[key]

    def get(self, key: str, default: Any = None) -> Any:
        """The value under `key` if it was made, else `default` (nothing is made)."""
        with self._lock:
            return self._slots.get(key, default)

    def put(self, key: str, value: Any, close: Callable[[Any], None] | None = None) -> None:
        """Replace the value under `key` (the old one closed first, if it has a closer)."""
        self.release(key)
        with self._lock:
            self._slots[key] = value
            if close is not None:
                self._closers[key] = close

    def release(self, key: str) -> None:
        """Close and forget the value under `key`, if any."""
        with self._lock:
            value = self._slots.pop(key, None)
            close = self._closers.pop(key, None)
        if close is not None:
            close(value)

    def close(self) -> None:
        """Close every slot, last made first; the owner is empty (and usable) afterwards."""
        with self._lock:
            keys = list(self._slots)
        for key in reversed(keys):
            self.release(key)


class _Current:
    """Which owner the process uses now (an attribute, so no module state is rebound)."""

    def __init__(self) -> None:
        self.default = RunResources()
        self.owner = self.default


_CURRENT = _Current()


def current() -> RunResources:
    """The owner of the run in progress, or the process default outside one."""
    return _CURRENT.owner


@contextlib.contextmanager
def run_scope() -> Iterator[RunResources]:
    """A run's owner, closed when the run ends. Inside a run already open (verify called by a
    conversion), the outer run's owner is used and stays open."""
    if _CURRENT.owner is not _CURRENT.default:
        yield _CURRENT.owner
        return
    owner = RunResources()
    _CURRENT.owner = owner
    try:
        yield owner
    finally:
        _CURRENT.owner = _CURRENT.default
        owner.close()


def reset() -> None:
    """Close the current owner's slots (tests: start clean)."""
    _CURRENT.owner.close()
