"""What happens to one output tensor: the plan's vocabulary, shared by the shard jobs that carry
it out and by verify, which checks each tensor by the op that made it.

Each op but FP8_SCALE is a transform (kernels.transforms: one module each, which says what it
reads, how it is computed and checked); these are their names as a plan spells them.
"""

from __future__ import annotations

from mla_convert.kernels.transforms import BLOCK_OPS as BLOCK_OPS
from mla_convert.kernels.transforms import CONVERTING_OPS as CONVERTING_OPS
from mla_convert.kernels.transforms import (
    PLAN_TRANSFORMS,
    block_fp8_to_bf16,
    block_fp8_to_channel_fp8,
    copy,
    float_to_channel_fp8,
    int4_shape,
    int4_to_bf16,
)

COPY = copy.OP  # bit-exact copy of a source tensor that is not converted
TO_BF16 = block_fp8_to_bf16.OP  # block-FP8 weight -> bf16
TO_FP8 = block_fp8_to_channel_fp8.OP  # block-FP8 weight -> channel-FP8 weight (its scale is the next tensor)
QUANT_FP8 = float_to_channel_fp8.OP  # a 16- or 32-bit source linear -> channel-FP8 weight (its scale is next)
FP8_SCALE = "fp8_scale"  # the scale computed with the previous weight (its layout: the format's)
INT4_TO_BF16 = int4_to_bf16.OP  # a pack-quantized INT4 weight (packed, scale) -> bf16 `weight`
INT4_SHAPE = int4_shape.OP  # an INT4 weight's weight_shape: its values checked against the packed weight, copied

COPY_OPS = (COPY, INT4_SHAPE)  # what writes the source tensor's bytes as they are


def reads(op: str) -> tuple[str, ...]:
    """The roles of the source tensors `op` reads (Transform.reads; none for FP8_SCALE)."""
    t = PLAN_TRANSFORMS.get(op)
    return t.reads if t is not None else ()
