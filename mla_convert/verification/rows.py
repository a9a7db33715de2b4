"""verify, tensors by rows: where a tensor's bytes lie (Ref), reading row ranges of it by offset
(RowReader: source tensors, a channel scale stored elsewhere, a kv_b_proj), and the row chunks the
comparisons run in, so their working memory stays small."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mla_convert.io.read_ahead import will_need
from mla_runtime.safetensors_file import DTYPE_SIZES, ShardHeader, pread_exact

if TYPE_CHECKING:
    import torch

CHUNK_ELEMS = 1 << 23  # elements per row chunk in comparisons


class ReadError(Exception):
    """A tensor could not be read: a file that will not open or ends early (the message says which)."""


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


class RowReader:
    """Reads row ranges of tensors by offset (source tensors, partner scales); files stay open."""

    def __init__(self) -> None:
        self.files: dict[str, int] = {}

    def rows(self, ref: Ref, first: int = 0, count: int | None = None) -> torch.Tensor:
        from mla_convert.io.tensors import TORCH_DTYPES

        dtype, size = TORCH_DTYPES[ref.dtype], DTYPE_SIZES[ref.dtype]
        shape = ref.shape or (1,)
        per_row = math.prod(shape[1:]) * size
        count = shape[0] - first if count is None else count
        nbytes = count * per_row
        if ref.path not in self.files:
            try:
                self.files[ref.path] = os.open(ref.path, os.O_RDONLY)
            except OSError as e:
                raise ReadError(f"{ref.path}: cannot open ({e.strerror or e})") from e
        if first == 0 and count < shape[0]:  # the first of several chunks: read ahead the rest
            will_need(self.files[ref.path], ref.offset, shape[0] * per_row)
        buf = bytearray(nbytes)
        try:
            pread_exact(self.files[ref.path], buf, ref.offset + first * per_row)
        except EOFError as e:
            raise ReadError(f"{ref.path}: tensor {ref.name!r}: {e}; the file is truncated") from e
        return decode(buf, dtype, (count, *shape[1:]))

    def close(self) -> None:
        for fd in self.files.values():
            os.close(fd)


def decode(buf: bytearray | memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor whose bytes are `buf` (no copy)."""
    import torch

    if not buf:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype).view(shape)


def row_chunks(n_rows: int, row_elems: int, align: int = 1):
    """(first, end) row ranges of about CHUNK_ELEMS elements, each starting on a multiple of `align`."""
    step = max(align, (CHUNK_ELEMS // max(row_elems, 1)) // align * align)
    for r0 in range(0, n_rows, step):
        yield r0, min(n_rows, r0 + step)
