"""What the runtime reads of a served model's config, for every way a family member describes its
model: the one module of the runtime that knows the members' config shapes. Standard library only.

- config.json, flat (DeepSeek-V3 style), or with the text model nested in `text_config` (a
  multimodal wrapper: Kimi-K2.5's KimiK25ForConditionalGeneration);
- params.json, in Mistral's own names (Mistral-Large-3 and -4, served without a config.json);
- Mistral-Large-4's per-layer attention, selected by a `dsa` block in params.json, read as vLLM
  0.34.0 reads it (transformers_utils/configs/mistral.py, `_remap_mistral_large_4_args` and
  `_expand_layer_pattern`; models/mistral/common/layer_spec.py; models/mistral/nvidia/attention.py,
  `MistralMLAAttention.__init__`): the top-level `nope` pattern ("rope,nope,...", tiled over the
  layers) marks NoPE layers, whose qk_nope_head_dim is qk_nope_head_dim + qk_rope_head_dim (the
  rope dims spent on nope); `kv_sharing.source_layers_str` (one integer per layer) names the layer
  whose latent cache a layer reads, and a KV-sharing layer still has its own kv_b_proj, so its own
  W_UK_T / W_UV at its own NoPE flag's dims. A config vLLM has adapted already (`hf_config.to_dict()`
  of a model served by Hub id) holds the same facts as `nope_layer_flags` / `kv_source_layers`.

Errors are ValueError / KeyError / TypeError naming the field; the callers word them for the user.
"""

from __future__ import annotations

import math

PARAMS_CONFIG_NAME = "params.json"  # a model in Mistral's own layout, served without config.json

# params.json's names of the fields the runtime reads (it keeps the MLA names themselves:
# kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim).
_PARAMS_NAMES = {"n_heads": "num_attention_heads", "n_layers": "num_hidden_layers"}

# The MLA dims the artifacts are checked against, and the config.json field of each.
MLA_FIELDS = {
    "num_heads": "num_attention_heads",
    "qk_nope_head_dim": "qk_nope_head_dim",
    "v_head_dim": "v_head_dim",
    "kv_lora_rank": "kv_lora_rank",
}


def text_model_config(config: dict) -> dict:
    """The text model's config, in config.json's names: `config` itself, the `text_config` a
    multimodal wrapper nests it in, or a params.json with the fields the runtime reads renamed."""
    if not isinstance(config, dict):
        raise TypeError(f"the config must be a JSON object, got {type(config).__name__}")
    if "num_attention_heads" in config:
        return config
    nested = config.get("text_config")
    if isinstance(nested, dict) and "num_attention_heads" in nested:
        return nested
    if "n_heads" in config:
        return config | {hf: config[m] for m, hf in _PARAMS_NAMES.items() if m in config}
    return config


def integer(config: dict, name: str, least: int = 1, label: str | None = None) -> int:
    """`config[name]`, an integer of at least `least` (not a bool, a float or a string that would
    convert); KeyError or TypeError / ValueError naming the field (`label`: its name as the file spells it)."""
    value = config[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{label or name} must be an integer, got {value!r}")
    if value < least:
        raise ValueError(f"{label or name} must be at least {least}, got {value}")
    return value


def _field_label(config: dict, name: str) -> str:
    """How `config` spells a field the runtime reads by its config.json name (params.json's own)."""
    if _is_params_json(config):
        return {hf: m for m, hf in _PARAMS_NAMES.items()}.get(name, name)
    if "num_attention_heads" not in config and isinstance(config.get("text_config"), dict):
        return f"text_config.{name}"
    return name


def mla_fields(config: dict) -> dict[str, int]:
    """The model's MLA dims (MlaDims' fields), as its RoPE layers have them; KeyError when one is missing."""
    text = text_model_config(config)
    return {ours: integer(text, theirs, label=_field_label(config, theirs)) for ours, theirs in MLA_FIELDS.items()}


def layer_count(config: dict) -> int:
    """Decoder layers the model serves (a drafter's MTP layers are not among them)."""
    name = "num_hidden_layers"
    return integer(text_model_config(config), name, label=_field_label(config, name))


def tile(pattern: list, count: int) -> list:
    """A per-layer pattern repeated over `count` layers (vLLM's `_expand_layer_pattern`)."""
    return (pattern * math.ceil(count / len(pattern)))[:count]


def _is_params_json(config: dict) -> bool:
    return "num_attention_heads" not in config and "n_heads" in config


def nope_layers(config: dict) -> list[bool]:
    """Per decoder layer, whether it is a NoPE layer (all False but for a per-layer config)."""
    count = layer_count(config)
    text = text_model_config(config)
    flags = text.get("nope_layer_flags")  # as vLLM adapted it
    if flags is not None:
        if not isinstance(flags, list):
            raise TypeError(f"nope_layer_flags must be a list, got {flags!r}")
        flags = [bool(f) for f in flags]
        if len(flags) != count:
            raise ValueError(f"nope_layer_flags has {len(flags)} entries for {count} layers")
        return flags
    pattern = text.get("nope") if _is_params_json(config) and text.get("dsa") else None
    if not pattern:
        return [False] * count
    if not isinstance(pattern, str):
        raise ValueError(f"nope must be a comma-separated pattern, got {pattern!r}")
    return tile([v == "nope" for v in pattern.split(",")], count)  # as vLLM: any other word is a RoPE layer


def kv_sources(config: dict) -> list[int]:
    """Per decoder layer, the layer whose latent KV cache it reads (itself unless it shares one);
    ValueError for what vLLM refuses (a source that is later, itself sharing, or of the other kind)."""
    count = layer_count(config)
    text = text_model_config(config)
    params = _is_params_json(config)
    field, layers_field = (
        ("kv_sharing.source_layers_str", "n_layers") if params else ("kv_source_layers", "num_hidden_layers")
    )
    sources = text.get("kv_source_layers")
    if sources is None and params and text.get("dsa"):
        spelt = None
        try:
            spelt = (text.get("kv_sharing") or {}).get("source_layers_str")
            sources = [int(v) for v in spelt.split(",")] if spelt else None
        except (AttributeError, ValueError) as e:
            raise ValueError(f"{field} {spelt!r} must be comma-separated integers") from e
    if sources is None:
        return list(range(count))
    if not isinstance(sources, list) or any(isinstance(s, bool) or not isinstance(s, int) for s in sources):
        raise TypeError(f"{field} must be a list of integers, got {sources!r}")
    if len(sources) != count:
        raise ValueError(f"{field} names {len(sources)} source layers for {layers_field} {count}")
    nope = nope_layers(config)
    for layer, source in enumerate(sources):
        if not 0 <= source <= layer:
            where = "a later one" if source > layer else "which does not exist"
            raise ValueError(f"layer {layer} shares the KV cache of layer {source}, {where}")
        if sources[source] != source:
            raise ValueError(
                f"layer {layer} shares the KV cache of layer {source}, which itself shares layer {sources[source]}'s"
            )
        if nope[layer] != nope[source]:
            raise ValueError(f"layer {layer} shares the KV cache of layer {source}, of the other NoPE kind")
    return sources


def layer_fields(config: dict) -> dict[int, dict[str, int]]:
    """{decoder layer: its MLA dims that differ from the model's}; empty where every layer has the
    model's (every member but one with NoPE layers)."""
    nope = nope_layers(config)
    if not any(nope):
        return {}
    text = text_model_config(config)
    widened = sum(integer(text, name, 0) for name in ("qk_nope_head_dim", "qk_rope_head_dim"))
    return {i: {"qk_nope_head_dim": widened} for i, flag in enumerate(nope) if flag}
