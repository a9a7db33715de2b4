"""How a synthetic checkpoint lays its files out, by CheckpointSpec.layout (the members' real files,
shared/reference/model-family.md):

- DEEPSEEK: config.json and DeepSeek-V3's names;
- KIMI_K25 (Kimi-K2.5 / K2.6): config.json of KimiK25ForConditionalGeneration with the text model in
  text_config (K2.6: quantization_config only there), text tensors behind `language_model.`, a
  vision tower and projector;
- MISTRAL (Mistral-Large-3): params.json in Mistral's keys (no config.json), Mistral's tensor names,
  consolidated shards and index, tekken.json, a vision encoder.

Names are written out here from the reference notes, apart from source.naming's tables, so that the
converter's mapping is tested against a second reading of them.
"""

from __future__ import annotations

from mla_convert.constants import CONFIG_NAME, INDEX_NAME, MISTRAL_INDEX_NAME, MISTRAL_PARAMS_NAME
from mla_convert.demo.specs import KIMI_K25, MISTRAL, CheckpointSpec

# Mistral-Large-3's name of each DeepSeek-V3 module (model-family.md's name map).
_MISTRAL_TOP = {"model.embed_tokens": "tok_embeddings", "lm_head": "output", "model.norm": "norm"}
_MISTRAL_LAYER = {
    "input_layernorm": "attention_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_a_proj": "attention.wq_a", "self_attn.q_a_layernorm": "attention.q_a_norm",
    "self_attn.q_b_proj": "attention.wq_b", "self_attn.kv_a_proj_with_mqa": "attention.wkv_a_with_mqa",
    "self_attn.kv_a_layernorm": "attention.kv_a_norm", "self_attn.kv_b_proj": "attention.wkv_b",
    "self_attn.o_proj": "attention.wo", "mlp.gate": "gate",
}  # fmt: skip
_MISTRAL_W = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}


def native_name(spec: CheckpointSpec, name: str) -> str:
    """The checkpoint's own name of a tensor spec.tensors() names in DeepSeek-V3's names."""
    if spec.layout == KIMI_K25:
        return "language_model." + name
    if spec.layout != MISTRAL:
        return name
    module, suffix = name.rsplit(".", 1)
    if module in _MISTRAL_TOP:
        return f"{_MISTRAL_TOP[module]}.{suffix}"
    _, _, layer, rest = module.split(".", 3)
    if rest in _MISTRAL_LAYER:
        return f"layers.{layer}.{_MISTRAL_LAYER[rest]}.{suffix}"
    parts = rest.split(".")  # mlp.[experts.E. | shared_experts.]gate_proj, or mlp.gate_proj (dense)
    where = {"experts": f"experts.{parts[-2]}", "shared_experts": "shared_experts"}.get(parts[1], "feed_forward")
    return f"layers.{layer}.{where}.{_MISTRAL_W[parts[-1]]}.{suffix}"


def vision_tensors(spec: CheckpointSpec) -> list[tuple[str, str, tuple[int, ...]]]:
    """A small BF16 vision part, by the member's names (copied bit for bit by a conversion): 2-D
    linears, a conv patch embedding, norms."""
    if not spec.vision:
        return []
    d, h = 64, spec.hidden_size
    if spec.layout == KIMI_K25:
        v = "vision_tower.encoder.blocks.0."
        return [
            ("vision_tower.patch_embed.proj.weight", "bf16", (d, 3, 14, 14)),
            ("vision_tower.patch_embed.pos_emb.weight", "bf16", (16, 16, d)),
            (v + "norm0.weight", "norm", (d,)), (v + "wqkv.weight", "bf16", (3 * d, d)),
            (v + "wo.weight", "bf16", (d, d)), (v + "mlp.fc0.weight", "bf16", (2 * d, d)),
            ("mm_projector.pre_norm.weight", "norm", (d,)), ("mm_projector.proj.0.weight", "bf16", (h, 4 * d)),
            ("mm_projector.proj.2.weight", "bf16", (h, h)),
        ]  # fmt: skip
    v = "vision_encoder.transformer.layers.0."
    return [
        ("vision_encoder.patch_conv.weight", "bf16", (d, 3, 14, 14)),
        ("vision_encoder.ln_pre.weight", "norm", (d,)), (v + "attention.wq.weight", "bf16", (d, d)),
        (v + "attention.wo.weight", "bf16", (d, d)), (v + "feed_forward.w1.weight", "bf16", (2 * d, d)),
        ("patch_merger.merging_layer.weight", "bf16", (d, 4 * d)), ("pre_mm_projector_norm.weight", "norm", (d,)),
        ("vision_language_adapter.w_in.weight", "bf16", (h, d)), ("vision_language_adapter.w_out.weight", "bf16", (h, h)),
    ]  # fmt: skip


def index_name(spec: CheckpointSpec) -> str:
    return MISTRAL_INDEX_NAME if spec.layout == MISTRAL else INDEX_NAME


def config_file(spec: CheckpointSpec) -> tuple[str, dict]:
    """(file name, object) of the model's config, in the member's shape."""
    cfg = spec.config()
    if spec.layout == MISTRAL:
        return MISTRAL_PARAMS_NAME, _params_json(spec, cfg)
    if spec.layout != KIMI_K25:
        return CONFIG_NAME, cfg
    quant = cfg.pop("quantization_config", None)
    text = {k: v for k, v in cfg.items() if k != "auto_map"}
    wrapper = {
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
        "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config",
                     "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration"},
        "text_config": text, "torch_dtype": "bfloat16", "media_placeholder_token_id": 3,
        "vision_config": {"patch_size": 14, "init_pos_emb_height": 16, "init_pos_emb_width": 16,
                          "hidden_size": 64, "mm_hidden_size": 64, "text_hidden_size": spec.hidden_size},
    }  # fmt: skip
    if quant is not None:
        (text if spec.quant_in_text_config else wrapper)["quantization_config"] = quant
    return CONFIG_NAME, dict(sorted(wrapper.items()))


def _params_json(spec: CheckpointSpec, cfg: dict) -> dict:
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
