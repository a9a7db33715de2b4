"""The streaming, hashing, atomic safetensors writer, and commits in the background.

The writer knows every tensor's name, dtype and shape up front (from the plan), writes the header
first and then one tensor at a time, so no shard is ever held in memory. Its bytes go into the
staging buffers of an `io.disk_write.StagedFile`, which hashes them as they arrive and writes them
from there: a kernel writes its output rows straight into the stages (`fill_rows`), a copied
tensor is read from the source file straight into them (`copy_from`), so every output byte is
written to memory once. No torch here: `write` takes a torch tensor, and imports it only then.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
from collections.abc import Callable, Iterable
from pathlib import Path

from mla_convert.constants import WRITE_BUFFERED
from mla_convert.errors import OutputError
from mla_convert.io import disk_write
from mla_convert.io.buffers import address_of
from mla_convert.io.files import WrittenFile, discard, partial_name
from mla_runtime.safetensors_file import encode_header, nbytes_of

RowFill = Callable[[int, int, int], None]  # fill(address, r0, r1): rows [r0, r1) of a tensor, written at address

FILL_STEP = 4 * 1024 * 1024  # output bytes per fill call: small enough to be hashed while in cache


class ShardWriter:
    """Writes one safetensors file tensor by tensor, in the order the header lists them.

    Usage: `with ShardWriter(path, specs) as w: for name in w.order: w.write(name, tensor)`, then
    `w.commit()`. Data goes to a hidden '.NAME.partial' file that is fsynced and renamed on commit
    and removed on any error, so a file under its final name is always complete. Writing, hashing
    and the caller's next tensor overlap (io.disk_write.StagedFile's threads); memory is the file's
    staging buffers, whatever the tensor sizes and however far the disk falls behind.
    """

    def __init__(
        self,
        path: Path,
        specs: dict[str, tuple[str, tuple[int, ...]]],
        metadata: dict | None = None,
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
        self._tmp = partial_name(self.path)
        self._write_mode = write_mode
        self._out: disk_write.StagedFile | None = None

    def __enter__(self) -> ShardWriter:
        try:
            self._out = disk_write.open_for_write(self._tmp, self._write_mode)
            self._out.write(self._prefix)
        except OSError as e:
            self.abort()
            raise OutputError(f"{self.path}: write failed: {e.strerror or e}") from e
        except BaseException:
            self.abort()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()

    def _failed(self, e: OSError) -> OutputError:
        return OutputError(f"{self.path}: write failed: {e.strerror or e}")

    def _expect(self, name: str, dtype: str | None, shape: tuple[int, ...] | None) -> None:
        expected = self.order[self._next] if self._next < len(self.order) else None
        if name != expected:
            raise RuntimeError(f"{self.path}: wrote {name!r} out of order (expected {expected!r})")
        planned = self._specs[name]
        if dtype is not None and (dtype != planned[0] or tuple(shape) != tuple(planned[1])):
            raise RuntimeError(
                f"{self.path}: tensor {name!r} is {dtype}{tuple(shape)}, planned {planned[0]}{tuple(planned[1])}"
            )

    def write(self, name: str, tensor) -> None:
        """A torch tensor, copied into the stages."""
        from mla_convert.io.tensors import TORCH_TO_ST, tensor_bytes

        self._expect(name, TORCH_TO_ST.get(tensor.dtype, str(tensor.dtype)), tuple(tensor.shape))
        self._put(tensor_bytes(tensor))
        self._next += 1

    def write_bytes(self, name: str, data, dtype: str, shape: tuple[int, ...]) -> None:
        """A tensor's bytes (any buffer), copied into the stages."""
        self._expect(name, dtype, shape)
        if len(memoryview(data).cast("B")) != nbytes_of(dtype, shape):
            raise RuntimeError(f"{self.path}: tensor {name!r} got {len(data)} bytes for {dtype}{tuple(shape)}")
        self._put(data)
        self._next += 1

    def write_raw(self, name: str, chunks: Iterable[bytes | memoryview]) -> None:
        """Write a tensor's bytes as they come (a bit-exact copy needs no decoding)."""
        self._expect(name, None, None)
        expected = nbytes_of(*self._specs[name])
        n = 0
        for chunk in chunks:
            n += len(chunk)
            self._put(chunk)
        if n != expected:
            raise RuntimeError(f"{self.path}: tensor {name!r} got {n} bytes, planned {expected}")
        self._next += 1

    def copy_from(self, name: str, read: Callable[[memoryview, int], None]) -> None:
        """A tensor copied bit for bit, read straight into the stages: `read(view, start)` fills view
        with its bytes from byte `start` (io.reader.Reader.read; its ReadFailed goes to the caller)."""
        self._expect(name, None, None)
        try:
            self._out.fill_from(read, nbytes_of(*self._specs[name]))
        except OSError as e:  # a write of the stages (the reads' errors are ReadFailed)
            raise self._failed(e) from e
        self._next += 1

    def fill_rows(self, name: str, dtype: str, shape: tuple[int, ...], fill: RowFill) -> None:
        """A 2-D tensor computed in place: `fill(address, r0, r1)` writes rows [r0, r1) there, in
        pieces of about FILL_STEP bytes straight into the stages (a row that straddles two stages
        goes through a row buffer)."""
        self._expect(name, dtype, shape)
        rows, row_bytes = shape[0], nbytes_of(dtype, shape[1:])
        out, r = self._out, 0
        step = max(1, FILL_STEP // max(1, row_bytes))
        try:
            while r < rows:
                space, address = out.reserve()
                n = min(rows - r, step, len(space) // row_bytes) if row_bytes else rows - r
                if n:
                    fill(address, r, r + n)
                    out.commit(n * row_bytes)
                else:  # the next row does not fit in this stage: it goes through a buffer of its own
                    row = bytearray(row_bytes)
                    fill(address_of(row), r, r + 1)
                    out.write(row)
                    n = 1
                r += n
        except OSError as e:
            raise self._failed(e) from e
        self._next += 1

    def _put(self, data) -> None:
        try:
            self._out.write(data)
        except OSError as e:
            raise self._failed(e) from e

    def commit(self) -> WrittenFile:
        if self._next != len(self.order):
            self.abort()
            raise RuntimeError(f"{self.path}: {len(self.order) - self._next} planned tensors were not written")
        try:
            sha256 = self._out.finish()  # the last bytes go to disk here
        except OSError as e:
            self.abort()
            raise self._failed(e) from e
        except BaseException:
            self.abort()
            raise
        try:
            os.replace(self._tmp, self.path)
        except OSError as e:
            self.abort()
            raise OutputError(f"{self.path}: cannot finish writing: {e.strerror or e}") from e
        return WrittenFile(self.path, self.total_size, sha256)

    def abort(self) -> None:
        if self._out is not None:
            self._out.close()  # an interrupted run stops within one stage
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
