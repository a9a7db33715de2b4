"""Stand-in for the weight path of Kimi-K3.1's DSA layers in vllm 0.34.0 (vllm/models/kimi_k3/nvidia/):

- dsa.py, `KimiK3DSAAttention.__init__`: its kv_b_proj is a `ColumnParallelLinear` under the
  model's quant config (quantized when the checkpoint is), handed to a
  `MultiHeadLatentAttentionWrapper` (../mla.py) at the layer's prefix, so the MLAAttention is
  `{prefix}.attn`; `pack_projections` packs other projections, never kv_b_proj, and only on the
  fused FP8 cache path (not stood in: it returns);
- model.py, `KimiK3ForCausalLM`: `process_weights_after_loading()` (the root's hook, run last by
  finalize_model_weights) packs the DSA projections when there is no specialized decode, else
  refreshes the specialized decode after a reload; `build_specialized_decode`, which the model
  state calls once the weights are loaded;
- mla.py, Kimi-K3's dense `MultiHeadLatentAttention` (lines 130-490): its own AttentionLayerBase,
  no MLAAttention, registered in the static forward context; its hook absorbs kv_b_proj itself
  with the module-level `split_kv_b_proj` (unless the weights come pre-processed);
- specialized_decode/: what the specialized decode keeps of an MLA layer's W_UK_T / W_UV. Its
  query stage (cutedsl/dsa/query_stage.py) and prefetch (runtime/prefetch.py) hold references to
  the layer's tensors (`layer.W_UK_T`, `layer.W_UV`); under DCP its prepared core
  (cutedsl/dsa/prepared.py) takes `dcp.value_weights(layer.W_UV)` (cutedsl/mla/dcp.py), a copy of
  every DCP rank's W_UV gathered once at build; `SpecializedDecode.process_weights_after_loading`
  (runtime/decode.py) re-derives only its MoE and KDA copies ("MLA reads the backbone's tensors").

The quantized kv_b_proj is compressed-tensors channel FP8 (mla-convert's channel-fp8 output):
float8_e4m3fn codes and a per-row float32 scale, whose method vLLM's `get_and_maybe_dequant_weights`
dequantizes through its generic path (the identity pushed through `apply`).
"""

from __future__ import annotations

import torch
import vllm_upstream
from torch import nn

from .mla import MultiHeadLatentAttentionWrapper


class ChannelFp8LinearMethod(vllm_upstream.QuantizeMethodBase):
    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, **extra_weight_attrs):  # fmt: skip
        rows = sum(output_partition_sizes)
        loader = extra_weight_attrs["weight_loader"]
        weight = nn.Parameter(torch.empty(rows, input_size_per_partition, dtype=torch.float8_e4m3fn),
                              requires_grad=False)  # fmt: skip
        scale = nn.Parameter(torch.empty(rows, 1, dtype=torch.float32), requires_grad=False)
        for p in (weight, scale):
            p.output_dim, p.weight_loader = 0, loader
        layer.register_parameter("weight", weight)
        layer.register_parameter("weight_scale", scale)

    def apply(self, layer, x, bias=None):
        w = layer.weight.float() * layer.weight_scale
        return (x.float() @ w.T).to(x.dtype)


class ChannelFp8Config:
    def get_quant_method(self, layer, prefix: str):
        return ChannelFp8LinearMethod() if isinstance(layer, vllm_upstream.LinearBase) else None


class KimiK3DSAAttention(nn.Module):
    def __init__(self, *, num_heads: int, qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int,
                 kv_lora_rank: int, quant_config=None, prefix: str = "", vllm_config=None):  # fmt: skip
        super().__init__()
        self.kv_b_proj = vllm_upstream.ColumnParallelLinear(
            kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), quant_config=quant_config,
            prefix=f"{prefix}.kv_b_proj",
        )  # fmt: skip
        self.mla_attn = MultiHeadLatentAttentionWrapper(
            7168, num_heads, (qk_nope_head_dim + qk_rope_head_dim) ** -0.5, qk_nope_head_dim, qk_rope_head_dim,
            v_head_dim, 1536, kv_lora_rank, self.kv_b_proj, None, quant_config, prefix, is_sparse=True,
            vllm_config=vllm_config,
        )  # fmt: skip
        self._packed = None

    def pack_projections(self) -> None:
        return None  # the fused path needs the fp8_ds_mla cache and an unquantized q_b_proj


class MultiHeadLatentAttention(nn.Module, vllm_upstream.AttentionLayerBase):
    def __init__(self, *, num_heads: int, qk_nope_head_dim: int, v_head_dim: int, kv_lora_rank: int,
                 quant_config=None, prefix: str = "", vllm_config=None):  # fmt: skip
        super().__init__()
        self.num_local_heads, self.qk_nope_head_dim, self.v_head_dim = num_heads, qk_nope_head_dim, v_head_dim
        self.kv_lora_rank = kv_lora_rank
        self.act_dtype = torch.get_default_dtype()
        self.layer_name, self.quant_config = prefix, quant_config
        self.kv_b_proj = vllm_upstream.ColumnParallelLinear(
            kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), quant_config=quant_config,
            prefix=f"{prefix}.kv_b_proj",
        )  # fmt: skip
        vllm_upstream.set_default_quant_scales(self, register_buffer=True)
        ctx = vllm_config.compilation_config.static_forward_context
        if prefix in ctx:
            raise ValueError(f"Duplicate layer name: {prefix}")
        ctx[prefix] = self

    def process_weights_after_loading(self) -> None:
        from .mla_attention import split_kv_b_proj
        from .utils import is_weights_pre_processed, replace_parameter

        if not (is_weights_pre_processed() and getattr(self, "W_UV", None) is not None):
            W_UK, W_UV = split_kv_b_proj(self.kv_b_proj, self.act_dtype, self.kv_lora_rank, self.num_local_heads,
                                         self.qk_nope_head_dim, self.v_head_dim)  # fmt: skip
            replace_parameter(self, "W_UV", W_UV.transpose(0, 1))
            replace_parameter(self, "W_UK_T", W_UK.permute(1, 2, 0))
        vllm_upstream.set_default_quant_scales(self, register_buffer=False)


class SpecializedDecode:
    """What the specialized decode holds of each DSA layer's MLAAttention: references to W_UK_T / W_UV
    (query stage, prefetch) and, under DCP, the gathered copy of W_UV taken at build."""

    def __init__(self, model: nn.Module, dcp_group=None):
        self.attentions = [m.mla_attn.mla_attn for m in model.modules() if isinstance(m, KimiK3DSAAttention)]
        self.query_weights = {a.layer_name: (a.W_UK_T, a.W_UV) for a in self.attentions}
        self.uv_gathered = {
            a.layer_name: dcp_group.all_gather(a.W_UV.contiguous(), dim=0) if dcp_group is not None else None
            for a in self.attentions
        }

    def process_weights_after_loading(self) -> None:
        return None  # re-derives its MoE and KDA copies; MLA reads the backbone's tensors


class KimiK3ForCausalLM(nn.Module):
    def __init__(self, layers: nn.ModuleList, specialized_decode: bool):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = layers
        self.specialized_decode_config = {"decode_backend": "latency_specialized"} if specialized_decode else None
        self.specialized_decode: SpecializedDecode | None = None

    def build_specialized_decode(self, dcp_group=None) -> None:
        self.specialized_decode = SpecializedDecode(self.model, dcp_group)

    def process_weights_after_loading(self) -> None:
        if self.specialized_decode_config is None:
            for module in self.model.modules():
                if isinstance(module, KimiK3DSAAttention):
                    module.pack_projections()
        if self.specialized_decode is not None:
            self.specialized_decode.process_weights_after_loading()
