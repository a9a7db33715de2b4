"""The transforms, one module each (kernels.transforms.transform says what a module declares).
Adding one: its module, its line here, its tests; its C entry (if any) in fp8_kernels.c and
kernels.native. No torch at import."""

from __future__ import annotations

from mla_convert.kernels.transforms import (
    block_fp8_dequant,
    block_fp8_to_bf16,
    block_fp8_to_channel_fp8,
    copy,
    float_to_channel_fp8,
    int4_shape,
    int4_to_bf16,
    mla_split,
)
from mla_convert.kernels.transforms.transform import Params, Transform

# What a plan's output tensors are made by (plan.ops names them).
PLAN_TRANSFORMS: dict[str, Transform] = {
    t.op: t
    for t in (
        copy.TRANSFORM,
        block_fp8_to_channel_fp8.TRANSFORM,
        block_fp8_to_bf16.TRANSFORM,
        float_to_channel_fp8.TRANSFORM,
        int4_to_bf16.TRANSFORM,
        int4_shape.TRANSFORM,
    )
}
# The transforms the kernel sets implement, each checked against its definition on its probes:
# the converting ops, the exact dequant and the MLA splits that feed the artifacts.
KERNEL_TRANSFORMS: dict[str, Transform] = {
    t.op: t
    for t in (
        block_fp8_to_channel_fp8.TRANSFORM,
        block_fp8_to_bf16.TRANSFORM,
        float_to_channel_fp8.TRANSFORM,
        block_fp8_dequant.TRANSFORM,
        mla_split.TRANSFORM,
        mla_split.TRANSFORM16,
    )
}
SPLITS = {mla_split.OP: mla_split.TRANSFORM, mla_split.OP16: mla_split.TRANSFORM16}
CONVERTING_OPS = tuple(op for op, t in PLAN_TRANSFORMS.items() if t.probes is not None)  # fp8, bf16, quant
BLOCK_OPS = tuple(op for op in CONVERTING_OPS if "block_scale" in PLAN_TRANSFORMS[op].reads)

__all__ = ["BLOCK_OPS", "CONVERTING_OPS", "KERNEL_TRANSFORMS", "PLAN_TRANSFORMS", "SPLITS", "Params", "Transform"]
