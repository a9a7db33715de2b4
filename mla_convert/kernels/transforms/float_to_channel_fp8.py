"""A 16- or 32-bit source linear -> channel FP8: its exact float32 value quantized per output row
(numerics.float_to_channel_fp8); its channel scale is written right after it. The fast
implementations take bf16 (what they are probed on); another float dtype runs the definition."""

from __future__ import annotations

from mla_convert.kernels import native
from mla_convert.kernels.transforms.transform import BF16_DTYPE, FP8_DTYPE, Params, Transform

OP = "quant"


def eager(p: Params):
    from mla_convert.kernels import numerics

    return lambda w: numerics.float_to_channel_fp8(w, p.fp8_max, p.signed_zero)


def probes(p: Params) -> list[tuple]:
    from mla_convert.kernels import probes

    return probes.float_inputs(p.fp8_max)


def rows(p: Params):
    def kernel(w: int, _s: int, k: int, q: int, scale: int, r0: int, r1: int) -> None:
        native.bf16_channel_fp8(w, k, p.fp8_max, p.signed_zero, q, scale, r0, r1)

    return kernel


TRANSFORM = Transform(
    op=OP,
    reads=("weight",),
    writes=FP8_DTYPE,
    eager=eager,
    outputs=("weights", "scales"),
    probes=probes,
    native=lambda p: lambda w: native.bf16_to_channel_fp8(w, p.fp8_max, p.signed_zero),
    rows=rows,
    native_dtypes=(BF16_DTYPE,),
    compiles=True,
    split="mla16",
    verify="channel_fp8",
    bound="channel_fp8",
)
