"""A layer's kv_b_proj -> its MLA artifacts W_UK_T [N, P, L] and W_UV [N, L, V] in bf16
(mla_runtime.layout.split_kv_b_proj), split from the exact value of the SOURCE kv_b_proj: the
float32 dequant of a block-FP8 one ("mla"), a 16-bit one as it is ("mla16", only values move).
Each takes the layer's own MLA dims."""

from __future__ import annotations

from collections.abc import Callable

from mla_convert.kernels import native
from mla_convert.kernels.transforms.transform import BF16_DTYPE, Params, Transform

OP, OP16 = "mla", "mla16"


def split_of(dequant: Callable) -> Callable:
    """The split of a block-FP8 kv_b_proj as a kernel set without a split of its own makes it:
    torch's split of that set's dequant."""

    def split(w, s, dims):
        import torch

        from mla_runtime.layout import split_kv_b_proj

        return split_kv_b_proj(dequant(w, s), dims, torch.bfloat16)

    return split


def eager(p: Params):
    from mla_convert.kernels import numerics

    return split_of(lambda w, s: numerics.dequantize_block_fp8(w, s, p.block))


def eager16(p: Params):
    def split(w, dims):
        import torch

        from mla_runtime.layout import split_kv_b_proj

        return split_kv_b_proj(w, dims, torch.bfloat16)

    return split


def probes(p: Params) -> list[tuple]:
    from mla_convert.kernels import probes

    return [probes.mla_probe(p.block)]


def probes16(p: Params) -> list[tuple]:
    from mla_convert.kernels import probes

    return [(*probes.mla16_probe(p.block), probes.mla_probe(p.block)[2])]


def rows(p: Params):
    """(kv_b_proj codes, float32 block scales, dims, W_UK_T, W_UV) on raw addresses."""
    return lambda w, s, dims, uk_t, uv: native.split_fp8(w, s, p.block, dims, uk_t, uv)


def rows16(p: Params):
    """(bf16 kv_b_proj, 0, dims, W_UK_T, W_UV) on raw addresses."""
    return lambda w, _s, dims, uk_t, uv: native.split_bf16(w, dims, uk_t, uv)


TRANSFORM = Transform(
    op=OP,
    reads=("weight", "block_scale"),
    writes=BF16_DTYPE,
    eager=eager,
    outputs=("W_UK_T", "W_UV"),
    probes=probes,
    native=lambda p: lambda w, s, dims: native.split_kv_b_proj(w, s, p.block, dims),
    rows=rows,
    native_dtypes=("F8_E4M3",),
    verify="mla",
    bound="mla_artifacts",
)
TRANSFORM16 = Transform(
    op=OP16,
    reads=("weight",),
    writes=BF16_DTYPE,
    eager=eager16,
    outputs=("W_UK_T", "W_UV"),
    probes=probes16,
    native=lambda p: lambda w, dims: native.split_kv_b_proj(w, None, None, dims),
    rows=rows16,
    native_dtypes=(BF16_DTYPE,),
    verify="mla",
    bound="mla_artifacts",
)
