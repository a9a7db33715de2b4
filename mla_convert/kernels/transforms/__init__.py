"""The transforms, one module each (kernels.transforms.transform says what a module declares).
Adding one: its module, its line here, its tests; its C entry (if any) in fp8_kernels.c and
kernels.native. No torch at import.

`register` adds a transform from outside the package (a format a test or a plugin adds,
docs/adding-a-format.md): it runs its eager definition, as the kernel sets (probed, native,
compiled) implement the built-in transforms only."""

from __future__ import annotations

import contextlib

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
from mla_convert.registry import Registry

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
_REGISTRY = Registry("transform", PLAN_TRANSFORMS, lambda t: t.op)
CONVERTING_OPS = tuple(op for op, t in PLAN_TRANSFORMS.items() if t.probes is not None)  # fp8, bf16, quant
BLOCK_OPS = tuple(op for op in CONVERTING_OPS if "block_scale" in PLAN_TRANSFORMS[op].reads)


def register(t: Transform) -> Transform:
    """Make `t` a transform a plan may name (PLAN_TRANSFORMS). It runs its eager definition (no
    probes, native or rows entry: the kernel sets implement the built-in transforms only); it may
    read a weight and its block scale ("weight", "block_scale"), and write the source's dtype,
    BF16, or FP8 with a scale written next (FP8_DTYPE). ValueError for a name taken or an entry it
    cannot have."""
    if t.op in KERNEL_TRANSFORMS:
        raise ValueError(f"a transform named {t.op!r} is registered already")
    if t.probes is not None or t.native is not None or t.rows is not None or t.compiles:
        raise ValueError(f"transform {t.op!r}: a registered transform runs its eager definition only")
    if not set(t.reads) <= {"weight", "block_scale"}:
        raise ValueError(f"transform {t.op!r} reads {t.reads}: a registered one reads a weight and its block scale")
    return _REGISTRY.add(t)


def unregister(op: str) -> None:
    _REGISTRY.remove(op)


def registered(*transforms: Transform) -> contextlib.AbstractContextManager:
    """`transforms` registered while the block runs."""
    return _REGISTRY.scoped(transforms, register)


__all__ = [
    "BLOCK_OPS", "CONVERTING_OPS", "KERNEL_TRANSFORMS", "PLAN_TRANSFORMS", "SPLITS", "Params", "Transform",
    "register", "registered", "unregister",
]  # fmt: skip
