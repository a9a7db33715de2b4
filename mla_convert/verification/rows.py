"""verify, tensors by rows for the torch path: row ranges of tensors read by offset (RowReader:
source tensors, a channel scale stored elsewhere, a kv_b_proj) through the file's io.reader.Reader,
and the row chunks the comparisons run in, so their working memory stays small."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mla_convert.io.reader import Reader, Ref

if TYPE_CHECKING:
    import torch

CHUNK_ELEMS = 1 << 23  # elements per row chunk in comparisons


class RowReader:
    """Row ranges of tensors as torch tensors, each read into memory of its own (the torch path)."""

    def __init__(self, reader: Reader) -> None:
        self.reader = reader

    def rows(self, ref: Ref, first: int = 0, count: int | None = None) -> torch.Tensor:
        from mla_convert.io.tensors import TORCH_DTYPES

        shape = ref.shape or (1,)
        count = shape[0] - first if count is None else count
        buf = bytearray(count * ref.row_bytes)
        self.reader.read(ref, memoryview(buf), first * ref.row_bytes)
        return decode(buf, TORCH_DTYPES[ref.dtype], (count, *shape[1:]))


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
