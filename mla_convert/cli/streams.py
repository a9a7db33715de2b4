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
