"""Safetensors with torch: the dtype table, tensors as bytes, and fresh tensors to read into
(headers: io.headers, reads: io.reader).
"""

from __future__ import annotations

import torch

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


def empty_tensor(dtype: str, shape: tuple[int, ...]) -> tuple[torch.Tensor, memoryview]:
    """A fresh tensor of a safetensors dtype and shape (freed with the tensor), and its bytes to
    read into."""
    buf = torch.empty(nbytes_of(dtype, shape), dtype=torch.uint8)
    return buf.view(TORCH_DTYPES[dtype]).reshape(shape), memoryview(buf.numpy()).cast("B")
