"""Stand-in for vllm/model_executor/layers/attention/mla_attention.py at vLLM 2fdb4ed:
`MLAAttention.process_weights_after_loading` and `MLAAttention.create_reload_state`.

The method no longer splits kv_b_proj itself: it builds a processing policy
(reload_mla.get_mla_processing_policy, imported at call time as there, through the vLLM module
name) and calls its `process_weights`; there is no module-level `split_kv_b_proj`. The AMX branch
sets a new empty kv_b_proj weight and returns, as in 0.32.0. As in ../vllm_upstream.py, the
default quant scales ask the quant config's `get_quant_method`.
"""

from __future__ import annotations

import torch
import vllm_upstream
from vllm_upstream import set_default_quant_scales, should_load_quant_weights


class MLAAttention(vllm_upstream.MLAAttention):
    def process_weights_after_loading(self, act_dtype: torch.dtype):
        from vllm.model_executor.model_loader.reload.mla import get_mla_processing_policy

        self.impl.process_weights_after_loading(act_dtype)
        self._mla_processing_policy = get_mla_processing_policy(self)
        self._mla_act_dtype = act_dtype
        if self.is_amx_bmm_enabled:
            self.kv_b_proj.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
            return
        if self.dcp_q_replicate:
            assert self.q_pad_num_heads in (None, self.num_heads)
            if self.is_aiter_triton_fp4_bmm_enabled or self.is_aiter_triton_fp8_bmm_enabled:
                raise NotImplementedError(
                    "DCP query replication is not implemented for the aiter FP4/FP8 MLA BMM paths."
                )
        self._mla_processing_policy.process_weights(self, act_dtype)
        self._mla_processing_policy.warmup(self)
        quant_method = self.quant_config.get_quant_method(self, prefix=self.layer_name) if self.quant_config else None
        if not should_load_quant_weights(quant_method):
            set_default_quant_scales(self, register_buffer=False)

    def create_reload_state(self, key: str):
        """The trace-reload state of this layer: derived from `<layer name without .attn>.kv_b_proj`."""
        from .reload_mla import MLAReloadPolicy, get_mla_processing_policy
        from .reload_trace import ReloadState

        if not isinstance(self, MLAAttention):
            raise TypeError(f"{key}: expected an MLAAttention module")
        source = self.kv_b_proj
        processing = get_mla_processing_policy(self)
        source_key = f"{self.layer_name.removesuffix('.attn')}.kv_b_proj"
        return ReloadState(key=key, module=self, roles=(), policy=MLAReloadPolicy(self, source, processing),
                           dependencies=(source_key,))  # fmt: skip
