"""Sequential file output, either past the page cache (O_DIRECT) or through it.

Copying into the page cache costs CPU time for every byte, while a direct write of the same bytes
costs a small fraction of it: the disk's DMA reads the user buffer. On a host with few cores that
CPU is what the fp8 kernels and sha256 need. Direct writes must be block-aligned in memory, offset
and length, so bytes are staged in a page-aligned buffer and written in whole blocks; the unaligned
tail goes through the page cache at the end. resolve_mode picks the mode once per output directory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import mmap
import os
import queue
import threading
from pathlib import Path

from mla_convert.constants import PROBE_NAME, WRITE_AUTO, WRITE_BUFFERED, WRITE_DIRECT, WRITE_MODES
from mla_convert.io.files import discard

ALIGN = 4096  # a multiple of every logical block size Linux devices use
STAGE_BYTES = 32 * 1024 * 1024  # per staging buffer, one direct write each: small ones are slower
WRITEBACK_STEP = 64 * 1024 * 1024


def _sync_file_range():
    """Linux's sync_file_range(2), or None: starts writeback of a byte range without waiting."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_START_WRITEBACK = _sync_file_range()
SYNC_FILE_RANGE_WRITE = 2


def _write_all(fd: int, data) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _pwrite_all(fd: int, data, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


class BufferedFile:
    """Writes through the page cache, asking the kernel to start writeback every WRITEBACK_STEP
    bytes so the disk works while the caller computes and the final fsync has little left to do."""

    def __init__(self, path: Path):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.size = 0
        self._flushed = 0

    def write(self, data) -> None:
        _write_all(self.fd, data)
        self.size += len(data)
        if _START_WRITEBACK is not None and self.size - self._flushed >= WRITEBACK_STEP:
            _START_WRITEBACK(self.fd, self._flushed, self.size - self._flushed, SYNC_FILE_RANGE_WRITE)
            self._flushed = self.size

    def finish(self) -> None:
        """Everything on disk (fsync), then closed."""
        os.fsync(self.fd)
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)


class DirectFile(BufferedFile):
    """Whole aligned blocks written with O_DIRECT from page-aligned staging buffers: the caller
    fills one while threads write others, so the disk does not wait for the copy. The writes are
    large because small direct writes leave the disk idle between them, and two are in flight at
    once (positional, at their own offsets) because that keeps it busier than one."""

    STAGES = 4
    IO_THREADS = 2

    def __init__(self, path: Path, stage_bytes: int = STAGE_BYTES):
        assert stage_bytes % ALIGN == 0
        self.stage_bytes = stage_bytes
        self._free: queue.Queue = queue.Queue()
        for stage in STAGE_POOL.take(stage_bytes, self.STAGES):
            self._free.put(stage)
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        self.size = 0
        self._offset = 0  # file offset where the current stage goes
        self._full: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._discard = False  # closed before finish: the file is abandoned, queued stages need no write
        self._cur, self._fill = self._free.get(), 0
        self._io = [
            threading.Thread(target=self._io_loop, name=f"direct write {path.name}", daemon=True)
            for _ in range(self.IO_THREADS)
        ]
        for t in self._io:
            t.start()

    def _io_loop(self) -> None:
        while (job := self._full.get()) is not None:
            stage, offset, n = job
            if self._error is None and not self._discard:
                try:
                    with memoryview(stage) as view:
                        self._pwrite(view[:n], offset)
                except BaseException as e:  # raised to the caller at its next write or finish
                    self._error = e
            self._free.put(stage)

    def _pwrite(self, data, offset: int) -> None:
        try:
            _pwrite_all(self.fd, data, offset)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            # A direct write cut short (a file-size limit, a full quota) leaves an unaligned rest
            # that O_DIRECT refuses with EINVAL; through the page cache the rest either goes in or
            # fails with the real reason (EFBIG, ENOSPC).
            self._to_buffered()
            _pwrite_all(self.fd, data, offset)

    def _to_buffered(self) -> None:
        fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def _submit(self, n: int) -> None:
        self._full.put((self._cur, self._offset, n))
        self._offset += n
        self._cur, self._fill = self._free.get(), 0
        self._check()

    def write(self, data) -> None:
        self._check()
        with memoryview(data) as view:
            data = view.cast("B")
            self.size += len(data)
            while data:
                n = min(len(data), self.stage_bytes - self._fill)
                self._cur[self._fill : self._fill + n] = data[:n]
                self._fill += n
                data = data[n:]
                if self._fill == self.stage_bytes:
                    self._submit(self.stage_bytes)
            data.release()

    def _stop_io(self) -> None:
        for _ in self._io:
            self._full.put(None)
        for t in self._io:
            t.join()
        self._io = []

    def finish(self) -> None:
        whole = self._fill - self._fill % ALIGN
        tail = self._cur[whole : self._fill]
        if whole:
            self._submit(whole)
        self._stop_io()
        self._check()
        if tail:  # an unaligned length cannot go direct: the last partial block goes buffered
            self._to_buffered()
            _pwrite_all(self.fd, tail, self._offset)
        super().finish()

    def close(self) -> None:
        self._discard = True  # after finish() nothing is queued; after an error, nothing queued matters
        self._stop_io()
        super().close()
        if self._free is not None:  # every stage is back: none is being written
            stages = [self._cur] + [self._free.get() for _ in range(self._free.qsize())]
            STAGE_POOL.give(self.stage_bytes, stages)
        self._cur = self._free = self._full = None


class StagePool:
    """Staging buffers kept from one direct file to the next: a fresh one costs a page fault per
    4 KB written into it, STAGES x STAGE_BYTES of them per output file (163 shards in R1). Private
    anonymous maps (page-aligned); at most `keep` of each size wait here between files."""

    def __init__(self, keep: int):
        self.keep = keep
        self.created = 0  # maps made so far (tests read it)
        self._lock = threading.Lock()
        self._free: dict[int, list[mmap.mmap]] = {}

    def take(self, nbytes: int, count: int) -> list[mmap.mmap]:
        with self._lock:
            kept = self._free.setdefault(nbytes, [])
            stages = [kept.pop() for _ in range(min(count, len(kept)))]
            self.created += count - len(stages)
        flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
        return stages + [
            mmap.mmap(-1, nbytes, flags=flags) if flags else mmap.mmap(-1, nbytes) for _ in range(count - len(stages))
        ]

    def give(self, nbytes: int, stages: list[mmap.mmap]) -> None:
        with self._lock:
            kept = self._free.setdefault(nbytes, [])
            kept += stages[: max(0, self.keep - len(kept))]  # the rest are unmapped when dropped

    def clear(self) -> None:
        """Let go of every kept buffer (a conversion does at its end: nothing it mapped outlives it).
        Each is unmapped when the last reference goes: closing one that a view still exports (a
        traceback's frame, after an error) would raise."""
        with self._lock:
            self._free = {}


# The process's staging buffers, reused by every direct file; emptied by `clear()` at the end of
# each conversion (conversion.pipeline) and verify never uses them.
STAGE_POOL = StagePool(keep=DirectFile.STAGES)


def open_for_write(path: Path, mode: str) -> BufferedFile:
    """A new file at `path`, written WRITE_DIRECT or WRITE_BUFFERED (resolve_mode decides WRITE_AUTO per directory)."""
    if mode == WRITE_DIRECT:
        return DirectFile(path)
    if mode == WRITE_BUFFERED:
        return BufferedFile(path)
    raise ValueError(f"open_for_write takes {WRITE_DIRECT!r} or {WRITE_BUFFERED!r}, not {mode!r}")


# Where O_DIRECT goes straight to a local block device. Elsewhere (NFS, FUSE, tmpfs, overlay) it
# may be accepted but bypass caching that helps there, so WRITE_AUTO stays buffered.
DIRECT_FILESYSTEM_TYPES = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "bcachefs", "zfs"})
MOUNTS = Path("/proc/self/mounts")


def filesystem_type(path: Path) -> str | None:
    """The type of the filesystem holding `path`, from the mount table; None where there is none."""
    try:
        lines = MOUNTS.read_text().splitlines()
    except OSError:
        return None
    real, best, kind = os.path.realpath(path), -1, None
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        mount = fields[1].replace("\\040", " ")  # the table escapes spaces as octal
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= best:  # the deepest mount; a later one over the same point wins
            best, kind = len(mount), fields[2]
    return kind


def resolve_mode(directory: Path, mode: str = WRITE_AUTO) -> tuple[str, str]:
    """(WRITE_DIRECT or WRITE_BUFFERED, why) for files written into `directory`, tried with a probe file there."""
    if mode not in WRITE_MODES:
        raise ValueError(f"unknown write mode {mode!r}; expected one of {', '.join(WRITE_MODES)}")
    if mode == WRITE_BUFFERED:
        return WRITE_BUFFERED, "requested"
    fs = filesystem_type(directory)
    if mode == WRITE_AUTO and fs is not None and fs not in DIRECT_FILESYSTEM_TYPES:
        return WRITE_BUFFERED, f"{fs} is not a local block filesystem"
    probe = Path(directory) / PROBE_NAME
    f = None
    try:
        if not hasattr(os, "O_DIRECT"):
            raise OSError("this platform has no O_DIRECT")
        f = DirectFile(probe, stage_bytes=ALIGN)
        f.write(bytes(ALIGN))
        f.finish()
    except OSError as e:
        if mode == WRITE_DIRECT:
            raise OSError(f"{directory}: cannot write with O_DIRECT ({e.strerror or e})") from e
        return WRITE_BUFFERED, f"O_DIRECT refused here ({e.strerror or e})"
    finally:
        if f is not None:
            f.close()
        discard(probe)
    return (
        WRITE_DIRECT,
        "requested" if mode == WRITE_DIRECT else f"{fs or 'this filesystem'} takes O_DIRECT: no page-cache copy",
    )
