"""Block FP8 -> channel FP8: the exact dequant, quantized per output row (numerics.block_to_channel_fp8);
its channel scale is written right after the weight. DeepSeek's float32 or E8M0 block scales, and
compressed-tensors FP8_BLOCK's bfloat16 ones, are widened to float32 exactly first."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mla_convert.kernels import native
from mla_convert.kernels.native import F32, I64, PTR, U32
from mla_convert.kernels.transforms import block_fp8_dequant
from mla_convert.kernels.transforms.transform import FP8_DTYPE, Params, Transform
from mla_convert.process import threads

if TYPE_CHECKING:
    import torch

OP = "fp8"
# (w, s, k, bn, bk, fp8_max, zero_sign, q, scale, r0, r1, threads): fp8_kernels.c
_C = native.Entry("mla_channel_fp8", [PTR, PTR, I64, I64, I64, F32, U32, PTR, PTR, I64, I64, I64])


def eager(p: Params):
    from mla_convert.kernels import numerics

    return lambda w, s: numerics.block_to_channel_fp8(w, s, p.block, p.fp8_max, p.signed_zero)


def rows(p: Params):
    """Rows [r0, r1) of an e4m3fn weight of k columns at `w` (float32 block scales at `s`): codes
    to `q` (k bytes a row), float32 channel scales to `scale`."""
    zero_sign = native.zero_sign(p.signed_zero)

    def kernel(w: int, s: int, k: int, q: int, scale: int, r0: int, r1: int) -> None:
        _C(w, s, k, *p.block, p.fp8_max, zero_sign, q, scale, r0, r1, threads.count())

    return kernel


def to_channel_fp8(
    weight, scale_inv, block: tuple[int, int], fp8_max: float, signed_zero: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """The C entry on CPU tensors: (e4m3fn [N, K], fp32 scale [N, 1])."""
    import torch

    native.library()
    n, k = native.check_block_fp8(weight, scale_inv, block)
    w, s = weight.contiguous(), scale_inv.contiguous()
    scale = torch.empty(n, 1, dtype=torch.float32)
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    if n and k:
        rows(Params(tuple(block), fp8_max, signed_zero))(w.data_ptr(), s.data_ptr(), k, q.data_ptr(),
                                                          scale.data_ptr(), 0, n)  # fmt: skip
    return q, scale


TRANSFORM = Transform(
    op=OP,
    reads=("weight", "block_scale"),
    writes=FP8_DTYPE,
    eager=eager,
    outputs=("weights", "scales"),
    probes=block_fp8_dequant.probes,
    native=lambda p: lambda w, s: to_channel_fp8(w, s, p.block, p.fp8_max, p.signed_zero),
    rows=rows,
    native_dtypes=("F8_E4M3",),
    compiles=True,
    split="mla",
    exact_op="dequant",
    verify="channel_fp8",
    bound="channel_fp8",
)
