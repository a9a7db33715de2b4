"""Stand-in for vllm_gaudi/attention/oot_mla.py: `HPUMLAAttention` and its
`process_weights_after_loading`, step by step as at the pinned commit.

By the time it runs, kv_b_proj's linear method has processed the weight (model_loader calls every
quant method first). Two branches:
- an FP8 weight with `weight_scale_inv` (a block-FP8 checkpoint; 1-D after
  VLLM_HPU_FORCE_CHANNEL_FP8 requantized it, 2-D without): dequantize in the activation dtype,
  split, and keep `W_UV` / `W_UK_T` as plain contiguous attributes, then the default quant scales
  unless the layer has a KV-cache quant method;
- anything else (bf16; compressed-tensors, whose scale is `weight_scale`): upstream MLAAttention's
  method, then `replace_parameter` with contiguous copies, so both stay registered parameters.

vLLM's names are imported as the real file imports them (`vllm.model_executor.layers.attention`,
`vllm.model_executor.utils`); the tests point them at the stand-in of one vLLM code base
(../../codebases.py), so the upstream branch runs on each.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.attention import MLAAttention
from vllm.model_executor.utils import replace_parameter

from vllm_gaudi.attention.backends.hpu_attn import HPUMLAImpl


class HPUMLAAttention(MLAAttention):
    impl_cls = HPUMLAImpl

    def process_weights_after_loading(self, act_dtype: torch.dtype):
        kv_b_proj = self.kv_b_proj
        weight = kv_b_proj.weight
        weight_scale_inv = getattr(kv_b_proj, "weight_scale_inv", None)
        if weight.dtype == torch.float8_e4m3fn and weight_scale_inv is not None:
            if weight_scale_inv.dim() == 1:
                per_row = weight_scale_inv.view(-1, 1).to(act_dtype)
                kv_b = (weight.to(act_dtype) * per_row).T.contiguous()
            else:
                from vllm_gaudi.extension.ops import dequant_block_fp8_weight_naive

                orig_m = kv_b_proj.orig_M.item() if hasattr(kv_b_proj, "orig_M") else None
                orig_n = kv_b_proj.orig_N.item() if hasattr(kv_b_proj, "orig_N") else None
                kv_b = dequant_block_fp8_weight_naive(
                    weight.contiguous(), weight_scale_inv, kv_b_proj.weight_block_size, dtype=act_dtype,
                    original_M=orig_m, original_N=orig_n, do_unpad=orig_m is not None,
                ).T  # fmt: skip
            per_head = self.qk_nope_head_dim + self.v_head_dim
            assert kv_b.shape == (self.kv_lora_rank, self.num_heads * per_head), tuple(kv_b.shape)
            kv_b = kv_b.view(self.kv_lora_rank, self.num_heads, per_head)
            w_uk, w_uv = kv_b.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
            self.W_UV = w_uv.transpose(0, 1).contiguous()
            self.W_UK_T = w_uk.permute(1, 2, 0).contiguous()

            from vllm.model_executor.layers.attention.attention import (
                set_default_quant_scales,
                should_load_quant_weights,
            )

            method = self.quant_config.get_quant_method(self, prefix=self.layer_name) if self.quant_config else None
            if not should_load_quant_weights(method):
                set_default_quant_scales(self, register_buffer=False)
        else:
            MLAAttention.process_weights_after_loading(self, act_dtype)
            replace_parameter(self, "W_UV", self.W_UV.contiguous())
            replace_parameter(self, "W_UK_T", self.W_UK_T.contiguous())
