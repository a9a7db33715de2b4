"""Ctrl-C, SIGTERM and SIGHUP without crashes: no thread may outlive the memory it works on, however
the caller unwinds.

Python raises KeyboardInterrupt in the main thread between two bytecodes, wherever it is. A caller
that hands raw pointers to helper threads (the C kernels, native._rows_parallel) and is unwound by
it frees that memory while the helpers still read and write it: a segfault when the buffer was
unmapped, silent corruption when it was not. `deferred()` holds the interrupt back for the few
milliseconds such a section takes and raises it right after.

The CLI's own policy (`install`): SIGINT (Ctrl-C), SIGTERM (a job scheduler's stop, `timeout`,
`kill`) and SIGHUP (a closed terminal or ssh session) all stop a command the same way: the first
raises `Interrupted` (a KeyboardInterrupt that knows its signal, so the exit code can be 128 + its
number), and another within REPEAT_SECONDS is ignored while the command cleans up (joins its
threads, removes its partial files), so a double press does not cut that short. One after that
raises again: the cleanup is stuck, or the first interrupt was swallowed by library code, and the
user still wants out. A signal the process was started with ignored (nohup ignores SIGHUP, a
script's background job SIGINT) stays ignored.

Crash points (`crash_point`, `CRASH_POINTS`) are the other way a run stops: dead, at a named point,
where a test asks for it.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable

REPEAT_SECONDS = 2.0
# The signals that stop a command as Ctrl-C does, in the order deferred() and install() take them.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(KeyboardInterrupt):
    """The command was stopped by `signum` (SIGINT, SIGTERM or SIGHUP); every `except
    KeyboardInterrupt` of the cleanup paths handles it as it handles Ctrl-C."""

    def __init__(self, signum: int = signal.SIGINT):
        super().__init__(signum)
        self.signum = signum


def signal_of(e: BaseException) -> int:
    """The signal an interrupt stands for: its own, or SIGINT for a plain KeyboardInterrupt."""
    return getattr(e, "signum", signal.SIGINT)


def exit_code(e: BaseException) -> int:
    """The shell's code for a process ended by that signal: 130 (SIGINT), 143 (SIGTERM), 129 (SIGHUP)."""
    return 128 + int(signal_of(e))


@contextlib.contextmanager
def deferred():
    """Run the block with the Python handlers of STOP_SIGNALS held back; if one of those signals
    came meanwhile, its handler runs (and raises, for the default and the CLI's) once the block is
    done. Outside the main thread there is nothing to defer: Python runs signal handlers in the
    main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    # SIG_IGN (a background job), SIG_DFL, or set from C: nothing raises there, nothing to hold back.
    held = {s: h for s in STOP_SIGNALS if callable(h := signal.getsignal(s))}
    if not held:
        yield
        return
    caught: list = []
    for s in held:
        signal.signal(s, lambda signum, frame: caught.append((signum, frame)))
    try:
        yield
    finally:
        for s, h in held.items():
            signal.signal(s, h)
        if caught:
            signum, frame = caught[0]
            held[signum](signum, frame)


class _RepeatGuard:
    """The CLI's handler of STOP_SIGNALS: raise Interrupted, unless the last stop signal was under
    REPEAT_SECONDS ago (the command is cleaning up)."""

    def __init__(self) -> None:
        self.last: float | None = None

    def __call__(self, signum, frame) -> None:
        now = time.monotonic()
        if self.last is not None and now - self.last < REPEAT_SECONDS:
            return
        self.last = now
        raise Interrupted(signum)


def install() -> None:
    """The command's policy (see the module docstring), with a handler of its own (no state
    outlives it). A signal the process was started with ignored (nohup, a background job of a
    shell script) stays ignored."""
    guard = _RepeatGuard()
    for s in STOP_SIGNALS:
        handler = signal.getsignal(s)
        if handler is signal.default_int_handler or handler == signal.SIG_DFL:
            signal.signal(s, guard)


def ignore() -> None:
    """Ignore STOP_SIGNALS from now on, unless something other than Python's or this module's
    handler owns them. SIG_IGN also survives interpreter shutdown, which resets a Python-level
    handler to the default action (killing the process)."""
    for s in STOP_SIGNALS:
        handler = signal.getsignal(s)
        if handler is signal.default_int_handler or isinstance(handler, _RepeatGuard):
            signal.signal(s, signal.SIG_IGN)


def stopped_by(e: BaseException) -> str:
    """How the one line names an interrupt: 'interrupted', or 'interrupted by SIGTERM'."""
    signum = signal_of(e)
    return "interrupted" if signum == signal.SIGINT else f"interrupted by {signal.Signals(signum).name}"


class CrashPoints:
    """Named points of a conversion where a test may stop the process dead, as a power cut or the
    OOM killer would, to prove that what is left can be resumed.

    `hook` is the documented seam: None in the product (a crash point then does nothing); a test
    sets `CRASH_POINTS.hook` to a function of the point's name, in the process that runs the
    conversion (tests/support/crash_cli.py does so for the real CLI). The points:
    `shard-write:FILE` (halfway through writing a shard), `after-job:FILE` (a shard job recorded),
    `mla-manifest`, `index`, `config` and `final-manifest` (before each of those files is written,
    in that order)."""

    hook: Callable[[str], None] | None = None


CRASH_POINTS = CrashPoints()


def crash_point(name: str) -> None:
    if CRASH_POINTS.hook is not None:
        CRASH_POINTS.hook(name)
