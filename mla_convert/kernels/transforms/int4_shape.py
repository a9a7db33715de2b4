"""A pack-quantized INT4 weight's weight_shape: copied as it is, once its values are checked to be
its packed weight's [rows, cols] (conversion.scales.check_int4_shape)."""

from __future__ import annotations

from mla_convert.kernels.transforms.transform import SOURCE_DTYPE, Params, Transform

OP = "int4_shape"


def eager(p: Params):
    return lambda shape: shape


TRANSFORM = Transform(op=OP, reads=("shape",), writes=SOURCE_DTYPE, eager=eager, verify="copy", bound="copied")
