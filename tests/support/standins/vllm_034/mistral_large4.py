"""Stand-in for the weight path of Mistral-Large-4's MLA layers in vllm 0.34.0 (tests only; see
../README.md), from the PyPI wheel's files:

- vllm/transformers_utils/configs/mistral.py: what `adapt_config_dict` does to a params.json with
  a `dsa` block (lines 14-40: MLA and a `moe` block with shared experts required; the names of
  `_remap_general_mistral_args`, lines 155-182) and `_remap_mistral_large_4_args` (lines 382-411:
  the `nope` pattern expanded by `_expand_layer_pattern`, lines 348-350, into `nope_layer_flags`;
  `kv_sharing.source_layers_str` into `kv_source_layers`, each an earlier non-sharing layer of the
  same NoPE flag). The `dsa` block's own keys (indexer, top-k) are left out;
- vllm/models/mistral/common/layer_spec.py: `MistralLayerSpec` (`use_rope`, `kv_source_layer`,
  `shares_kv`) and `get_layer_specs`, without the indexer and MoE fields;
- vllm/models/mistral/nvidia/attention.py: `_MistralMLA` (an MLAAttention subclass that does not
  override the hook) and what `MistralMLAAttention.__init__` builds for loading (lines 55-169):
  qk_nope_head_dim = qk_nope + qk_rope on a NoPE layer; no kv_a_proj_with_mqa / kv_a_layernorm on
  a KV-sharing layer, but its own kv_b_proj; kv_a_proj_with_mqa and kv_b_proj with
  `quant_config=None` (unquantized whatever the checkpoint); the MLAAttention at `{prefix}.attn`
  with `kv_sharing_target_layer_name`. q_proj, o_proj, SSMax and the indexer are left out;
- vllm/models/mistral/mistral_large4/nvidia/model.py: `MistralLarge4ForCausalLM` (no hook of its
  own: finalize_model_weights runs the layers' MLAAttention hooks and that is all) and
  `_load_weights` (lines 362-446) with the `_CHECKPOINT_NAME_MAP` entries of the modules kept here
  (lines 296-316): `mtp_*` skipped, layers beyond the configured depth skipped, every parameter
  loaded or an error. Checkpoint tensors of the modules left out are skipped.

Left out besides: the MoE and dense MLPs, norms, embeddings, the DSpark draft, and the ROCm model
(models/mistral/mistral_large4/amd/), whose opt-in specialized decode packs its own W_UK / W_UV
from kv_b_proj.weight (specialized_decode/runtime/weights.py), not from the layer's tensors.

The stand-in's MLAAttention takes the engine's config as `vllm_config` (the real one reads the
current config); `kv_a_proj_with_mqa` is a ColumnParallelLinear here (a ReplicatedLinear there:
the same unquantized weight at TP 1).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import vllm_upstream
from torch import nn

from .mla_attention import MLAAttention

_GENERAL_NAMES = {"dim": "hidden_size", "norm_eps": "rms_norm_eps", "n_kv_heads": "num_key_value_heads",
                  "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads", "hidden_dim": "intermediate_size"}  # fmt: skip


def _expand_layer_pattern(pattern: list, num_layers: int) -> list:
    assert pattern, "Per-layer patterns must not be empty."
    return (pattern * math.ceil(num_layers / len(pattern)))[:num_layers]


def adapt_config_dict(params: dict) -> dict:
    """The hf_config vLLM makes of a Mistral-Large-4 params.json (the fields the MLA layers read)."""
    config = dict(params)
    for key, new in _GENERAL_NAMES.items():
        if key in config:
            config[new] = config.pop(key)
    is_mla = bool(config.get("qk_nope_head_dim"))
    moe = config.get("moe") or {}
    assert config.get("dsa"), "not a Mistral-Large-4 params.json (no dsa block)"
    assert is_mla and (moe.get("num_shared_experts") or 0) > 0, "Mistral DSA requires MLA + MoE."
    num_layers = config["num_hidden_layers"]
    nope = config.pop("nope", None)
    config["nope_layer_flags"] = (
        _expand_layer_pattern([v == "nope" for v in nope.split(",")], num_layers) if nope else [False] * num_layers
    )
    kv_sharing = config.pop("kv_sharing", None) or {}
    assert set(kv_sharing) <= {"source_layers_str"}, f"Unsupported kv_sharing config: {kv_sharing}"
    if source_layers_str := kv_sharing.get("source_layers_str"):
        sources = [int(v) for v in source_layers_str.split(",")]
    else:
        sources = list(range(num_layers))
    assert len(sources) == num_layers
    for layer, source in enumerate(sources):
        assert source <= layer and sources[source] == source, (
            f"Layer {layer} must share KV with an earlier, non-sharing layer"
        )
        assert config["nope_layer_flags"][layer] == config["nope_layer_flags"][source]
    config["kv_source_layers"] = sources
    config.pop("dsa")
    config["model_type"], config["architectures"] = "mistral_large_4", ["MistralLarge4ForCausalLM"]
    return config


@dataclass(frozen=True)
class MistralLayerSpec:
    layer_idx: int
    use_rope: bool
    kv_source_layer: int

    @property
    def shares_kv(self) -> bool:
        return self.kv_source_layer != self.layer_idx


def get_layer_specs(config: dict) -> list[MistralLayerSpec]:
    num_layers = config["num_hidden_layers"]
    nope = config.get("nope_layer_flags") or [False] * num_layers
    kv_sources = config.get("kv_source_layers") or list(range(num_layers))
    return [MistralLayerSpec(i, not nope[i], kv_sources[i]) for i in range(num_layers)]


class _MistralMLA(MLAAttention):
    supports_pcp_dcp = True


class MistralMLAAttention(nn.Module):
    def __init__(self, vllm_config, config: dict, spec: MistralLayerSpec, prefix: str, quant_config=None):
        super().__init__()
        assert config.get("q_lora_rank") is None, "q-LoRA is not supported"
        self.spec = spec
        heads = config["num_attention_heads"]
        self.num_local_heads = heads  # TP 1
        self.kv_lora_rank = config["kv_lora_rank"]
        self.qk_rope_head_dim = config["qk_rope_head_dim"]
        self.qk_head_dim = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
        self.qk_nope_head_dim = config["qk_nope_head_dim"] if spec.use_rope else self.qk_head_dim
        self.v_head_dim = config["v_head_dim"]
        if not spec.shares_kv:
            self.kv_a_proj_with_mqa = vllm_upstream.ColumnParallelLinear(
                config["hidden_size"], self.kv_lora_rank + (self.qk_rope_head_dim if spec.use_rope else 0),
                quant_config=None, prefix=f"{prefix}.kv_a_proj_with_mqa",
            )  # fmt: skip
        self.kv_b_proj = vllm_upstream.ColumnParallelLinear(
            self.kv_lora_rank, heads * (self.qk_nope_head_dim + self.v_head_dim), quant_config=None,
            prefix=f"{prefix}.kv_b_proj",
        )  # fmt: skip
        target = None
        if spec.shares_kv:
            target = f"{prefix.rsplit('.', 2)[0]}.{spec.kv_source_layer}.self_attn.attn"
        self.attn = _MistralMLA(
            num_heads=self.num_local_heads, scale=self.qk_head_dim**-0.5, qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim, q_lora_rank=None,
            kv_lora_rank=self.kv_lora_rank, kv_b_proj=self.kv_b_proj, quant_config=quant_config,
            prefix=f"{prefix}.attn", kv_sharing_target_layer_name=target, vllm_config=vllm_config,
        )  # fmt: skip


class MistralLarge4DecoderLayer(nn.Module):
    def __init__(self, vllm_config, config: dict, spec: MistralLayerSpec, prefix: str, quant_config=None):
        super().__init__()
        self.self_attn = MistralMLAAttention(vllm_config, config, spec, f"{prefix}.self_attn", quant_config)


_CHECKPOINT_NAME_MAP = [
    (r"^layers\.", "model.layers."),
    (r"\.attention\.wkv_a_with_mqa(?=\.|$)", ".self_attn.kv_a_proj_with_mqa"),
    (r"\.attention\.wkv_b(?=\.|$)", ".self_attn.kv_b_proj"),
]


def _to_vllm_weight_name(name: str) -> str:
    for pattern, repl in _CHECKPOINT_NAME_MAP:
        name = re.sub(pattern, repl, name)
    return name


class MistralLarge4ForCausalLM(nn.Module):
    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.model = nn.Module()
        self.model.layer_specs = get_layer_specs(config)
        quant_config = getattr(vllm_config, "quant_config", None)
        self.model.layers = nn.ModuleList(
            MistralLarge4DecoderLayer(vllm_config, config, spec, f"model.layers.{spec.layer_idx}", quant_config)
            for spec in self.model.layer_specs
        )

    def load_weights(self, weights) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for ckpt_name, weight in weights:
            if ckpt_name.startswith("mtp_"):
                continue
            layer = re.match(r"layers\.(\d+)\.", ckpt_name)
            if layer is not None and int(layer.group(1)) >= self.config["num_hidden_layers"]:
                continue
            name = _to_vllm_weight_name(ckpt_name)
            if name not in params:
                continue  # a module this stand-in leaves out
            param = params[name]
            param.weight_loader(param, weight)
            loaded.add(name)
        if missing := sorted(set(params) - loaded):
            raise ValueError(f"Parameters not loaded from the checkpoint: {missing}")
        return loaded
