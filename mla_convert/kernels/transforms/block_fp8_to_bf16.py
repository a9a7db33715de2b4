"""Block FP8 -> bf16: the exact dequant rounded once to nearest-even, as DeepSeek's reference
converter does."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mla_convert.kernels import native
from mla_convert.kernels.native import I64, PTR
from mla_convert.kernels.transforms import block_fp8_dequant
from mla_convert.kernels.transforms.transform import BF16_DTYPE, Params, Transform
from mla_convert.process import threads

if TYPE_CHECKING:
    import torch

OP = "bf16"
# (w, s, k, bn, bk, out, r0, r1, threads): fp8_kernels.c
_C = native.Entry("mla_bf16", [PTR, PTR, I64, I64, I64, PTR, I64, I64, I64])


def eager(p: Params):
    from mla_convert.kernels import numerics

    return lambda w, s: numerics.to_bf16(numerics.dequantize_block_fp8(w, s, p.block))


def rows(p: Params):
    """Rows [r0, r1) of an e4m3fn weight of k columns at `w` (float32 block scales at `s`): 2k
    bytes a row to `out`."""

    def kernel(w: int, s: int, k: int, out: int, _scale: int, r0: int, r1: int) -> None:
        _C(w, s, k, *p.block, out, r0, r1, threads.count())

    return kernel


def to_bf16(weight, scale_inv, block: tuple[int, int]) -> torch.Tensor:
    """The C entry on CPU tensors."""
    import torch

    native.library()
    n, k = native.check_block_fp8(weight, scale_inv, block)
    w, s = weight.contiguous(), scale_inv.contiguous()
    out = torch.empty(n, k, dtype=torch.bfloat16)
    if n and k:
        rows(Params(tuple(block), 0.0, True))(w.data_ptr(), s.data_ptr(), k, out.data_ptr(), 0, 0, n)
    return out


TRANSFORM = Transform(
    op=OP,
    reads=("weight", "block_scale"),
    writes=BF16_DTYPE,
    eager=eager,
    probes=block_fp8_dequant.probes,
    native=lambda p: lambda w, s: to_bf16(w, s, p.block),
    rows=rows,
    native_dtypes=("F8_E4M3",),
    compiles=True,
    split="mla",
    exact_op="dequant",
    verify="bf16",
    bound="bf16",
)
