"""Tensors read by offset, for the conversion and verify alike (no torch).

`Reader` opens each file once and keeps it open until `close()`. `read(ref, view, start)` fills
memory the caller owns with a tensor's bytes from `start` (positioned reads, no seek, no copy on the
way, continued through short reads: mla_runtime's `pread_exact`); read in several pieces, the first
piece asks the kernel to read the rest of the tensor ahead (posix_fadvise WILLNEED) while it is
worked on. A file that will not open, ends before the bytes asked for, or fails to read is one
error, `ReadFailed`, one line naming the file and the tensor; each side turns it into its own: the
conversion a SourceError, verify a failed check it records.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from mla_convert.io.read_ahead import will_need
from mla_runtime.safetensors_file import DTYPE_SIZES, ShardHeader, TruncatedRead, pread_exact


class ReadFailed(Exception):
    """A tensor's bytes could not be read: its file will not open, ends early, or fails to read."""


@dataclass(frozen=True)
class Ref:
    """Where a tensor's bytes lie: a file, the tensor's name, the absolute offset of its data, dtype
    and shape."""

    path: str
    name: str
    offset: int
    dtype: str
    shape: tuple[int, ...]

    @classmethod
    def of(cls, path: Path, header: ShardHeader, name: str) -> Ref | None:
        t = header.tensors.get(name)
        return None if t is None else cls(str(path), name, header.data_start + t.begin, t.dtype, t.shape)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]

    @property
    def row_bytes(self) -> int:
        """Bytes per row (along the first dimension; a 0-d tensor is one row)."""
        return math.prod(self.shape[1:]) * DTYPE_SIZES[self.dtype]


def read_exact(fd: int, offset: int, view: memoryview, path: Path | str, name: str) -> None:
    """Fill `view` with the file's bytes from `offset`; ReadFailed naming the tensor if the file ends
    first or the read fails."""
    try:
        pread_exact(fd, view, offset)
    except TruncatedRead as e:
        raise ReadFailed(f"{path}: tensor {name!r}: file ended after {e.done} of {e.want} bytes (truncated?)") from e
    except OSError as e:
        raise ReadFailed(f"{path}: tensor {name!r}: read failed ({e.strerror or e})") from e


class Reader:
    """Files opened on first use and kept open until `close()`, their tensors read by offset."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}

    def fd(self, path: Path | str) -> int:
        """The open descriptor of `path`."""
        key = str(path)
        if key not in self._fds:
            try:
                self._fds[key] = os.open(key, os.O_RDONLY)
            except OSError as e:
                raise ReadFailed(f"{key}: cannot open ({e.strerror or e})") from e
        return self._fds[key]

    def read(self, ref: Ref, view: memoryview, start: int = 0) -> memoryview:
        """`view` filled with the tensor's bytes from byte `start` of it; the first of several pieces
        asks for the rest of the tensor ahead."""
        fd = self.fd(ref.path)
        if start == 0 and len(view) < ref.nbytes:
            will_need(fd, ref.offset, ref.nbytes)
        read_exact(fd, ref.offset + start, view, ref.path, ref.name)
        return view

    def read_ahead(self, ref: Ref, extra: int = 0) -> None:
        """Ask the kernel to read the tensor (and `extra` bytes after it) into the page cache, without waiting."""
        will_need(self.fd(ref.path), ref.offset, ref.nbytes + extra)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
