"""Ctrl-C without crashes: no thread may outlive the memory it works on, however the caller unwinds.

Python raises KeyboardInterrupt in the main thread between two bytecodes, wherever it is. A caller
that hands raw pointers to helper threads (the C kernels, native._rows_parallel) and is unwound by
it frees that memory while the helpers still read and write it: a segfault when the buffer was
unmapped, silent corruption when it was not. `deferred()` holds the interrupt back for the few
milliseconds such a section takes and raises it right after.

The CLI's own policy (`install`): the first Ctrl-C raises KeyboardInterrupt, and another within
REPEAT_SECONDS is ignored while the command cleans up (joins its threads, removes its partial
files), so a double press does not cut that short. A press after that raises again: the cleanup is
stuck, or the first interrupt was swallowed by library code, and the user still wants out.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time

REPEAT_SECONDS = 2.0


@contextlib.contextmanager
def deferred():
    """Run the block with SIGINT's Python handler held back; if a SIGINT came meanwhile, the handler
    runs (and raises, for the default one) once the block is done. Outside the main thread there is
    nothing to defer: Python runs signal handlers in the main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):  # SIG_IGN (a background job), SIG_DFL, or set from C: nothing raises here
        yield
        return
    caught: list = []
    signal.signal(signal.SIGINT, lambda signum, frame: caught.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            previous(signal.SIGINT, caught[0])


class _RepeatGuard:
    """The CLI's SIGINT handler: raise KeyboardInterrupt, unless the last one was under
    REPEAT_SECONDS ago (the command is cleaning up)."""

    def __init__(self) -> None:
        self.last: float | None = None

    def __call__(self, signum, frame) -> None:
        now = time.monotonic()
        if self.last is not None and now - self.last < REPEAT_SECONDS:
            return
        self.last = now
        raise KeyboardInterrupt


def install() -> None:
    """The command's SIGINT policy (see the module docstring), with a handler of its own (no state
    outlives it). A process started with SIGINT ignored (a background job of a shell script,
    nohup) keeps ignoring it."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _RepeatGuard())


def ignore() -> None:
    """Ignore SIGINT from now on, unless something other than Python's or this module's handler
    owns it. SIG_IGN also survives interpreter shutdown, which resets a Python-level handler to the
    default action (killing the process)."""
    handler = signal.getsignal(signal.SIGINT)
    if handler is signal.default_int_handler or isinstance(handler, _RepeatGuard):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
