"""Stand-in for vllm_gaudi/attention/backends/hpu_attn.py: `HPUMLAImpl`, for what weight loading
touches. Its submodules (the latent cache, the two matmuls, the fused SDPA module, with the HPU
kernels left out) are where the KV-cache quant method puts its scales; its
`process_weights_after_loading` re-registers `W_UV` / `W_UK_T` only if the impl itself owns them,
which since upstream moved them onto MLAAttention it does not."""

from __future__ import annotations

import torch
from torch import nn
from vllm.model_executor.utils import replace_parameter
from vllm_upstream import AttentionImplBase


class HPUMLAImpl(AttentionImplBase, nn.Module):
    def __init__(self, *, num_heads, head_size, scale, kv_cache_dtype, kv_lora_rank, qk_nope_head_dim,
                 qk_rope_head_dim, v_head_dim, kv_b_proj, **_):  # fmt: skip
        nn.Module.__init__(self)
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_lora_rank, self.qk_nope_head_dim = kv_lora_rank, qk_nope_head_dim
        self.qk_rope_head_dim, self.v_head_dim = qk_rope_head_dim, v_head_dim
        self.kv_b_proj = kv_b_proj
        self.matmul_qk = nn.Module()
        self.matmul_av = nn.Module()
        self.latent_cache_k = nn.Module()
        self.fused_scaled_dot_product_attention = nn.Module()

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        for name in ("W_UV", "W_UK_T"):
            weight = getattr(self, name, None)
            if weight is not None:
                replace_parameter(self, name, weight.contiguous())
