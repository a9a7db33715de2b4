"""A 16- or 32-bit source linear -> channel FP8: its exact float32 value quantized per output row
(numerics.float_to_channel_fp8); its channel scale is written right after it. The fast
implementations take bf16 (what they are probed on); another float dtype runs the definition."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mla_convert.kernels import native
from mla_convert.kernels.native import F32, I64, PTR, U32
from mla_convert.kernels.transforms.transform import BF16_DTYPE, FP8_DTYPE, Params, Transform
from mla_convert.process import threads

if TYPE_CHECKING:
    import torch

OP = "quant"
# (w, k, fp8_max, zero_sign, q, scale, r0, r1, threads): fp8_kernels.c
_C = native.Entry("mla_bf16_channel", [PTR, I64, F32, U32, PTR, PTR, I64, I64, I64])


def eager(p: Params):
    from mla_convert.kernels import numerics

    return lambda w: numerics.float_to_channel_fp8(w, p.fp8_max, p.signed_zero)


def probes(p: Params) -> list[tuple]:
    from mla_convert.kernels import probes

    return probes.float_inputs(p.fp8_max)


def rows(p: Params):
    """Rows [r0, r1) of a bf16 weight of k columns at `w`: codes to `q`, float32 channel scales to `scale`."""
    zero_sign = native.zero_sign(p.signed_zero)

    def kernel(w: int, _s: int, k: int, q: int, scale: int, r0: int, r1: int) -> None:
        _C(w, k, p.fp8_max, zero_sign, q, scale, r0, r1, threads.count())

    return kernel


def bf16_to_channel_fp8(
    weight: torch.Tensor, fp8_max: float, signed_zero: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """The C entry on a 2-D bf16 CPU weight: (e4m3fn [N, K], fp32 scale [N, 1])."""
    import torch

    native.library()
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.device.type != "cpu":
        raise ValueError(
            f"bf16_to_channel_fp8 takes a 2-D bfloat16 CPU weight, got {weight.dtype} {tuple(weight.shape)}"
        )
    n, k = weight.shape
    w = weight.contiguous()
    scale = torch.empty(n, 1, dtype=torch.float32)
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    if n and k:
        rows(Params((1, 1), fp8_max, signed_zero))(w.data_ptr(), 0, k, q.data_ptr(), scale.data_ptr(), 0, n)
    return q, scale


TRANSFORM = Transform(
    op=OP,
    reads=("weight",),
    writes=FP8_DTYPE,
    eager=eager,
    outputs=("weights", "scales"),
    probes=probes,
    native=lambda p: lambda w: bf16_to_channel_fp8(w, p.fp8_max, p.signed_zero),
    rows=rows,
    native_dtypes=(BF16_DTYPE,),
    compiles=True,
    split="mla16",
    verify="channel_fp8",
    bound="channel_fp8",
)
