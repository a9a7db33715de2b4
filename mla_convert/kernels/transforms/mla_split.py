"""A layer's kv_b_proj -> its MLA artifacts W_UK_T [N, P, L] and W_UV [N, L, V] in bf16
(mla_runtime.layout.split_kv_b_proj), split from the exact value of the SOURCE kv_b_proj: the
float32 dequant of a block-FP8 one ("mla"), a 16-bit one as it is ("mla16", only values move).
Each takes the layer's own MLA dims."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from mla_convert.kernels import native
from mla_convert.kernels.native import I64, PTR
from mla_convert.kernels.transforms.transform import BF16_DTYPE, Params, Transform
from mla_convert.process import threads

if TYPE_CHECKING:
    import torch

OP, OP16 = "mla", "mla16"
# (w, s or NULL, L, bn, bk, P, V, W_UK_T, W_UV, heads, threads): fp8_kernels.c
_C = native.Entry("mla_split", [PTR, PTR, I64, I64, I64, I64, I64, PTR, PTR, I64, I64])


def split_exact(x, dims):
    """The definition: the artifacts, in bf16, of a kv_b_proj's exact value `x` (float32, or the
    16-bit weight itself)."""
    import torch

    from mla_runtime.layout import split_kv_b_proj

    return split_kv_b_proj(x, dims, torch.bfloat16)


def split_of(dequant: Callable) -> Callable:
    """The split of a block-FP8 kv_b_proj as a kernel set without a split of its own makes it:
    the split of that set's dequant."""
    return lambda w, s, dims: split_exact(dequant(w, s), dims)


def eager(p: Params):
    from mla_convert.kernels import numerics

    return split_of(lambda w, s: numerics.dequantize_block_fp8(w, s, p.block))


def eager16(p: Params):
    return split_exact


def probes(p: Params) -> list[tuple]:
    from mla_convert.kernels import probes

    return [probes.mla_probe(p.block)]


def probes16(p: Params) -> list[tuple]:
    from mla_convert.kernels import probes

    return [(*probes.mla16_probe(p.block), probes.mla_probe(p.block)[2])]


def split_fp8(w: int, s: int, block, dims, uk_t: int, uv: int) -> None:
    """split_kv_b_proj(dequant of a block-FP8 kv_b_proj at `w`, `s`) in bf16, into W_UK_T at
    `uk_t` and W_UV at `uv` (verify's native pass splits so too)."""
    p, v, l = dims.qk_nope_head_dim, dims.v_head_dim, dims.kv_lora_rank
    _C(w, s, l, *block, p, v, uk_t, uv, dims.num_heads, threads.count())


def split_bf16(w: int, dims, uk_t: int, uv: int) -> None:
    """split_kv_b_proj of a bf16 kv_b_proj at `w`: only values move."""
    p, v, l = dims.qk_nope_head_dim, dims.v_head_dim, dims.kv_lora_rank
    _C(w, None, l, 1, 1, p, v, uk_t, uv, dims.num_heads, threads.count())


def rows(p: Params):
    """(kv_b_proj codes, float32 block scales, dims, W_UK_T, W_UV) on raw addresses."""
    return lambda w, s, dims, uk_t, uv: split_fp8(w, s, p.block, dims, uk_t, uv)


def rows16(p: Params):
    """(bf16 kv_b_proj, 0, dims, W_UK_T, W_UV) on raw addresses."""
    return lambda w, _s, dims, uk_t, uv: split_bf16(w, dims, uk_t, uv)


def split_kv_b_proj(weight, scale_inv, block: tuple[int, int] | None, dims) -> tuple[torch.Tensor, torch.Tensor]:
    """The C entry on CPU tensors: a block-FP8 kv_b_proj's dequant (`scale_inv` given) or a bf16
    one (`scale_inv` None) split in bf16: (W_UK_T [N, P, L], W_UV [N, L, V])."""
    import torch

    native.library()
    n, p, v, l = dims.num_heads, dims.qk_nope_head_dim, dims.v_head_dim, dims.kv_lora_rank
    if tuple(weight.shape) != (n * (p + v), l):
        raise ValueError(f"kv_b_proj weight has shape {tuple(weight.shape)}, expected {(n * (p + v), l)}")
    uk_t = torch.empty(n, p, l, dtype=torch.bfloat16)
    uv = torch.empty(n, l, v, dtype=torch.bfloat16)
    w = weight.contiguous()
    if scale_inv is None:
        if w.dtype != torch.bfloat16:
            raise ValueError(f"split_kv_b_proj takes a bfloat16 or float8_e4m3fn kv_b_proj, got {w.dtype}")
        split_bf16(w.data_ptr(), dims, uk_t.data_ptr(), uv.data_ptr())
    else:
        native.check_block_fp8(w, scale_inv, block)
        s = scale_inv.contiguous()
        split_fp8(w.data_ptr(), s.data_ptr(), block, dims, uk_t.data_ptr(), uv.data_ptr())
    return uk_t, uv


TRANSFORM = Transform(
    op=OP,
    reads=("weight", "block_scale"),
    writes=BF16_DTYPE,
    eager=eager,
    outputs=("W_UK_T", "W_UV"),
    probes=probes,
    native=lambda p: lambda w, s, dims: split_kv_b_proj(w, s, p.block, dims),
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
    native=lambda p: lambda w, dims: split_kv_b_proj(w, None, None, dims),
    rows=rows16,
    native_dtypes=(BF16_DTYPE,),
    verify="mla",
    bound="mla_artifacts",
)
