"""What happens to one output tensor: the plan's vocabulary, shared by the shard jobs that carry
it out and by verify, which checks each tensor by the op that made it.

The three converting ops are named as the kernels name the arithmetic they run
(kernels.select.OPS), so a plan's ops are its kernel ops. The INT4 ops run eager numerics
(kernels.numerics) in the shard job itself.
"""

from __future__ import annotations

COPY = "copy"  # bit-exact copy of a source tensor that is not converted
TO_BF16 = "bf16"  # block-FP8 weight -> bf16
TO_FP8 = "fp8"  # block-FP8 weight -> channel-FP8 weight (its scale is the next tensor)
QUANT_FP8 = "quant"  # a 16- or 32-bit source linear -> channel-FP8 weight (its scale is next)
FP8_SCALE = "fp8_scale"  # the channel scale computed with the previous weight
INT4_TO_BF16 = "int4_bf16"  # a pack-quantized INT4 weight (packed, scale) -> bf16 `weight`
INT4_SHAPE = "int4_shape"  # an INT4 weight's weight_shape: its values checked against the packed weight, copied

CONVERTING_OPS = (TO_FP8, TO_BF16, QUANT_FP8)  # what the kernels compute
CHANNEL_FP8_OPS = (TO_FP8, QUANT_FP8)  # what writes a channel-FP8 weight and its scale
COPY_OPS = (COPY, INT4_SHAPE)  # what writes the source tensor's bytes as they are
