"""The source's block scales, checked before they are used: NaN or Inf (for E8M0, the NaN code 0xFF)
is refused, naming the file and tensor. A local source's scales are all read before the first
output byte (about 0.02 % of its bytes); a Hub source's as its shards arrive. So are an INT4
source's weight_shape tensors (two numbers each), which must be their packed weight's [N, K]."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from mla_convert.errors import SourceError
from mla_convert.io.tensors import read_tensor
from mla_convert.kernels.numerics import E8M0_NAN, block_scale_f32
from mla_convert.source.checkpoint import SourceCheckpoint
from mla_runtime.safetensors_file import TensorInfo


def check_scale_values(src: SourceCheckpoint) -> None:
    """Read every block scale of `src` and refuse NaN/Inf (E8M0: the NaN code 0xFF), and every INT4
    weight_shape, which must be its packed weight's [N, K]."""
    by_file: dict[str, list[tuple[TensorInfo, Callable]]] = {}
    for pair in src.fp8.values():
        by_file.setdefault(pair.scale_file, []).append((pair.scale, check_scale))
    for w in src.int4.values():

        def check(values, path, name, w=w):
            check_int4_shape(values, (w.rows, w.cols), path, name, w.packed.name)

        by_file.setdefault(src.weight_map[w.shape.name], []).append((w.shape, check))
    for rel, items in sorted(by_file.items()):
        path = src.root / rel
        start = src.headers[rel].data_start
        with open(path, "rb") as f:
            for info, check in sorted(items, key=lambda item: item[0].begin):
                values = read_tensor(f, start + info.begin, info.dtype, info.shape, path, info.name)
                check(values, path, info.name)


def check_int4_shape(values: torch.Tensor, want: tuple[int, int], path: Path | str, name: str, packed: str) -> None:
    """An INT4 weight's weight_shape holds its packed weight's [N, K]; SourceError otherwise."""
    found = [int(v) for v in values.flatten().tolist()]
    if found != list(want):
        raise SourceError(
            f"{path}: weight_shape {name!r} is {found}, but its packed weight {packed!r} holds [N, K] = {list(want)}"
        )


def check_scale(scale: torch.Tensor, path: Path | str, name: str) -> torch.Tensor:
    """A block scale as float32, or SourceError if it holds NaN/Inf (E8M0: the NaN code 0xFF)."""
    if scale.dtype == torch.float8_e8m0fnu:
        if bool((scale.view(torch.uint8) == E8M0_NAN).any()):
            raise SourceError(f"{path}: scale {name!r} contains the float8_e8m0fnu NaN code 0xFF")
    elif not torch.isfinite(scale).all():
        raise SourceError(f"{path}: scale {name!r} contains NaN or Inf")
    return block_scale_f32(scale)
