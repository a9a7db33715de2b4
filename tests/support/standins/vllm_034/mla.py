"""Stand-in for vllm 0.34.0's vllm/model_executor/layers/mla.py: what
`MultiHeadLatentAttentionWrapper.__init__` builds for loading (lines 63-140): it keeps the caller's
kv_b_proj (registered here too: a module shared by two parents) and builds the MLAAttention at
`{prefix}.attn` over it, with the model's quant config. Forward passes are left out.
"""

from __future__ import annotations

from torch import nn

from .mla_attention import MLAAttention


class MultiHeadLatentAttentionWrapper(nn.Module):
    def __init__(self, hidden_size, num_heads, scale, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, q_lora_rank,
                 kv_lora_rank, kv_b_proj, cache_config=None, quant_config=None, prefix="", *, is_sparse=False,
                 dcp_q_replicate=False, vllm_config=None):  # fmt: skip
        super().__init__()
        self.hidden_size, self.num_heads = hidden_size, num_heads
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.q_lora_rank, self.kv_lora_rank = q_lora_rank, kv_lora_rank
        self.kv_b_proj = kv_b_proj
        self.is_sparse = is_sparse
        self.mla_attn = MLAAttention(
            num_heads=num_heads, scale=scale, qk_nope_head_dim=qk_nope_head_dim, qk_rope_head_dim=qk_rope_head_dim,
            v_head_dim=v_head_dim, q_lora_rank=q_lora_rank, kv_lora_rank=kv_lora_rank, cache_config=cache_config,
            quant_config=quant_config, prefix=f"{prefix}.attn", kv_b_proj=kv_b_proj, dcp_q_replicate=dcp_q_replicate,
            use_sparse=is_sparse, vllm_config=vllm_config,
        )  # fmt: skip
