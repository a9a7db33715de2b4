"""Block FP8 -> its exact float32 value: dequant[i, j] = fp32(weight[i, j]) * scale[i // bn, j // bk].

Not an op of a plan: the exact value the block-FP8 transforms' MLA artifacts are split from
(kernels.transforms.mla_split), checked like one.
"""

from __future__ import annotations

from mla_convert.kernels import native
from mla_convert.kernels.transforms.transform import F32_DTYPE, Params, Transform

OP = "dequant"


def eager(p: Params):
    from mla_convert.kernels import numerics

    return lambda w, s: numerics.dequantize_block_fp8(w, s, p.block)


def dequantize(weight, scale_inv, block: tuple[int, int]):
    """The C entry on CPU tensors: the exact fp32 dequant (native.dequant_rows_at, which verify
    shares)."""
    import torch

    native.library()
    n, k = native.check_block_fp8(weight, scale_inv, block)
    w, s = weight.contiguous(), scale_inv.contiguous()
    out = torch.empty(n, k, dtype=torch.float32)
    if n and k:
        native.dequant_rows_at(w.data_ptr(), s.data_ptr(), k, block, out.data_ptr(), n)
    return out


def probes(p: Params) -> list[tuple]:
    from mla_convert.kernels import probes

    return probes.block_inputs(p.block, p.fp8_max)


TRANSFORM = Transform(
    op=OP,
    reads=("weight", "block_scale"),
    writes=F32_DTYPE,
    eager=eager,
    probes=probes,
    native=lambda p: lambda w, s: dequantize(w, s, p.block),
    native_dtypes=("F8_E4M3",),
    verify="mla",
    bound="mla_artifacts",
)
