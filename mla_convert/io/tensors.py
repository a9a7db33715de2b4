"""Safetensors with torch: the dtype table, tensors as bytes, and tensor reads by offset into fresh
memory (headers: io.headers).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

import torch

from mla_convert.errors import SourceError
from mla_runtime.safetensors_file import DTYPE_SIZES, nbytes_of

# safetensors dtype string -> torch dtype (sizes: mla_runtime.safetensors_file.DTYPE_SIZES)
TORCH_DTYPES: dict[str, torch.dtype] = {
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I8": torch.int8,
    "U8": torch.uint8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "BOOL": torch.bool,
}
assert TORCH_DTYPES.keys() == DTYPE_SIZES.keys()
TORCH_TO_ST = {v: k for k, v in TORCH_DTYPES.items()}


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a tensor (zero-copy for contiguous CPU tensors)."""
    t = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


RAW_CHUNK = 16 * 1024 * 1024


def read_tensor(f: BinaryIO, offset: int, dtype: str, shape: tuple[int, ...], path: Path, name: str) -> torch.Tensor:
    """Read one tensor at an absolute file offset into fresh memory (freed with the tensor).

    Unlike an mmap-backed tensor, nothing of the file stays resident after the tensor is released.
    """
    nbytes = nbytes_of(dtype, shape)
    buf = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes:
        f.seek(offset)
        got = f.readinto(memoryview(buf.numpy()))
        if got != nbytes:
            raise SourceError(f"{path}: tensor {name!r}: file ended after {got} of {nbytes} bytes (truncated?)")
    return buf.view(TORCH_DTYPES[dtype]).reshape(shape)


def read_chunks(f: BinaryIO, offset: int, nbytes: int, path: Path, name: str) -> Iterable[bytes]:
    f.seek(offset)
    left = nbytes
    while left:
        chunk = f.read(min(RAW_CHUNK, left))
        if not chunk:
            raise SourceError(f"{path}: tensor {name!r}: file ended {left} bytes early (truncated?)")
        left -= len(chunk)
        yield chunk
