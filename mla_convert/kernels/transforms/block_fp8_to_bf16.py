"""Block FP8 -> bf16: the exact dequant rounded once to nearest-even, as DeepSeek's reference
converter does."""

from __future__ import annotations

from mla_convert.kernels import native
from mla_convert.kernels.transforms import block_fp8_dequant
from mla_convert.kernels.transforms.transform import BF16_DTYPE, Params, Transform

OP = "bf16"


def eager(p: Params):
    from mla_convert.kernels import numerics

    return lambda w, s: numerics.to_bf16(numerics.dequantize_block_fp8(w, s, p.block))


def rows(p: Params):
    def kernel(w: int, s: int, k: int, out: int, _scale: int, r0: int, r1: int) -> None:
        native.bf16_rows(w, s, k, p.block, out, r0, r1)

    return kernel


TRANSFORM = Transform(
    op=OP,
    reads=("weight", "block_scale"),
    writes=BF16_DTYPE,
    eager=eager,
    probes=block_fp8_dequant.probes,
    native=lambda p: lambda w, s: native.to_bf16(w, s, p.block),
    rows=rows,
    native_dtypes=("F8_E4M3",),
    compiles=True,
    split="mla",
    exact_op="dequant",
    verify="bf16",
    bound="bf16",
)
