"""The source's block scales, checked before they are used: NaN or Inf (for E8M0, the NaN code 0xFF)
is refused, naming the file and tensor. A local source's scales are all read before the first
output byte (about 0.02 % of its bytes); a Hub source's as its shards arrive. So are an INT4
source's weight_shape tensors (two numbers each), which must be their packed weight's [N, K].

The checks read the bits, without torch: an F32 or BF16 value is NaN or Inf exactly when its
exponent field is all ones (kernels.bits.any_nonfinite; BF16 is F32's upper half, so it widens by
two zero bytes below); an E8M0 code is NaN exactly when it is 0xFF, and any other code v is
2^(v - 127).
`check_scale` is the same check for a torch tensor (the torch kernels' path).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path

from mla_convert.errors import SourceError
from mla_convert.io.reader import Reader, ReadFailed, Ref
from mla_convert.kernels.bits import any_nonfinite
from mla_convert.source.checkpoint import SourceCheckpoint
from mla_runtime.safetensors_file import TensorInfo

E8M0_NAN = 0xFF
# E8M0 code v -> the float32 2^(v - 127), little-endian (v = 0: the subnormal 2^-127; 0xFF refused)
_E8M0_F32 = [struct.pack("<f", 2.0 ** (v - 127)) for v in range(255)]


def check_scale_values(src: SourceCheckpoint) -> None:
    """Read every block scale of `src` and refuse NaN/Inf (E8M0: the NaN code 0xFF), and every INT4
    weight_shape, which must be its packed weight's [N, K]."""
    by_file: dict[str, list[tuple[TensorInfo, Callable]]] = {}
    for pair in src.block_fp8.values():
        by_file.setdefault(pair.scale_file, []).append((pair.scale, check_scale_bytes))
    for w in src.int4.values():

        def check(data, dtype, path, name, w=w):
            check_int4_shape(int_values(data, dtype), (w.rows, w.cols), path, name, w.packed.name)

        by_file.setdefault(src.weight_map[w.shape.name], []).append((w.shape, check))
    with Reader() as reader:
        for rel, items in sorted(by_file.items()):
            path, start = src.root / rel, src.headers[rel].data_start
            for info, check in sorted(items, key=lambda item: item[0].begin):
                data = bytearray(info.nbytes)
                try:
                    reader.read(Ref(str(path), info.name, start + info.begin, info.dtype, info.shape), memoryview(data))
                except ReadFailed as e:
                    raise SourceError(str(e)) from e
                check(data, info.dtype, path, info.name)


def int_values(data, dtype: str) -> list[int]:
    """The little-endian I32 or I64 values in `data`."""
    size = {"I32": 4, "I64": 8}[dtype]
    return [int.from_bytes(data[i : i + size], "little", signed=True) for i in range(0, len(data), size)]


def check_int4_shape(found: list[int], want: tuple[int, int], path: Path | str, name: str, packed: str) -> None:
    """An INT4 weight's weight_shape holds its packed weight's [N, K]; SourceError otherwise."""
    if list(found) != list(want):
        raise SourceError(
            f"{path}: weight_shape {name!r} is {list(found)}, but its packed weight {packed!r} holds [N, K] = "
            f"{list(want)}"
        )


def check_scale_bytes(data, dtype: str, path: Path | str, name: str) -> bytes:
    """A block scale's bytes (F32, BF16 or F8_E8M0) as float32 bytes, or SourceError if it holds
    NaN/Inf (E8M0: the NaN code 0xFF)."""
    data = bytes(data)
    if dtype == "F8_E8M0":
        if E8M0_NAN in data:
            raise SourceError(f"{path}: scale {name!r} contains the float8_e8m0fnu NaN code 0xFF")
        return b"".join([_E8M0_F32[v] for v in data])
    if any_nonfinite(data, dtype):
        raise SourceError(f"{path}: scale {name!r} contains NaN or Inf")
    if dtype == "BF16":  # widened exactly: two zero bytes below each value
        f32 = bytearray(2 * len(data))
        f32[2::4], f32[3::4] = data[0::2], data[1::2]
        return bytes(f32)
    return data


def check_scale(scale, path: Path | str, name: str):
    """A block scale tensor as float32, or SourceError if it holds NaN/Inf (E8M0: the NaN code 0xFF)."""
    import torch

    from mla_convert.kernels.numerics import block_scale_f32

    if scale.dtype == torch.float8_e8m0fnu:
        if bool((scale.view(torch.uint8) == E8M0_NAN).any()):
            raise SourceError(f"{path}: scale {name!r} contains the float8_e8m0fnu NaN code 0xFF")
    elif not torch.isfinite(scale).all():
        raise SourceError(f"{path}: scale {name!r} contains NaN or Inf")
    return block_scale_f32(scale)
