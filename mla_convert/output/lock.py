"""One command at a time per output directory: an advisory lock on `OUT/.mla-convert.lock`.

A second conversion into a directory another one is writing (an `--overwrite` deleting its files,
a `--resume` redoing its jobs), or a `verify` reading files still being written, would fail
strangely or pass on half a run. So a conversion holds an exclusive `flock` on the lock file for
its whole run, and a verify one too; the file says who holds it (PID, command, since when), so a
refusal names them. The kernel drops a flock when its holder dies however it dies, so a lock file
left by a killed run is stale exactly when its lock can be taken: it is taken over, and the
notice says whose it was. The holder removes the file when it is done (while still holding the
lock; one who opened it meanwhile finds it no longer at its path and tries again).

Only the holder writes the file. A directory this process cannot write into (a read-only mount,
another user's output) is checked without taking anything: refused if someone holds the lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from mla_convert.constants import LOCK_NAME
from mla_convert.errors import OutputError


@dataclass(frozen=True)
class Holder:
    """Who holds (or last held) the lock, as its file says."""

    pid: int | None
    command: str
    since: str
    host: str

    def describe(self) -> str:
        on = f" on {self.host}" if self.host and self.host != socket.gethostname() else ""
        return f"mla-convert {self.command} (PID {self.pid}{on}, since {self.since})"


def _read_holder(fd: int) -> Holder | None:
    try:
        text = os.pread(fd, 4096, 0).decode(errors="replace")
        doc = json.loads(text) if text.strip() else None
    except (OSError, ValueError):
        return Holder(None, "?", "?", "")
    if not isinstance(doc, dict):
        return None if doc is None else Holder(None, "?", "?", "")
    pid = doc.get("pid")
    return Holder(pid if isinstance(pid, int) else None, str(doc.get("command", "?")), str(doc.get("since", "?")),
                  str(doc.get("host", "")))  # fmt: skip


def _refusal(out_dir: Path, holder: Holder | None) -> OutputError:
    who = holder.describe() if holder else "another mla-convert run"
    return OutputError(f"{out_dir}: in use by {who}; wait for it to finish, or pick another --out")


def _try_lock(fd: int, kind: int) -> bool:
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


class OutLock:
    """The lock of one output directory, held by this process from `acquire` to `release`."""

    def __init__(self, out_dir: Path, command: str):
        self.out_dir, self.command = Path(out_dir), command
        self.path = self.out_dir / LOCK_NAME
        self.fd: int | None = None

    @property
    def held(self) -> bool:
        return self.fd is not None

    def acquire(self) -> str | None:
        """Take the lock (OutputError naming the holder if another process has it). Returns a
        notice when a stale lock, left by a run that is gone, was taken over."""
        if self.held:
            return None
        while self.fd is None:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as e:
                raise OutputError(f"{self.path}: cannot create the lock file ({e.strerror or e})") from e
            if not _try_lock(fd, fcntl.LOCK_EX):
                holder = _read_holder(fd)
                os.close(fd)
                raise _refusal(self.out_dir, holder)
            if not _same_file(fd, self.path):  # its holder removed it as we opened it: try again
                os.close(fd)
                continue
            stale = _read_holder(fd)
            os.ftruncate(fd, 0)
            os.pwrite(fd, self._record(), 0)
            self.fd = fd
        if stale is None:
            return None
        return f"{self.out_dir}: took over the lock of {stale.describe()}, which is no longer running"

    def _record(self) -> bytes:
        since = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime())
        doc = {"pid": os.getpid(), "command": self.command, "since": since, "host": socket.gethostname()}
        return (json.dumps(doc) + "\n").encode()

    def release(self) -> None:
        """Remove the lock file and let the lock go; again is harmless."""
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            if _same_file(self.fd, self.path):
                self.path.unlink()
        os.close(self.fd)
        self.fd = None


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def check_unlocked(out_dir: Path) -> None:
    """Refuse, naming the holder, if a run holds the lock of `out_dir`; takes nothing and writes
    nothing (a dry run, a directory this process cannot write into)."""
    try:
        fd = os.open(Path(out_dir) / LOCK_NAME, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:  # no lock file: nobody runs there
        return
    try:
        if not _try_lock(fd, fcntl.LOCK_SH):
            raise _refusal(Path(out_dir), _read_holder(fd))
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


@contextlib.contextmanager
def locked(out_dir: Path, command: str, notice=None):
    """`out_dir` locked for the block where this process may write there, else only checked
    (check_unlocked). `notice(message)` hears of a stale lock taken over."""
    lock = OutLock(out_dir, command)
    if os.access(out_dir, os.W_OK | os.X_OK):
        took_over = lock.acquire()
        if took_over and notice:
            notice(took_over)
    else:
        check_unlocked(out_dir)
    try:
        yield lock
    finally:
        lock.release()
