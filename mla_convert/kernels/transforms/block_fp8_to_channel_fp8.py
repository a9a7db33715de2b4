"""Block FP8 -> channel FP8: the exact dequant, quantized per output row (numerics.block_to_channel_fp8);
its channel scale is written right after the weight. DeepSeek's float32 or E8M0 block scales, and
compressed-tensors FP8_BLOCK's bfloat16 ones, are widened to float32 exactly first."""

from __future__ import annotations

from mla_convert.kernels import native
from mla_convert.kernels.transforms import block_fp8_dequant
from mla_convert.kernels.transforms.transform import FP8_DTYPE, Params, Transform

OP = "fp8"


def eager(p: Params):
    from mla_convert.kernels import numerics

    return lambda w, s: numerics.block_to_channel_fp8(w, s, p.block, p.fp8_max, p.signed_zero)


def rows(p: Params):
    def kernel(w: int, s: int, k: int, q: int, scale: int, r0: int, r1: int) -> None:
        native.channel_fp8(w, s, k, q, scale, r0, r1, p)

    return kernel


TRANSFORM = Transform(
    op=OP,
    reads=("weight", "block_scale"),
    writes=FP8_DTYPE,
    eager=eager,
    outputs=("weights", "scales"),
    probes=block_fp8_dequant.probes,
    native=lambda p: lambda w, s: native.to_channel_fp8(w, s, p.block, p.fp8_max, p.signed_zero),
    rows=rows,
    native_dtypes=("F8_E4M3",),
    compiles=True,
    split="mla",
    exact_op="dequant",
    verify="channel_fp8",
    bound="channel_fp8",
)
