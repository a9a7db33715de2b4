"""How the MLA attention layer lays out kv_b_proj as W_UK_T / W_UV.

This is the layout of vllm-gaudi's HPUMLAAttention.process_weights_after_loading (and of upstream
vLLM's MLAAttention after its split): kv_b_proj [N*(P+V), L] -> transpose [L, N*(P+V)] ->
view [L, N, P+V] -> split last dim -> W_UK_T = W_UK.permute(1, 2, 0) [N, P, L],
W_UV = W_UV.transpose(0, 1) [N, L, V], both contiguous.
"""

from __future__ import annotations

import torch

from .format import MlaDims


def split_kv_b_proj(
    kv_b_weight: torch.Tensor, dims: MlaDims, out_dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantized kv_b_proj weight [N*(P+V), L] -> (W_UK_T [N,P,L], W_UV [N,L,V]).

    The cast to `out_dtype` happens first; transposes and splits only move values, so the result
    is bit-identical to splitting the `out_dtype` copy of the weight.
    """
    n, p, v, l = dims.num_heads, dims.qk_nope_head_dim, dims.v_head_dim, dims.kv_lora_rank
    if tuple(kv_b_weight.shape) != (n * (p + v), l):
        raise ValueError(
            f"kv_b_proj weight has shape {tuple(kv_b_weight.shape)}, expected {(n * (p + v), l)} "
            f"for N={n} heads, P={p}, V={v}, L={l}"
        )
    w = kv_b_weight.to(out_dtype).view(n, p + v, l)
    w_uk_t = w[:, :p, :].contiguous()  # [N, P, L] == W_UK.permute(1, 2, 0)
    w_uv = w[:, p:, :].transpose(1, 2).contiguous()  # [N, L, V] == W_UV.transpose(0, 1)
    return w_uk_t, w_uv
