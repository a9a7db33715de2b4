"""A pack-quantized INT4 weight (packed int32 codes, group scales, weight_shape) -> bf16: its exact
float32 dequant ((code - 8) * scale, numerics.dequantize_int4) rounded once to nearest-even. The
exact value is also what a kv_b_proj's MLA artifacts are split from. No C entry: eager torch."""

from __future__ import annotations

from mla_convert.kernels.transforms.transform import BF16_DTYPE, Params, Transform

OP = "int4_bf16"


def exact(p: Params):
    """(packed, scale, cols, group_size) -> the float32 dequant."""
    from mla_convert.kernels import numerics

    return numerics.dequantize_int4


def from_exact(x):
    from mla_convert.kernels import numerics

    return numerics.to_bf16(x)


def eager(p: Params):
    dequant = exact(p)
    return lambda packed, scale, cols, group_size: from_exact(dequant(packed, scale, cols, group_size))


TRANSFORM = Transform(
    op=OP,
    reads=("packed", "group_scale", "shape"),
    writes=BF16_DTYPE,
    eager=eager,
    exact=exact,
    from_exact=from_exact,
    verify="int4_bf16",
    bound="bf16",
)
