"""Stand-in for vllm_gaudi.attention.oot_mla (tests only; see tests/support/standins/README.md).

`HPUMLAAttention.process_weights_after_loading` follows the documented source step by step. The
base class `MLAAttention` stands in for upstream vLLM's: it holds what the method reads (dims,
kv_b_proj, quant_config, layer_name, the q/k/v/prob scale buffers) and its own
`process_weights_after_loading` is the documented upstream split of an unquantized kv_b_proj.
"""

from __future__ import annotations

import torch
from torch import nn


class MLAAttention(nn.Module):
    def __init__(self, *, num_heads, qk_nope_head_dim, v_head_dim, kv_lora_rank, kv_b_proj, quant_config=None,
                 prefix=""):  # fmt: skip
        super().__init__()
        self.num_heads = num_heads
        self.qk_nope_head_dim = qk_nope_head_dim
        self.v_head_dim = v_head_dim
        self.kv_lora_rank = kv_lora_rank
        self.kv_b_proj = kv_b_proj
        self.quant_config = quant_config
        self.layer_name = prefix
        for name in ("_k_scale", "_v_scale", "_q_scale", "_prob_scale"):
            self.register_buffer(name, torch.tensor(7.0))  # anything but the default 1.0

    def process_weights_after_loading(self, act_dtype: torch.dtype):
        w = self.kv_b_proj.weight.to(act_dtype).T
        w = w.view(self.kv_lora_rank, self.num_heads, self.qk_nope_head_dim + self.v_head_dim)
        w_uk, w_uv = w.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        self.W_UV = w_uv.transpose(0, 1)
        self.W_UK_T = w_uk.permute(1, 2, 0)
        self.upstream_calls = getattr(self, "upstream_calls", 0) + 1


class HPUMLAAttention(MLAAttention):
    def process_weights_after_loading(self, act_dtype: torch.dtype):
        kv_b_proj = self.kv_b_proj
        weight = kv_b_proj.weight
        weight_scale_inv = getattr(kv_b_proj, "weight_scale_inv", None)

        if weight.dtype == torch.float8_e4m3fn and weight_scale_inv is not None:
            if weight_scale_inv.dim() == 1:
                # Channel FP8 (what VLLM_HPU_FORCE_CHANNEL_FP8 makes): one scale per output row.
                ws = weight_scale_inv.view(-1, 1).to(act_dtype)
                kv_b_proj_weight = (weight.to(act_dtype) * ws).T.contiguous()
            else:
                # Block FP8: the HPU block dequant, then transposed.
                from vllm_gaudi.extension.ops import dequant_block_fp8_weight_naive

                orig_m = kv_b_proj.orig_M.item() if hasattr(kv_b_proj, "orig_M") else None
                orig_n = kv_b_proj.orig_N.item() if hasattr(kv_b_proj, "orig_N") else None
                kv_b_proj_weight = dequant_block_fp8_weight_naive(
                    weight.contiguous(), weight_scale_inv, kv_b_proj.weight_block_size, dtype=act_dtype,
                    original_M=orig_m, original_N=orig_n, do_unpad=(orig_m is not None),
                ).T  # fmt: skip
            assert kv_b_proj_weight.shape == (
                self.kv_lora_rank,
                self.num_heads * (self.qk_nope_head_dim + self.v_head_dim),
            )
            kv_b_proj_weight = kv_b_proj_weight.view(
                self.kv_lora_rank, self.num_heads, self.qk_nope_head_dim + self.v_head_dim
            )
            w_uk, w_uv = kv_b_proj_weight.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
            self.W_UV = w_uv.transpose(0, 1).contiguous()
            self.W_UK_T = w_uk.permute(1, 2, 0).contiguous()

            from vllm.model_executor.layers.attention.attention import (
                set_default_quant_scales,
                should_load_quant_weights,
            )

            quant_method = (
                self.quant_config.get_quant_method(self, prefix=self.layer_name) if self.quant_config else None
            )
            if not should_load_quant_weights(quant_method):
                set_default_quant_scales(self, register_buffer=False)
        else:
            MLAAttention.process_weights_after_loading(self, act_dtype)
            self.W_UV = self.W_UV.contiguous()
            self.W_UK_T = self.W_UK_T.contiguous()
