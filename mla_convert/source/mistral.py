"""Mistral-Large-3 in Mistral's own layout: params.json read as the text model's config in
config.json's names (what vLLM's MistralLarge3ForCausalLM builds from it), and its tensor names
mapped to DeepSeek-V3's and back (what that model's weight mapper does at load).

The directory holds `params.json` (no config.json), `consolidated.safetensors.index.json`,
`consolidated-000NN-of-000MM.safetensors` and `tekken.json`; vLLM takes a directory with
params.json and consolidated shards for this layout, before it looks for config.json.
Standard library only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from mla_convert.constants import MISTRAL_INDEX_NAME, MISTRAL_PARAMS_NAME, MISTRAL_SHARD_PREFIX
from mla_convert.source.family import MISTRAL_LARGE_3
from mla_convert.source.naming import TensorNames

# params.json's field -> config.json's (vLLM's adapt_config_dict); the MLA fields keep their names.
_TOP_FIELDS = {
    "dim": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads", "hidden_dim": "intermediate_size", "vocab_size": "vocab_size",
    "norm_eps": "rms_norm_eps", "tied_embeddings": "tie_word_embeddings", "q_lora_rank": "q_lora_rank",
    "kv_lora_rank": "kv_lora_rank", "qk_nope_head_dim": "qk_nope_head_dim",
    "qk_rope_head_dim": "qk_rope_head_dim", "v_head_dim": "v_head_dim",
}  # fmt: skip
_MOE_FIELDS = {
    "num_experts": "n_routed_experts", "expert_hidden_dim": "moe_intermediate_size",
    "first_k_dense_replace": "first_k_dense_replace", "route_every_n": "moe_layer_freq",
    "num_shared_experts": "n_shared_experts", "num_experts_per_tok": "num_experts_per_tok",
}  # fmt: skip
# config.json's field -> how params.json names it, for messages.
PARAMS_FIELD = {hf: p for p, hf in _TOP_FIELDS.items()} | {hf: f"moe.{p}" for p, hf in _MOE_FIELDS.items()}
VISION_KEYS = ("vision_encoder",)  # a params.json with one is served as PixtralForConditionalGeneration


class MistralError(ValueError):
    """A params.json that does not describe Mistral-Large-3's MLA model."""


def is_mistral_dir(root: Path) -> bool:
    """params.json next to consolidated shards (or their index): Mistral's own layout, as vLLM
    detects it (before any config.json)."""
    if not (root / MISTRAL_PARAMS_NAME).is_file():
        return False
    return (root / MISTRAL_INDEX_NAME).is_file() or any(root.glob(f"{MISTRAL_SHARD_PREFIX}*.safetensors"))


def has_vision(params: dict) -> bool:
    multimodal = params.get("multimodal")
    nested = isinstance(multimodal, dict) and multimodal.get("vision_encoder_args") is not None
    return any(params.get(k) is not None for k in VISION_KEYS) or nested


def text_config(params: dict) -> dict:
    """The text model's config in config.json's names, as vLLM builds MistralLarge3ForCausalLM
    from params.json: MLA with routed and shared experts, softmax routing (no
    e_score_correction_bias), no MTP layer. MistralError for a params.json that is not that."""
    moe = params.get("moe")
    if not params.get("qk_nope_head_dim") or not isinstance(moe, dict) or not moe.get("num_shared_experts"):
        raise MistralError(
            "a Mistral model without MLA (qk_nope_head_dim, kv_lora_rank) and shared experts "
            "(moe.num_shared_experts) is not Mistral-Large-3 (vLLM builds it as Mistral or Mixtral): "
            "not an MLA checkpoint"
        )
    if params.get("quantization") is not None:
        raise MistralError(
            f"params.json's legacy 'quantization' {params['quantization']!r} is not supported; expected a "
            "compressed-tensors quantization_config (FP8_BLOCK) or none (BF16)"
        )
    cfg = {hf: params[p] for p, hf in _TOP_FIELDS.items() if p in params}
    cfg |= {hf: moe[p] for p, hf in _MOE_FIELDS.items() if p in moe}
    return cfg | {
        "architectures": [MISTRAL_LARGE_3],
        "model_type": "deepseek_v3",
        "num_nextn_predict_layers": 0,
        "topk_method": None,
        "scoring_func": "softmax",
    }


def params_field(field: str) -> str:
    """config.json's field as params.json names it."""
    return PARAMS_FIELD.get(field, field)


# Mistral-Large-3's module names after `layers.N.`, and their DeepSeek-V3 names after
# `model.layers.N.` (what vLLM's MistralLarge3ForCausalLM.hf_to_vllm_mapper maps at load).
_MISTRAL_LAYER = {
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attention.wq_a": "self_attn.q_a_proj",
    "attention.q_a_norm": "self_attn.q_a_layernorm",
    "attention.wq_b": "self_attn.q_b_proj",
    "attention.wkv_a_with_mqa": "self_attn.kv_a_proj_with_mqa",
    "attention.kv_a_norm": "self_attn.kv_a_layernorm",
    "attention.wkv_b": "self_attn.kv_b_proj",
    "attention.wo": "self_attn.o_proj",
    "gate": "mlp.gate",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w2": "mlp.down_proj",
    "feed_forward.w3": "mlp.up_proj",
    "shared_experts.w1": "mlp.shared_experts.gate_proj",
    "shared_experts.w2": "mlp.shared_experts.down_proj",
    "shared_experts.w3": "mlp.shared_experts.up_proj",
}
_MISTRAL_TOP = {"tok_embeddings": "model.embed_tokens", "output": "lm_head", "norm": "model.norm"}
_MISTRAL_EXPERT = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_DEEPSEEK_LAYER = {v: k for k, v in _MISTRAL_LAYER.items()}
_DEEPSEEK_TOP = {v: k for k, v in _MISTRAL_TOP.items()}
_DEEPSEEK_EXPERT = {v: k for k, v in _MISTRAL_EXPERT.items()}
_MISTRAL_LAYER_RE = re.compile(r"layers\.(\d+)\.(.+)$")
_DEEPSEEK_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)$")
_MISTRAL_EXPERT_RE = re.compile(r"experts\.(\d+)\.(w[123])$")
_DEEPSEEK_EXPERT_RE = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|down_proj|up_proj)$")


@dataclass(frozen=True)
class MistralNames(TensorNames):
    """Mistral-Large-3's own names. With a vision encoder, vLLM serves the text model as the
    `language_model` of PixtralForConditionalGeneration: its modules' names then carry that prefix."""

    extra_prefixes: tuple[str, ...] = (
        "vision_encoder.", "patch_merger.", "pre_mm_projector_norm.", "vision_language_adapter.",
    )  # fmt: skip
    served_prefix: str = ""  # "language_model." for a params.json with a vision encoder

    def module_to_deepseek(self, module: str) -> str | None:
        if module in _MISTRAL_TOP:
            return _MISTRAL_TOP[module]
        m = _MISTRAL_LAYER_RE.match(module)
        if m is None or self.is_extra(module):
            return None
        layer, rest = m.groups()
        e = _MISTRAL_EXPERT_RE.match(rest)
        mapped = f"mlp.experts.{e.group(1)}.{_MISTRAL_EXPERT[e.group(2)]}" if e else _MISTRAL_LAYER.get(rest)
        return None if mapped is None else f"model.layers.{layer}.{mapped}"

    def module_from_deepseek(self, module: str) -> str:
        if module in _DEEPSEEK_TOP:
            return _DEEPSEEK_TOP[module]
        m = _DEEPSEEK_LAYER_RE.match(module)
        rest = m.group(2) if m else ""
        e = _DEEPSEEK_EXPERT_RE.match(rest)
        mapped = f"experts.{e.group(1)}.{_DEEPSEEK_EXPERT[e.group(2)]}" if e else _DEEPSEEK_LAYER.get(rest)
        if mapped is None:
            raise KeyError(f"{module!r} has no name in Mistral's layout")
        return f"layers.{m.group(1)}.{mapped}"

    def config_module(self, module: str) -> str:
        deepseek = self.module_to_deepseek(module)
        return module if deepseek is None else self.served_prefix + deepseek


def names_of(params: dict) -> MistralNames:
    return MistralNames(served_prefix="language_model." if has_vision(params) else "")
