"""All weight arithmetic of the converter: pure functions, tensor in, tensors out.

Block FP8 (DeepSeek): dequant[i, j] = fp32(weight[i, j]) * scale_inv[i // bn, j // bk].
"""

from __future__ import annotations

import math

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = {"gaudi3": 448.0, "gaudi2": 240.0}


def expand_block_scale(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """Scale grid [ceil(N/bn), ceil(K/bk)] -> per-element fp32 scale [N, K] (edge blocks cut)."""
    n, k = shape
    bn, bk = block
    return scale.float().repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]


def dequantize_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Exact fp32 dequant of a block-FP8 weight (the product of an e4m3 value and an fp32 scale)."""
    n, k = weight.shape
    bn, bk = block
    gn, gk = scale_inv.shape
    if (gn, gk) != (math.ceil(n / bn), math.ceil(k / bk)):
        raise ValueError(f"scale grid {(gn, gk)} does not fit weight {(n, k)} with block {block}")
    # Multiply block-wise through a padded view (no [N, K] scale tensor). One spare block row and
    # column are always padded, so cutting back to [N, K] is never a no-op: torch.compile then
    # keeps one graph for aligned and partial shapes alike instead of recompiling per case.
    pn, pk = (gn + 1) * bn, (gk + 1) * bk
    w = torch.nn.functional.pad(weight.float(), (0, pk - k, 0, pn - n))
    s = torch.nn.functional.pad(scale_inv.float(), (0, 1, 0, 1))
    out = (w.view(gn + 1, bn, gk + 1, bk) * s.view(gn + 1, 1, gk + 1, 1)).view(pn, pk)
    return out[:n, :k].contiguous()


def to_bf16(dequant: torch.Tensor) -> torch.Tensor:
    """bf16(fp32 dequant): round-to-nearest-even, as DeepSeek's reference converter does."""
    return dequant.to(torch.bfloat16)


def channel_scales(dequant: torch.Tensor, fp8_max: float) -> torch.Tensor:
    """Per output row: max|row| / fp8_max; rows whose scale would be 0 (all zero) get 1.0."""
    amax = dequant.abs().amax(dim=1)
    scale = amax / fp8_max
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def quantize_channel_fp8(dequant: torch.Tensor, fp8_max: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [N, K] -> (e4m3 weight [N, K], fp32 scale [N, 1]) with weight * scale ~= dequant.

    Division (not multiplication by a reciprocal) keeps the quotient correctly rounded; the
    clamp makes saturation explicit whatever torch's cast does out of range.
    """
    scale = channel_scales(dequant, fp8_max).unsqueeze(1)
    q = (dequant / scale).clamp_(-fp8_max, fp8_max).to(FP8_DTYPE)
    return q, scale.contiguous()


def block_to_channel_fp8(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], fp8_max: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_channel_fp8(dequantize_block_fp8(weight, scale_inv, block), fp8_max)
