"""Stand-in for vllm 0.33.0's vllm/model_executor/layers/attention/mla_attention.py:
`split_kv_b_proj` (lines 408-423) and `MLAAttention.process_weights_after_loading` (1242-1366).

Against 0.32.0: the AMX branch releases kv_b_proj's weight through `replace_parameter` (the
parameter object stays, with 0 elements), and every `replace_parameter` call lost `prefer_copy`
(0.33's keeps the object and copies in place when the layout matches). `split_kv_b_proj` is looked
up in this module at call time, as there. As in ../vllm_upstream.py, the ROCm aiter branches are
left out, and the default quant scales ask the quant config's `get_quant_method` (what
`resolve_quant_method` returns for the configs stood in).
"""

from __future__ import annotations

import torch
import vllm_upstream
from vllm_upstream import (
    get_and_maybe_dequant_weights,
    get_dcp_group,
    set_default_quant_scales,
    should_load_quant_weights,
)

from .utils import replace_parameter


def split_kv_b_proj(kv_b_proj, out_dtype, kv_lora_rank, num_heads, qk_nope_head_dim, v_head_dim):
    """Dequantize kv_b_proj and return W_UK [L, N, P], W_UV [L, N, V] (views of its transpose)."""
    weight = get_and_maybe_dequant_weights(kv_b_proj, out_dtype=out_dtype).T
    assert weight.shape == (kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim)), tuple(weight.shape)
    weight = weight.view(kv_lora_rank, num_heads, qk_nope_head_dim + v_head_dim)
    return weight.split([qk_nope_head_dim, v_head_dim], dim=-1)


class MLAAttention(vllm_upstream.MLAAttention):
    def process_weights_after_loading(self, act_dtype: torch.dtype):
        self.impl.process_weights_after_loading(act_dtype)
        if self.is_amx_bmm_enabled:
            replace_parameter(self.kv_b_proj, "weight", self.kv_b_proj.weight.new_empty(0))
            return
        if self.dcp_q_replicate:
            assert self.q_pad_num_heads in (None, self.num_heads)
            if self.is_aiter_triton_fp4_bmm_enabled or self.is_aiter_triton_fp8_bmm_enabled:
                raise NotImplementedError(
                    "DCP query replication is not implemented for the aiter FP4/FP8 MLA BMM paths."
                )
        W_UK, W_UV = split_kv_b_proj(
            self.kv_b_proj, act_dtype, self.kv_lora_rank, self.num_heads, self.qk_nope_head_dim, self.v_head_dim
        )
        if self.is_aiter_triton_fp4_bmm_enabled or self.is_aiter_triton_fp8_bmm_enabled:
            raise NotImplementedError("stand-in: the ROCm aiter BMM branches")
        replace_parameter(self, "W_UV", W_UV.transpose(0, 1))  # (L, N, V) -> (N, L, V)
        replace_parameter(self, "W_UK_T", W_UK.permute(1, 2, 0))  # (L, N, P) -> (N, P, L)
        if self.dcp_q_replicate:
            replace_parameter(self, "W_UK_T_dcp_qrep", get_dcp_group().all_gather(self.W_UK_T.contiguous(), dim=0))
        quant_method = self.quant_config.get_quant_method(self, prefix=self.layer_name) if self.quant_config else None
        if not should_load_quant_weights(quant_method):
            set_default_quant_scales(self, register_buffer=False)
