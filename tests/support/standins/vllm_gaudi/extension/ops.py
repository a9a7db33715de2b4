"""Stand-in for vllm_gaudi.extension.ops: the one helper HPUMLAAttention's FP8 block path calls.

Written from its documented behaviour: the FP8 weight [M, N] (padded to whole blocks) is split into
[block_m, block_n] tiles, each tile is multiplied by its scale in `dtype` (bf16(w) * bf16(scale)),
and with `do_unpad` the result is cut back to [original_M, original_N].
"""

from __future__ import annotations

import torch


def dequant_block_fp8_weight_naive(
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block_size,
    dtype: torch.dtype = torch.bfloat16,
    original_M: int | None = None,
    original_N: int | None = None,
    do_unpad: bool = False,
) -> torch.Tensor:
    if weight_scale is None:
        return weight
    bm, bn = int(block_size[0]), int(block_size[1])
    gm, gn = weight_scale.shape
    m, n = weight.shape
    if (m, n) != (gm * bm, gn * bn):
        raise ValueError(f"weight {(m, n)} is not padded to the {gm}x{gn} grid of {bm}x{bn} blocks")
    tiles = weight.to(dtype).view(gm, bm, gn, bn)
    out = (tiles * weight_scale.to(dtype).view(gm, 1, gn, 1)).view(m, n)
    if do_unpad:
        out = out[:original_M, :original_N]
    return out
