"""Mistral-Large-3 in Mistral's own layout: params.json read as the text model's config in
config.json's names (what vLLM's MistralLarge3ForCausalLM builds from it), and its tensor names
mapped to DeepSeek-V3's and back (what that model's weight mapper does at load).

The directory holds `params.json` (no config.json), `consolidated.safetensors.index.json`,
`consolidated-000NN-of-000MM.safetensors` and `tekken.json`; vLLM takes a directory with
params.json and consolidated shards for this layout, before it looks for config.json. A later
member in the same layout imports its facts from here. Standard library only.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from mla_convert.constants import (
    CONSOLIDATED_INDEX_NAME,
    CONSOLIDATED_SHARD_PREFIX,
    CONSOLIDATED_SINGLE_FILE_NAME,
    PARAMS_JSON_NAME,
)
from mla_convert.errors import SourceError
from mla_convert.source.members.member import DemoLayout, Member, SupportedCheckpoint
from mla_convert.source.model_config import QUANT_KEY, ModelConfig, read_json_object
from mla_convert.source.naming import TensorNames

_ARCH = "MistralLarge3ForCausalLM"  # what vLLM builds from a Mistral-native params.json

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
    if not (root / PARAMS_JSON_NAME).is_file():
        return False
    return (root / CONSOLIDATED_INDEX_NAME).is_file() or any(root.glob(f"{CONSOLIDATED_SHARD_PREFIX}*.safetensors"))


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
        "architectures": [_ARCH],
        "model_type": "deepseek_v3",
        "num_nextn_predict_layers": 0,
        "topk_method": None,
        "scoring_func": "softmax",
    }


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


def read_layout(root: Path) -> ModelConfig:
    """The model description of a directory in Mistral's layout; SourceError."""
    path = root / PARAMS_JSON_NAME
    params, raw_bytes = read_json_object(path, PARAMS_JSON_NAME)
    try:
        text = text_config(params)
    except MistralError as e:
        raise SourceError(f"{path}: {e}") from e
    if text.get("q_lora_rank") is None:  # its names have wq_a / wq_b only (Large 4, with `dsa`, has wq)
        raise SourceError(
            f"{path}: q_lora_rank is {params.get('q_lora_rank')!r}; Mistral-Large-3's attention has a q LoRA "
            "(attention.wq_a, attention.wq_b), and a plain attention.wq needs the `dsa` block of Mistral-Large-4"
        )
    return ModelConfig(
        PARAMS_JSON_NAME, params, raw_bytes, text, names_of(params), text["architectures"][0],
        quant_at=(None,) if QUANT_KEY in params else (), index_name=CONSOLIDATED_INDEX_NAME,
        single_file_name=CONSOLIDATED_SINGLE_FILE_NAME, field_label=PARAMS_FIELD, vision=has_vision(params),
    )  # fmt: skip


# --- the demo's tiny checkpoint in this layout ----------------------------------------------------
# Names written out again from the reference notes (model-family.md's name map), apart from the
# tables above, so that the converter's mapping is tested against a second reading of them.

# Mistral-Large-3's name of each DeepSeek-V3 module (model-family.md's name map).
_DEMO_TOP = {"model.embed_tokens": "tok_embeddings", "lm_head": "output", "model.norm": "norm"}
_DEMO_LAYER = {
    "input_layernorm": "attention_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_a_proj": "attention.wq_a", "self_attn.q_a_layernorm": "attention.q_a_norm",
    "self_attn.q_b_proj": "attention.wq_b", "self_attn.kv_a_proj_with_mqa": "attention.wkv_a_with_mqa",
    "self_attn.kv_a_layernorm": "attention.kv_a_norm", "self_attn.kv_b_proj": "attention.wkv_b",
    "self_attn.o_proj": "attention.wo", "mlp.gate": "gate",
}  # fmt: skip
_DEMO_W = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}


def _demo_native_name(spec, name: str) -> str:
    """The checkpoint's own name of a tensor the demo names in DeepSeek-V3's names."""
    module, suffix = name.rsplit(".", 1)
    if module in _DEMO_TOP:
        return f"{_DEMO_TOP[module]}.{suffix}"
    _, _, layer, rest = module.split(".", 3)
    if rest in _DEMO_LAYER:
        return f"layers.{layer}.{_DEMO_LAYER[rest]}.{suffix}"
    parts = rest.split(".")  # mlp.[experts.E. | shared_experts.]gate_proj, or mlp.gate_proj (dense)
    where = {"experts": f"experts.{parts[-2]}", "shared_experts": "shared_experts"}.get(parts[1], "feed_forward")
    return f"layers.{layer}.{where}.{_DEMO_W[parts[-1]]}.{suffix}"


def _demo_vision_tensors(spec) -> list[tuple[str, str, tuple[int, ...]]]:
    """A small BF16 vision encoder: 2-D linears, a conv patch embedding, norms."""
    d, h, v = 64, spec.hidden_size, "vision_encoder.transformer.layers.0."
    return [
        ("vision_encoder.patch_conv.weight", "bf16", (d, 3, 14, 14)),
        ("vision_encoder.ln_pre.weight", "norm", (d,)), (v + "attention.wq.weight", "bf16", (d, d)),
        (v + "attention.wo.weight", "bf16", (d, d)), (v + "feed_forward.w1.weight", "bf16", (2 * d, d)),
        ("patch_merger.merging_layer.weight", "bf16", (d, 4 * d)), ("pre_mm_projector_norm.weight", "norm", (d,)),
        ("vision_language_adapter.w_in.weight", "bf16", (h, d)), ("vision_language_adapter.w_out.weight", "bf16", (h, h)),
    ]  # fmt: skip


def _demo_side_files(spec) -> dict[str, str]:
    """tekken.json, Mistral's tokenizer, in its shape (config, vocab, special tokens); a tiny one."""
    specials = [{"rank": i, "token_str": t, "is_control": True} for i, t in enumerate(["<unk>", "<s>", "</s>"])]
    vocab = [{"rank": i, "token_bytes": "", "token_str": f"w{i}"} for i in range(spec.vocab_size - len(specials))]
    tekken = {
        "config": {"pattern": r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+", "num_vocab_tokens": len(vocab),
                   "default_vocab_size": spec.vocab_size, "default_num_special_tokens": len(specials),
                   "version": "v7"},
        "vocab": vocab, "special_tokens": specials,
    }  # fmt: skip
    return {"tekken.json": json.dumps(tekken) + "\n"}


def _demo_params_json(spec, cfg: dict) -> dict:
    """Mistral-Large-3's params.json at the spec's dims (its real keys, model-family.md)."""
    params = {
        "dim": spec.hidden_size, "n_layers": spec.num_hidden_layers, "head_dim": spec.qk_nope_head_dim + spec.qk_rope_head_dim,
        "hidden_dim": spec.intermediate_size, "n_heads": spec.num_attention_heads, "n_kv_heads": spec.num_attention_heads,
        "norm_eps": 1e-06, "vocab_size": spec.vocab_size, "rope_theta": 10000.0, "max_position_embeddings": 4096,
        "q_lora_rank": spec.q_lora_rank, "kv_lora_rank": spec.kv_lora_rank, "qk_nope_head_dim": spec.qk_nope_head_dim,
        "qk_rope_head_dim": spec.qk_rope_head_dim, "v_head_dim": spec.v_head_dim, "tied_embeddings": False,
        "moe": {"expert_hidden_dim": spec.moe_intermediate_size, "expert_model_parallel": 1, "expert_parallel": 1,
                "first_k_dense_replace": spec.first_k_dense_replace, "num_expert_groups": 1,
                "num_expert_groups_per_tok": 1, "num_experts": spec.n_routed_experts,
                "num_experts_per_tok": spec.num_experts_per_tok, "num_shared_experts": spec.n_shared_experts,
                "route_every_n": 1, "routed_scale": 1.0},
        "llama_4_scaling": {"beta": 0.1, "original_max_position_embeddings": 8192},
        "yarn": {"alpha": 1, "apply_scale": False, "beta": 32, "factor": 4, "original_max_position_embeddings": 1024},
    }  # fmt: skip
    if spec.vision:
        params["vision_encoder"] = {
            "hidden_size": 64, "num_channels": 3, "image_size": 224, "patch_size": 14, "num_hidden_layers": 1,
            "num_attention_heads": 2, "intermediate_size": 128, "rope_theta": 10000.0, "adapter_bias": False,
            "spatial_merge_size": 2, "image_token_id": 10, "image_break_token_id": 12, "image_end_token_id": 13,
        }  # fmt: skip
    if "quantization_config" in cfg:
        params["quantization_config"] = cfg["quantization_config"]
    return params


LAYOUT = "mistral"  # the demo's CheckpointSpec.layout
_DEMO = dict(
    architecture=_ARCH, model_type="deepseek_v3", layout=LAYOUT, num_nextn_predict_layers=0,
    topk_method="softmax", n_group=1, topk_group=1, auto_map=(), remote_code=(), vision=True,
    shard_name="consolidated-{i:05d}-of-{n:05d}.safetensors",
)  # fmt: skip
_CT_IGNORE = ("model.embed_tokens", "re:patch_merger.*", "re:vision_encoder.*", "re:vision_language_adapter.*",
              "re:.*kv_a_proj_with_mqa$", "re:.*q_a_proj$", "re:.*gate$", "lm_head")  # fmt: skip

MEMBER = Member(
    name="mistral-large-3",
    rank=7,
    architecture=_ARCH,
    short="Mistral-Large-3",
    help_who="Mistral-Large-3 in Mistral's own layout (params.json, consolidated shards; no config.json)",
    help_what="compressed-tensors FP8_BLOCK (BF16 or F32 scales) or BF16; output in the same layout and names; "
    "wq_a, wkv_a_with_mqa, the router and the vision encoder stay BF16",
    kept_16bit=r"self_attn\.(q_a_proj|kv_a_proj_with_mqa)$",
    own_layout=is_mistral_dir,
    read_own_layout=read_layout,
    config_file=PARAMS_JSON_NAME,
    index_file=CONSOLIDATED_INDEX_NAME,
    layout_help="Mistral-Large-3 in Mistral's own layout (params.json and consolidated shards, no config.json)",
    nvfp4_release="Mistral-Large-3's NVFP4 release",
    supported=(
        SupportedCheckpoint(
            "Mistral-Large-3 (Instruct, Base, BF16)",
            "Mistral's own layout: `params.json`, `consolidated-*.safetensors`, `tekken.json`",
            "compressed-tensors FP8_BLOCK (BF16 or F32 scales), or BF16",
            "the same layout out: Mistral tensor names, `params.json` and the consolidated index rewritten, no "
            "`config.json`; the `quantization_config`'s `ignore` in HF module names, as vLLM matches them; no MTP "
            "layer, no `e_score_correction_bias`",
            ("mistral-large-3", "mistral-large-3-bf16"),
        ),
    ),
    demos={
        # Mistral-Large-3-675B-Instruct-2512: FP8_BLOCK with BF16 scales, a vision encoder, softmax
        # routing (no e_score_correction_bias), no MTP layer.
        "mistral-large-3": _DEMO
        | dict(
            weights="ct-fp8-block",
            scale_dtype="bf16",
            split_scale_of="model.layers.1.mlp.experts.3.down_proj.weight",
            quant_ignore=_CT_IGNORE,
        ),
        # Its BF16 release: the same names and files, no quantization.
        "mistral-large-3-bf16": _DEMO | dict(weights="bf16"),
    },
    demo_layout=DemoLayout(
        LAYOUT,
        native_name=_demo_native_name,
        config_file=lambda spec, cfg: (PARAMS_JSON_NAME, _demo_params_json(spec, cfg)),
        vision_tensors=_demo_vision_tensors,
        index_name=CONSOLIDATED_INDEX_NAME,
        side_files=_demo_side_files,
    ),
)
