"""The streaming, hashing, atomic safetensors writer, and commits in the background.

The writer knows every tensor's name, dtype and shape up front (from the plan), writes the header
first and then one tensor at a time, so no shard is ever held in memory, and hashes the bytes as
they go to disk.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import os
import queue
import threading
from collections.abc import Iterable
from pathlib import Path

import torch

from mla_convert.constants import WRITE_BUFFERED
from mla_convert.errors import OutputError
from mla_convert.io import disk_write
from mla_convert.io.files import WrittenFile, discard, partial_name
from mla_convert.io.tensors import TORCH_TO_ST, tensor_bytes
from mla_runtime.safetensors_file import encode_header, nbytes_of


class ShardWriter:
    """Writes one safetensors file tensor by tensor, in the order the header lists them.

    Usage: `with ShardWriter(path, specs) as w: for name in w.order: w.write(name, tensor)`, then
    `w.commit()`. Data goes to a hidden '.NAME.partial' file that is fsynced and renamed on commit
    and removed on any error, so a file under its final name is always complete. With
    `background=True` one thread writes and another hashes while the caller computes the next
    tensor; at most `INFLIGHT_BYTES` of tensors wait for them (or one tensor, if it is larger), so
    memory stays bounded whatever the tensor sizes.
    """

    INFLIGHT_BYTES = 64 * 1024 * 1024

    def __init__(
        self,
        path: Path,
        specs: dict[str, tuple[str, tuple[int, ...]]],
        metadata: dict | None = None,
        background: bool = False,
        write_mode: str = WRITE_BUFFERED,
    ):
        self.path = Path(path)
        # The plan's order: a weight's channel scale follows the weight, so only that small scale
        # is held between two writes (safetensors readers do not need aligned offsets).
        self.order = list(specs)
        self._specs = specs
        self._prefix = encode_header(specs, metadata or {"format": "pt"})
        self.total_size = len(self._prefix) + sum(nbytes_of(*specs[name]) for name in self.order)
        self._next = 0
        self._hash = hashlib.sha256()
        self._tmp = partial_name(self.path)
        self._write_mode = write_mode
        self._out: disk_write.BufferedFile | None = None
        # Background: one thread writes, another hashes, each from its own queue of the same
        # buffers (sha256 and the write each cost about as much CPU, so they overlap).
        self._queues: list[queue.Queue] = [queue.Queue() for _ in range(2)] if background else []
        self._threads: list[threading.Thread] = []
        self._error: BaseException | None = None
        self._aborted = False  # set by abort: the file is discarded, nothing queued needs writing
        self._room = threading.Condition()  # guards the in-flight byte count
        self._inflight = 0
        self.peak_inflight = 0  # the most bytes that waited at once (tests read it)

    def __enter__(self) -> ShardWriter:
        try:
            self._out = disk_write.open_for_write(self._tmp, self._write_mode)
            self._put(self._prefix)
        except BaseException:
            self.abort()
            raise
        for q, fn, what in zip(
            self._queues, (self._write, self._hash.update), ("write", "sha256"), strict=False
        ):  # no queues: no threads
            t = threading.Thread(target=self._drain, args=(q, fn), name=f"{what} {self.path.name}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()

    def _put(self, data) -> None:
        self._write(data)
        self._hash.update(data)

    def _write(self, data) -> None:
        try:
            self._out.write(data)
        except OSError as e:
            raise OutputError(f"{self.path}: write failed: {e.strerror or e}") from e

    def _drain(self, q: queue.Queue, fn) -> None:
        while (item := q.get()) is not None:
            if self._error is None and not self._aborted:
                try:
                    fn(item[0])
                except BaseException as e:  # handed to the caller at its next write or commit
                    self._error = e
            with self._room:
                item[1] -= 1
                if not item[1]:  # both threads are done with it: its memory can go
                    self._inflight -= len(item[0])
                    item[0] = None
                    self._room.notify()

    def _join_threads(self) -> None:
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            t.join()
        self._queues, self._threads = [], []

    def _stop_thread(self) -> None:
        self._join_threads()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _emit(self, data) -> None:
        if not self._threads:
            self._put(data)
        else:
            if self._error is not None:
                self._stop_thread()
            with self._room:
                while self._inflight and self._inflight + len(data) > self.INFLIGHT_BYTES:
                    self._room.wait()
                self._inflight += len(data)
                self.peak_inflight = max(self.peak_inflight, self._inflight)
            item = [data, len(self._queues)]  # the buffer, and how many threads still need it
            for q in self._queues:
                q.put(item)

    def _expect(self, name: str, dtype: str | None, shape: tuple[int, ...] | None) -> None:
        expected = self.order[self._next] if self._next < len(self.order) else None
        if name != expected:
            raise RuntimeError(f"{self.path}: wrote {name!r} out of order (expected {expected!r})")
        planned = self._specs[name]
        if dtype is not None and (dtype != planned[0] or tuple(shape) != tuple(planned[1])):
            raise RuntimeError(
                f"{self.path}: tensor {name!r} is {dtype}{tuple(shape)}, planned {planned[0]}{tuple(planned[1])}"
            )

    def write(self, name: str, tensor: torch.Tensor) -> None:
        self._expect(name, TORCH_TO_ST.get(tensor.dtype, str(tensor.dtype)), tuple(tensor.shape))
        self._emit(tensor_bytes(tensor))
        self._next += 1

    def write_raw(self, name: str, chunks: Iterable[bytes | memoryview]) -> None:
        """Write a tensor's bytes as they come (a bit-exact copy needs no decoding)."""
        self._expect(name, None, None)
        expected = nbytes_of(*self._specs[name])
        n = 0
        for chunk in chunks:
            n += len(chunk)
            self._emit(chunk)
        if n != expected:
            raise RuntimeError(f"{self.path}: tensor {name!r} got {n} bytes, planned {expected}")
        self._next += 1

    def commit(self) -> WrittenFile:
        try:
            self._stop_thread()
        except BaseException:
            self.abort()
            raise
        if self._next != len(self.order):
            self.abort()
            raise RuntimeError(f"{self.path}: {len(self.order) - self._next} planned tensors were not written")
        try:
            self._out.finish()  # the last buffered bytes go to disk here
        except OSError as e:
            self.abort()
            raise OutputError(f"{self.path}: write failed: {e.strerror or e}") from e
        try:
            os.replace(self._tmp, self.path)
        except OSError as e:
            self.abort()
            raise OutputError(f"{self.path}: cannot finish writing: {e.strerror or e}") from e
        return WrittenFile(self.path, self.total_size, self._hash.hexdigest())

    def abort(self) -> None:
        self._aborted = True  # an interrupted run stops within one buffer, not INFLIGHT_BYTES later
        self._join_threads()
        if self._out is not None:
            self._out.close()
        discard(self._tmp)


class BackgroundCommits:
    """Commits finished ShardWriters (drain, fsync, rename) on one thread, in the order given.

    fsync waits for the disk to flush the whole file, a large share of a conversion's time when done
    inline; here it overlaps the next tensors' work.
    Leaving the `with` block waits for every commit, so no file is still being written after it.
    Left by an exception (Ctrl-C, an error), the commits not yet started are dropped instead, their
    files discarded: the run is over, and a resume redoes those jobs anyway.
    """

    def __init__(self) -> None:
        self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="commit")
        self._queued: list[tuple[cf.Future, ShardWriter]] = []

    def submit(self, writer: ShardWriter) -> cf.Future:
        """A future of writer.commit()'s WrittenFile (or its exception)."""
        future = self._pool.submit(writer.commit)
        self._queued = [(f, w) for f, w in self._queued if not f.done()] + [(future, writer)]
        return future

    def __enter__(self) -> BackgroundCommits:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            for future, writer in self._queued:
                if future.cancel():
                    writer.abort()
        self._queued = []
        self._pool.shutdown(wait=True)
