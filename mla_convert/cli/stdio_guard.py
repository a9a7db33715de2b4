"""stdout and stderr that a lost reader or a full disk cannot turn into a failed command.

A 40-minute conversion must not end because `| tee log` died, `| head` read its line, or an ssh
session closed under a nohup'd run: a write that fails is not the conversion's failure. So the CLI
writes through `GuardedStream`: the first failed write (EPIPE: the reader went away; EIO: a
terminal that hung up; ENOSPC: `> /dev/full`, a full disk under a redirect) makes that stream
quiet from then on, pointed at /dev/null so that nothing else writing to the descriptor (the
interpreter's last flush, a worker's warning) fails either, and the failure is kept. The command
goes on; its exit code and the manifest tell the truth.

At the end (`outcome`) a stdout that was lost to a reader that went away (`verify | head`) leaves
the command's exit code as it is; one that could not be written otherwise (a full disk) is one
line on stderr and exit code 2, since what the command printed there is lost.

A descriptor that was never there (`2>&-`, `>&-`, `<&-`: some daemons, cron jobs and CI runners
start processes so) is /dev/null from the first line of `main` (`reopen_closed`): the command
runs and ends as with it open, and what it prints is dropped. Before that, the next file the
command opened would get descriptor 1 or 2, and what it printed would land inside that file.
"""

from __future__ import annotations

import errno
import os
import sys

# What a write to a stream whose reader is gone, or whose terminal hung up, fails with.
READER_GONE = (errno.EPIPE, errno.EIO)
EXIT_STDOUT_FAILED = 2


class GuardedStream:
    """A text stream whose first failed write is kept and makes it quiet, instead of raising."""

    def __init__(self, stream, name: str):
        self._stream, self.name = stream, name
        self.failure: OSError | None = None

    def write(self, text: str) -> int:
        if self.failure is None:
            try:
                return self._stream.write(text)
            except OSError as e:
                self._lost(e)
        return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if self.failure is None:
            try:
                self._stream.flush()
            except OSError as e:
                self._lost(e)

    def _lost(self, e: OSError) -> None:
        self.failure = e
        try:  # what is still buffered goes nowhere, and every later write to the descriptor too
            fd = self._stream.fileno()
            null = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(null, fd)
            finally:
                os.close(null)
        except (OSError, ValueError, AttributeError):
            pass

    def __getattr__(self, name):  # encoding, errors, isatty, fileno, buffer...: the stream's own
        return getattr(self._stream, name)


def reopen_closed() -> None:
    """Point stdin, stdout and stderr that are closed at /dev/null, and give Python a stream for each
    (it sets sys.stdout None for a closed fd 1). First thing in `main`: before it no file the command
    opens stays open, so none of its outputs can take descriptor 0, 1 or 2."""
    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        try:
            os.fstat(fd)
        except OSError as e:
            if e.errno != errno.EBADF:
                continue
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
        if getattr(sys, name) is None:  # the process's own stream, for as long as it runs
            setattr(sys, name, open(fd, mode, encoding="utf-8", errors="replace", closefd=False))  # noqa: SIM115


def guard() -> tuple[GuardedStream, GuardedStream]:
    """Put sys.stdout and sys.stderr behind a GuardedStream each (once; again returns the same)."""
    if not isinstance(sys.stdout, GuardedStream):
        sys.stdout = GuardedStream(sys.stdout, "stdout")
    if not isinstance(sys.stderr, GuardedStream):
        sys.stderr = GuardedStream(sys.stderr, "stderr")
    return sys.stdout, sys.stderr


def outcome(code: int) -> int:
    """The command's exit code once its output is flushed: `code`, unless stdout failed for a
    reason other than a reader that went away; then one line on stderr, and EXIT_STDOUT_FAILED."""
    out = sys.stdout
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    failure = getattr(out, "failure", None)
    if failure is None or failure.errno in READER_GONE:
        return code
    after = "the command itself succeeded" if code == 0 else f"the command itself ended with exit code {code}"
    sys.stderr.write(f"error: cannot write to stdout: {failure.strerror or failure}; {after}, but its output is lost\n")
    sys.stderr.flush()
    return EXIT_STDOUT_FAILED
