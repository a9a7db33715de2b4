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
import hashlib
import mmap
import os
import queue
import threading
from collections.abc import Callable
from pathlib import Path

from mla_convert.constants import PROBE_NAME, WRITE_AUTO, WRITE_BUFFERED, WRITE_DIRECT, WRITE_MODES
from mla_convert.io.buffers import address_of, new_map
from mla_convert.io.files import discard
from mla_convert.process import resources

ALIGN = 4096  # a multiple of every logical block size Linux devices use
STAGE_BYTES = 16 * 1024 * 1024  # per staging buffer, one direct write each: 8 MB ones were slower


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


def _pwrite_all(fd: int, data, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


class _Stage:
    """One staging buffer of a file: where it goes in the file, how much of it is filled, and how
    many of the hash and I/O threads still need it."""

    __slots__ = ("address", "fill", "map", "offset", "sealed", "users", "view")

    def __init__(self, buffer: mmap.mmap):
        self.map, self.view, self.address = buffer, memoryview(buffer), address_of(buffer)
        self.offset = self.fill = self.users = 0
        self.sealed = False  # filled: once no thread needs it, it is free again


class StagedFile:
    """A new file written from page-aligned staging buffers that the caller fills in place
    (`reserve`, then `commit`) or copies into (`write`, `fill_from`). A full stage is written by
    one of two I/O threads at its own offset, with O_DIRECT (`direct`) or through the page cache
    (starting writeback of each stage, so the final fsync has little left to do); the bytes are
    hashed in file order on a third thread as they are committed, while they are still in cache.

    Memory: at most STAGES stages per file, taken from the run's `stage_pool()` and given back to it on close; the
    caller waits for a free one when the disk or the hash falls behind. Direct writes must be
    block-aligned in memory, offset and length: stages are page-aligned and written whole, and the
    unaligned tail goes through the page cache at the end."""

    STAGES = 4
    IO_THREADS = 2
    HASH_STEP = 4 * 1024 * 1024  # bytes handed to the hash thread at a time

    def __init__(
        self,
        path: Path,
        direct: bool,
        stage_bytes: int | None = None,
        hashed: bool = True,
        *,
        append_at: int = 0,
        sha256=None,
        in_order: bool = False,
    ):
        """`append_at` (a multiple of ALIGN): keep the file's first bytes, up to there, and write
        after them; `sha256`: their hash, continued. `in_order`: one I/O thread, so that what is on
        disk after a failure (or a kill) is always a prefix of the bytes committed."""
        stage_bytes = stage_bytes or STAGE_BYTES
        assert stage_bytes % ALIGN == 0 and append_at % ALIGN == 0
        self.stage_bytes, self.direct = stage_bytes, direct
        if in_order:
            self.IO_THREADS = 1
        flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if not append_at else 0) | (os.O_DIRECT if direct else 0)
        self.fd = os.open(path, flags, 0o644)
        if append_at:
            os.ftruncate(self.fd, append_at)
        self.size = append_at
        self._hash = (sha256 or hashlib.sha256()) if hashed else None
        self._lock = threading.Lock()
        self._free: queue.Queue[_Stage] = queue.Queue()
        self._pool = stage_pool()  # the run's: the stages go back to the pool they came from
        self._stages: list[_Stage] = []  # every stage taken from the pool, given back on close
        self._full: queue.Queue = queue.Queue()  # stages to write; None stops an I/O thread
        self._to_hash: queue.Queue = queue.Queue()  # (stage, start, end); None stops the hash thread
        self._error: BaseException | None = None
        self._discard = False  # closed before finish: the file is abandoned, queued work is skipped
        self._cur: _Stage | None = None
        self._hashed = 0  # how much of the current stage went to the hash thread
        self._threads = [
            threading.Thread(target=self._io_loop, name=f"{'direct' if direct else 'buffered'} write {path.name}",
                             daemon=True)
            for _ in range(self.IO_THREADS)
        ]  # fmt: skip
        if self._hash is not None:
            self._threads.append(threading.Thread(target=self._hash_loop, name=f"sha256 {path.name}", daemon=True))
        for t in self._threads:
            t.start()

    # -- the threads ---------------------------------------------------------------------------------

    def _done_with(self, stage: _Stage) -> None:
        with self._lock:
            stage.users -= 1
            if stage.users or not stage.sealed:
                return
        self._free.put(stage)

    def _io_loop(self) -> None:
        while (stage := self._full.get()) is not None:
            if self._error is None and not self._discard:
                try:
                    self._pwrite(stage.view[: stage.fill], stage.offset)
                    if not self.direct and _START_WRITEBACK is not None:
                        _START_WRITEBACK(self.fd, stage.offset, stage.fill, SYNC_FILE_RANGE_WRITE)
                except BaseException as e:  # raised to the caller at its next call or at finish
                    self._error = e
            self._done_with(stage)

    def _hash_loop(self) -> None:
        while (item := self._to_hash.get()) is not None:
            stage, start, end = item
            if self._error is None and not self._discard:
                try:
                    self._hash.update(stage.view[start:end])
                except BaseException as e:
                    self._error = e
            self._done_with(stage)

    def _pwrite(self, data, offset: int) -> None:
        try:
            _pwrite_all(self.fd, data, offset)
        except OSError as e:
            if e.errno != errno.EINVAL or not self.direct:
                raise
            # A direct write cut short (a file-size limit, a full quota) leaves an unaligned rest
            # that O_DIRECT refuses with EINVAL; through the page cache the rest either goes in or
            # fails with the real reason (EFBIG, ENOSPC).
            self._to_buffered()
            _pwrite_all(self.fd, data, offset)

    def _to_buffered(self) -> None:
        fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)

    # -- filling -------------------------------------------------------------------------------------

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def _send_hash(self) -> None:
        stage = self._cur
        if self._hash is not None and stage.fill > self._hashed:
            with self._lock:
                stage.users += 1
            self._to_hash.put((stage, self._hashed, stage.fill))
            self._hashed = stage.fill

    def _seal(self) -> None:
        """The current stage is done: its last bytes to the hash thread, itself to an I/O thread."""
        self._send_hash()
        stage, self._cur = self._cur, None
        with self._lock:
            stage.users += 1
            stage.sealed = True
        self._full.put(stage)

    def _next_stage(self) -> _Stage:
        if len(self._stages) < self.STAGES:
            stage = _Stage(self._pool.take(self.stage_bytes, 1)[0])
            self._stages.append(stage)
        else:
            stage = self._free.get()
            self._check()
        stage.offset, stage.fill, stage.sealed, self._hashed = self.size, 0, False, 0
        self._cur = stage
        return stage

    @property
    def stages(self) -> int:
        """How many staging buffers this file has taken (at most STAGES)."""
        return len(self._stages)

    def reserve(self) -> tuple[memoryview, int]:
        """The free rest of the current stage (never empty), and its address: fill a prefix, then
        `commit` its length before the next call."""
        self._check()
        stage = self._cur or self._next_stage()
        return stage.view[stage.fill :], stage.address + stage.fill

    def commit(self, n: int) -> None:
        stage = self._cur
        assert stage is not None and 0 <= n <= self.stage_bytes - stage.fill
        stage.fill += n
        self.size += n
        if stage.fill == self.stage_bytes:
            self._seal()
        elif stage.fill - self._hashed >= self.HASH_STEP:
            self._send_hash()

    def write(self, data) -> None:
        """Copy `data` into the stages."""
        with memoryview(data) as view:
            view = view.cast("B")
            while view:
                space, _ = self.reserve()
                n = min(len(space), len(view))
                space[:n] = view[:n]
                self.commit(n)
                view = view[n:]

    def fill_from(self, read: Callable[[memoryview, int], None], nbytes: int) -> None:
        """`nbytes` read straight into the stages: `read(view, start)` fills view with the bytes from
        byte `start` of what is read."""
        done = 0
        while done < nbytes:
            space, _ = self.reserve()
            n = min(len(space), nbytes - done)
            read(space[:n], done)
            self.commit(n)
            done += n

    # -- the end -------------------------------------------------------------------------------------

    def _stop_threads(self) -> None:
        for _ in range(self.IO_THREADS):
            self._full.put(None)
        self._to_hash.put(None)
        for t in self._threads:
            t.join()
        self._threads = []

    def finish(self) -> str:
        """Everything written, on disk (fsync) and closed; returns the sha256 of the bytes (hex;
        '' when not hashed)."""
        self._check()
        tail = b""
        if self._cur is not None:
            stage = self._cur
            whole = stage.fill - stage.fill % ALIGN if self.direct else stage.fill
            tail = bytes(stage.view[whole : stage.fill])  # an unaligned length cannot go direct
            self._send_hash()
            stage.fill = whole
            if whole:
                self._seal()
            self._cur = None
        self._stop_threads()
        self._check()
        if tail:
            self._to_buffered()
            _pwrite_all(self.fd, tail, self.size - len(tail))
        os.fsync(self.fd)
        self.close()
        return self._hash.hexdigest() if self._hash is not None else ""

    def close(self) -> None:
        self._discard = True  # after finish() nothing is queued; after an error, nothing queued matters
        if self._threads:
            self._stop_threads()
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)
        # the threads are stopped: no stage is being written or hashed
        self._pool.give(self.stage_bytes, [stage.map for stage in self._stages])
        self._stages, self._cur = [], None


class DirectFile(StagedFile):
    """A StagedFile written with O_DIRECT: the disk's DMA reads the stages, no page-cache copy."""

    def __init__(self, path: Path, stage_bytes: int | None = None, hashed: bool = True):
        super().__init__(path, True, stage_bytes, hashed)


class BufferedFile(StagedFile):
    """A StagedFile written through the page cache."""

    def __init__(self, path: Path, stage_bytes: int | None = None, hashed: bool = True):
        super().__init__(path, False, stage_bytes, hashed)


class StagePool:
    """Staging buffers kept from one file to the next: a fresh one costs a page fault per page
    written into it, STAGES x STAGE_BYTES of them per output file (163 shards in R1). Private
    anonymous maps (page-aligned, huge pages asked for); at most `keep` of each size wait here
    between files."""

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
        return stages + [new_map(nbytes) for _ in range(count - len(stages))]

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


def stage_pool() -> StagePool:
    """The run's staging buffers (process.resources), reused by every file it writes: enough for a
    shard's file, the one before it (still being committed) and a layer's MLA file; let go when the
    run's scope closes (a worker process keeps its own from job to job)."""
    return resources.current().slot("io.disk_write.stages", _new_stage_pool, StagePool.clear)


def _new_stage_pool() -> StagePool:
    return StagePool(keep=2 * StagedFile.STAGES + 2)


def open_for_write(path: Path, mode: str, **options) -> StagedFile:
    """A new file at `path`, written WRITE_DIRECT or WRITE_BUFFERED (resolve_mode decides WRITE_AUTO
    per directory); `options`: StagedFile's append_at, sha256, in_order."""
    if mode not in (WRITE_DIRECT, WRITE_BUFFERED):
        raise ValueError(f"open_for_write takes {WRITE_DIRECT!r} or {WRITE_BUFFERED!r}, not {mode!r}")
    return StagedFile(path, mode == WRITE_DIRECT, **options)


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
        f = DirectFile(probe, stage_bytes=ALIGN, hashed=False)
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
