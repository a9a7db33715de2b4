"""Mistral-Large-4 in Mistral's own layout (Mistral-Large-3's: params.json, consolidated shards,
tekken.json; its facts imported from mistral_large_3): a params.json with a `dsa` block, read as
vLLM 0.34.0 reads it (transformers_utils/configs/mistral.py: `adapt_config_dict`,
`_remap_mistral_large_4_args`; models/mistral/common/layer_spec.py; models/mistral/nvidia/
attention.py, indexer.py, moe.py; mistral_large4/nvidia/model.py's `_CHECKPOINT_NAME_MAP`).

Layer kinds: NoPE layers (the `nope` pattern tiled; qk_nope_head_dim + qk_rope_head_dim spent on
nope, no rope part in wkv_a_with_mqa), KV-sharing layers (`kv_sharing.source_layers_str`: no
wkv_a_with_mqa / kv_a_norm, their own wkv_b), indexer layers (`dsa.sharing`: "full" ones hold
one), per-head `ssmax_scaling`; the DSpark draft (`mtp_dspark.*`) is copied as it is. vLLM builds
kv_b_proj, kv_a_proj_with_mqa and the indexer's wk / weights_proj unquantized whatever the
config says: they stay 16-bit. Standard library only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mla_convert.constants import CONSOLIDATED_INDEX_NAME, CONSOLIDATED_SINGLE_FILE_NAME, PARAMS_JSON_NAME
from mla_convert.errors import SourceError
from mla_convert.source.family import OTHER
from mla_convert.source.members import mistral_large_3 as large3
from mla_convert.source.members.member import DemoLayout, Member, SupportedCheckpoint
from mla_convert.source.model_config import QUANT_KEY, ModelConfig, read_json_object
from mla_runtime import model_configs

_ARCH = "MistralLarge4ForCausalLM"  # what vLLM 0.34 builds from a params.json with a `dsa` block
DRAFT_PREFIX = "mtp_dspark."  # the DSpark draft: loaded by its own model, BF16, copied as it is

# `dsa`'s unprefixed keys -> the prefixed spelling of earlier checkpoints (vLLM's _DSA_KEY_ALIASES).
_DSA_ALIASES = {
    "topk": "index_topk", "n_heads": "index_n_heads", "head_dim": "index_head_dim",
    "rope_head_dim": "index_rope_head_dim", "nope": "index_nope", "match_nope": "indexer_match_nope",
    "ssmax_scaling": "indexer_ssmax_scaling", "norm_eps": "indexer_norm_eps", "sharing": "index_sharing",
}  # fmt: skip
_DSA_REQUIRED = ("index_topk", "index_n_heads", "index_head_dim", "indexer_norm_eps", "indexer_ssmax_scaling")
_DSA_OPTIONAL = ("index_rope_head_dim", "index_nope", "indexer_match_nope", "fp8_indexer", "fp8_kv_cache",
                 "index_sharing")  # fmt: skip


class Large4Error(large3.MistralError):
    """A params.json with a `dsa` block that vLLM 0.34 refuses to build as Mistral-Large-4."""


def is_large4_dir(root: Path) -> bool:
    """Mistral's own layout with a params.json holding a `dsa` block (which selects Large 4)."""
    if not large3.is_mistral_dir(root):
        return False
    try:
        params = json.loads((root / PARAMS_JSON_NAME).read_bytes())
    except (OSError, ValueError):
        return False  # Mistral-Large-3's reading names the problem
    return isinstance(params, dict) and bool(params.get("dsa"))


def _dsa(params: dict) -> dict:
    """The `dsa` block in its prefixed keys, every key checked as vLLM checks it."""
    dsa = params["dsa"]
    if not isinstance(dsa, dict):
        raise Large4Error(f"dsa must be an object, got {dsa!r}")
    out = {k: v for k, v in dsa.items() if k not in _DSA_ALIASES}
    for key, prefixed in _DSA_ALIASES.items():
        if key in dsa:
            if prefixed in out and out[prefixed] != dsa[key]:
                raise Large4Error(f"dsa has {key}={dsa[key]!r} and {prefixed}={out[prefixed]!r}, which conflict")
            out[prefixed] = dsa[key]
    unknown = sorted(set(out) - set(_DSA_REQUIRED) - set(_DSA_OPTIONAL))
    if unknown:
        raise Large4Error(f"dsa has keys vLLM 0.34 does not read ({', '.join(unknown)}); it refuses such a config")
    missing = [k for k in _DSA_REQUIRED if out.get(k) is None]  # null is no value of any of them
    if missing:
        raise Large4Error(f"dsa lacks {', '.join(missing)}; vLLM 0.34 needs each of them (ssmax_scaling too)")
    if out.get("index_rope_head_dim") not in (None, -1, params.get("qk_rope_head_dim")):
        raise Large4Error(
            f"dsa.rope_head_dim {out['index_rope_head_dim']} differs from qk_rope_head_dim "
            f"{params.get('qk_rope_head_dim')}; vLLM 0.34 supports only the model's"
        )
    if out.get("index_nope"):
        raise Large4Error("dsa.nope true (an indexer without RoPE) is not supported by vLLM 0.34")
    if not out.get("fp8_indexer", True):
        raise Large4Error("dsa.fp8_indexer false: vLLM 0.34 supports only the FP8 indexer cache")
    return out


def _layer_lists(params: dict, layers: int, dsa: dict) -> tuple[list[bool], list[int], list[str]]:
    """Per layer: NoPE or not, its KV source, and its indexer ("full" or "shared")."""
    sharing = params.get("kv_sharing") or {}
    if not isinstance(sharing, dict) or set(sharing) - {"source_layers_str"}:
        raise Large4Error(f"kv_sharing {sharing!r} is not supported; vLLM 0.34 reads only source_layers_str")
    try:  # the runtime's reading, which the plugin checks the served model with
        flags, sources = model_configs.nope_layers(params), model_configs.kv_sources(params)
    except (TypeError, ValueError) as e:
        raise Large4Error(f"{e}; vLLM 0.34 refuses it") from e
    spelt = dsa.get("index_sharing")
    if spelt is not None and not isinstance(spelt, str):
        raise Large4Error(f"dsa.sharing {spelt!r} must be a comma-separated pattern of 'full' / 'shared'")
    indexers = model_configs.tile(spelt.split(","), layers) if spelt else ["full"] * layers
    if set(indexers) - {"full", "shared"} or indexers[0] != "full":
        raise Large4Error(f"dsa.sharing {spelt!r} must tile 'full' / 'shared' with layer 0 full, as vLLM 0.34 needs")
    return flags, sources, indexers


def text_config(params: dict) -> dict:
    """The text model's config in config.json's names, as vLLM 0.34 builds MistralLarge4ForCausalLM
    from params.json, with the per-layer lists vLLM derives (nope_layer_flags, kv_source_layers,
    indexer_types). Large4Error for what vLLM refuses."""
    moe = params.get("moe")
    if not params.get("qk_nope_head_dim") or not isinstance(moe, dict) or not moe.get("num_shared_experts"):
        raise Large4Error("Mistral DSA requires MLA (qk_nope_head_dim) and a moe block with shared experts")
    if params.get("q_lora_rank") is not None:
        raise Large4Error(f"q_lora_rank {params['q_lora_rank']!r}: vLLM 0.34 builds wq as a plain q_proj (null)")
    if (moe.get("num_expert_groups") or 1) != 1:
        raise Large4Error(f"moe.num_expert_groups {moe['num_expert_groups']}: grouped top-k is not supported")
    dsa = _dsa(params)
    for name, value in (("ssmax_scaling", params.get("ssmax_scaling")), ("lerope", params.get("lerope")),
                        ("dsa.ssmax_scaling", dsa["indexer_ssmax_scaling"])):  # fmt: skip
        if value is not None and not isinstance(value, bool):
            raise Large4Error(f"{name} {value!r} must be a boolean")
    cfg = large3.text_config(params)
    layers = cfg.get("num_hidden_layers")
    if not isinstance(layers, int) or layers < 1:
        raise Large4Error(f"n_layers {layers!r} must be a positive integer")
    flags, sources, indexers = _layer_lists(params, layers, dsa)
    return cfg | {
        "architectures": [_ARCH],
        "model_type": "mistral_large_4",
        "index_n_heads": dsa["index_n_heads"],
        "index_head_dim": dsa["index_head_dim"],
        "index_topk": dsa["index_topk"],
        "indexer_types": indexers,
        "indexer_ssmax_scaling": bool(dsa["indexer_ssmax_scaling"]),
        "ssmax_scaling": bool(params.get("ssmax_scaling")),
        "lerope": bool(params.get("lerope")),
        "nope_layer_flags": flags,
        "kv_source_layers": sources,
    }


# Large 4's module names after `layers.N.` that Large 3 lacks, and their names in the DeepSeek-V3
# namespace (vLLM's names after `_CHECKPOINT_NAME_MAP`: ssmax_scaling becomes ssmax).
_OWN_LAYER = {
    "attention.wq": "self_attn.q_proj",
    "attention.ssmax_scaling": "self_attn.ssmax",
    "attention.indexer.ssmax_scaling": "self_attn.indexer.ssmax",
} | {
    f"attention.indexer.{m}": f"self_attn.indexer.{m}" for m in ("q_input_norm", "wq_b", "wk", "weights_proj", "k_norm")
}
_OWN_DEEPSEEK = {v: k for k, v in _OWN_LAYER.items()}
# LeRoPE's one `alpha` tensor [qk_rope_head_dim / 2] (vLLM reads `lerope.alpha` itself), named in
# the DeepSeek-V3 namespace as a top-level module of the model.
_LEROPE, _LEROPE_DEEPSEEK = "lerope", "model.lerope"


@dataclass(frozen=True)
class Large4Names(large3.MistralNames):
    """Mistral-Large-3's names, with Large 4's plain wq, SSMax and indexer modules; the DSpark
    draft is another part, copied as it is."""

    extra_prefixes: tuple[str, ...] = (*large3.MistralNames.extra_prefixes, DRAFT_PREFIX)

    def module_to_deepseek(self, module: str) -> str | None:
        if module == _LEROPE:
            return _LEROPE_DEEPSEEK
        head, _, rest = module.partition(".")
        layer, _, own = rest.partition(".")
        if head == "layers" and own in _OWN_LAYER and not self.is_extra(module):
            return f"model.layers.{layer}.{_OWN_LAYER[own]}"
        return super().module_to_deepseek(module)

    def module_from_deepseek(self, module: str) -> str:
        if module == _LEROPE_DEEPSEEK:
            return _LEROPE
        parts = module.split(".", 3)
        if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _OWN_DEEPSEEK:
            return f"layers.{parts[2]}.{_OWN_DEEPSEEK[parts[3]]}"
        return super().module_from_deepseek(module)


def _has_draft(params: dict) -> bool:
    return params.get("mtp") is not None


def read_layout(root: Path) -> ModelConfig:
    """The model description of a Mistral-Large-4 directory; SourceError naming what vLLM refuses."""
    path = root / PARAMS_JSON_NAME
    params, raw_bytes = read_json_object(path, PARAMS_JSON_NAME)
    try:
        text = text_config(params)
    except large3.MistralError as e:
        raise SourceError(f"{path}: {e}") from e
    names = Large4Names(served_prefix="language_model." if large3.has_vision(params) else "")
    return ModelConfig(
        PARAMS_JSON_NAME, params, raw_bytes, text, names, _ARCH, quant_at=(None,) if QUANT_KEY in params else (),
        index_name=CONSOLIDATED_INDEX_NAME, single_file_name=CONSOLIDATED_SINGLE_FILE_NAME,
        field_label=large3.PARAMS_FIELD
        | {"index_n_heads": "dsa.n_heads", "index_head_dim": "dsa.head_dim", "index_topk": "dsa.topk"},
        # its other parts, copied as they are: a vision encoder, the DSpark draft
        vision=large3.has_vision(params) or _has_draft(params),
    )  # fmt: skip


def _per_layer(cfg: dict, key: str, default) -> list:
    """A per-layer list vLLM derives from params.json; absent (a config without it), every layer
    the default, as vLLM's get_layer_specs reads it."""
    return cfg.get(key) or [default(i) for i in range(cfg["num_hidden_layers"])]


def layer_dims(cfg: dict, i: int) -> dict | None:
    """A NoPE layer's own dims: the rope dims spent on nope (vLLM's `qk_nope_head_dim` of that
    layer), no rope part (its wkv_a_with_mqa is kv_lora_rank rows; q stays nope + rope wide)."""
    if i < cfg["num_hidden_layers"] and _per_layer(cfg, "nope_layer_flags", lambda i: False)[i]:
        return {"qk_nope_head_dim": cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"], "qk_rope_head_dim": 0}
    return None


def layer_inventory(cfg: dict, i: int, out: dict) -> None:
    """A KV-sharing layer without wkv_a_with_mqa / kv_a_norm; SSMax per head; an indexer's input
    LayerNorm and SSMax; LeRoPE's alpha (OTHER: copied)."""
    if i == 0 and cfg.get("lerope"):
        out[_LEROPE_DEEPSEEK + ".alpha"] = ((cfg["qk_rope_head_dim"] // 2,), OTHER)
    if i >= cfg["num_hidden_layers"]:
        return
    a = f"model.layers.{i}.self_attn."
    if _per_layer(cfg, "kv_source_layers", lambda i: i)[i] != i:
        del out[a + "kv_a_proj_with_mqa.weight"], out[a + "kv_a_layernorm.weight"]
    if cfg.get("ssmax_scaling"):
        heads = cfg["num_attention_heads"]
        out[a + "ssmax.s"], out[a + "ssmax.b"] = ((heads,), OTHER), ((heads,), OTHER)
    if _per_layer(cfg, "indexer_types", lambda i: "full")[i] == "full":
        h, heads = cfg["hidden_size"], cfg["index_n_heads"]
        out[a + "indexer.q_input_norm.weight"] = out[a + "indexer.q_input_norm.bias"] = ((h,), OTHER)
        if cfg.get("indexer_ssmax_scaling"):
            out[a + "indexer.ssmax.s"] = out[a + "indexer.ssmax.b"] = ((heads,), OTHER)


def refuse(cfg: dict) -> str | None:
    """A text config whose per-layer lists do not have one entry per layer."""
    for key in ("nope_layer_flags", "kv_source_layers"):
        if cfg.get(key) is not None and (
            not isinstance(cfg[key], list) or len(cfg[key]) != cfg.get("num_hidden_layers")
        ):
            return f"{_ARCH} config's {key} must have one entry for each of its {cfg.get('num_hidden_layers')} layers"
    return None


# --- the demo's tiny checkpoint -------------------------------------------------------------------
# Names and params.json written out again from the reference notes (model-family.md,
# "Mistral-Large-4"), apart from the tables above.

_DEMO_TOP = {
    "model.embed_tokens": "tok_embeddings",
    "lm_head": "output",
    "model.norm": "norm",
    "model.lerope": "lerope",
}
_DEMO_ATTN = {
    "q_proj": "wq", "kv_a_proj_with_mqa": "wkv_a_with_mqa", "kv_a_layernorm": "kv_a_norm", "kv_b_proj": "wkv_b",
    "o_proj": "wo", "ssmax": "ssmax_scaling", "indexer.ssmax": "indexer.ssmax_scaling",
    **{f"indexer.{m}": f"indexer.{m}" for m in ("q_input_norm", "wq_b", "wk", "weights_proj", "k_norm")},
}  # fmt: skip
_DEMO_W = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}
# The AMD kernels' geometry shrunk: a NoPE layer every fourth; layers 9 and 10 read layer 8's
# (RoPE) latent cache, layer 11 layer 7's (NoPE), as layers 39, 43, ... read layer 35's.
DEMO_NOPE = "rope,rope,rope,nope"
DEMO_KV_SOURCES = (0, 1, 2, 3, 4, 5, 6, 7, 8, 8, 8, 7)
DEMO_INDEX_SHARING = "full,shared"
_DRAFT_LAYERS, _MARKOV_RANK = 1, 8


def _demo_native_name(spec, name: str) -> str:
    if name.startswith(DRAFT_PREFIX):
        return name
    module, suffix = name.rsplit(".", 1)
    if module in _DEMO_TOP:
        return f"{_DEMO_TOP[module]}.{suffix}"
    _, _, layer, rest = module.split(".", 3)
    if rest.startswith("self_attn."):
        return f"layers.{layer}.attention.{_DEMO_ATTN[rest[len('self_attn.') :]]}.{suffix}"
    if rest in ("input_layernorm", "post_attention_layernorm", "mlp.gate"):
        own = {"input_layernorm": "attention_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate": "gate"}
        return f"layers.{layer}.{own[rest]}.{suffix}"
    parts = rest.split(".")  # mlp.[experts.E. | shared_experts.]gate_proj, or mlp.gate_proj (dense)
    where = {"experts": f"experts.{parts[-2]}", "shared_experts": "shared_experts"}.get(parts[1], "feed_forward")
    return f"layers.{layer}.{where}.{_DEMO_W[parts[-1]]}.{suffix}"


def _demo_draft(spec) -> list[tuple[str, str, tuple[int, ...]]]:
    """A DSpark draft (BF16): one dense MLA layer after the target's, its projections and heads."""
    h, n, vocab = spec.hidden_size, spec.num_attention_heads, spec.vocab_size
    p, r, v, l = spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim, spec.kv_lora_rank
    b, out = DRAFT_PREFIX + "backbone.", []
    for j in range(spec.num_hidden_layers, spec.num_hidden_layers + _DRAFT_LAYERS):
        x = f"{b}layers.{j}."
        out += [
            (x + "attention_norm.weight", "norm", (h,)), (x + "attention.wq.weight", "bf16", (n * (p + r), h)),
            (x + "attention.wkv_a_with_mqa.weight", "bf16", (l + r, h)), (x + "attention.kv_a_norm.weight", "norm", (l,)),
            (x + "attention.wkv_b.weight", "bf16", (n * (p + v), l)), (x + "attention.wo.weight", "bf16", (h, n * v)),
            (x + "ffn_norm.weight", "norm", (h,)), (x + "feed_forward.w1.weight", "bf16", (spec.intermediate_size, h)),
            (x + "feed_forward.w2.weight", "bf16", (h, spec.intermediate_size)),
            (x + "feed_forward.w3.weight", "bf16", (spec.intermediate_size, h)),
        ]  # fmt: skip
    targets = len(DEMO_NOPE.split(","))
    out += [
        (b + "target_projection.weight", "bf16", (h, h * targets)), (b + "target_norm.weight", "norm", (h,)),
        (b + "final_norm.weight", "norm", (h,)), (b + "mask_embedding", "norm", (h,)),
        (DRAFT_PREFIX + "autoregressive_head.embedding.weight", "bf16", (vocab, _MARKOV_RANK)),
        (DRAFT_PREFIX + "autoregressive_head.output.weight", "bf16", (vocab, _MARKOV_RANK)),
    ]  # fmt: skip
    return out


def _demo_tensors(spec, tensors: list) -> list:
    """NoPE layers' wkv_a_with_mqa (kv_lora rows) and wkv_b (nope + rope + v per head), KV-sharing
    layers without wkv_a_with_mqa / kv_a_norm, SSMax per head, the indexer's input norm and SSMax,
    LeRoPE's alpha and the draft; the rest as the generic spec has it."""
    layers, n = spec.num_hidden_layers, spec.num_attention_heads
    nope = model_configs.tile([v == "nope" for v in DEMO_NOPE.split(",")], layers)
    sources = DEMO_KV_SOURCES if len(DEMO_KV_SOURCES) == layers else tuple(range(layers))
    full = model_configs.tile(DEMO_INDEX_SHARING.split(","), layers)
    out = []
    for name, kind, shape in tensors:
        parts = name.split(".")
        i = int(parts[2]) if parts[:2] == ["model", "layers"] else None
        rest = ".".join(parts[3:])
        if (
            i is not None
            and sources[i] != i
            and rest.startswith(("self_attn.kv_a_proj_with_mqa.", "self_attn.kv_a_layernorm."))
        ):
            continue
        if i is not None and nope[i] and rest == "self_attn.kv_a_proj_with_mqa.weight":
            shape = (spec.kv_lora_rank, shape[1])
        if i is not None and nope[i] and rest == "self_attn.kv_b_proj.weight":
            shape = (n * (spec.qk_nope_head_dim + spec.qk_rope_head_dim + spec.v_head_dim), shape[1])
        out.append((name, kind, shape))
        a = f"model.layers.{i}.self_attn."
        if i is not None and rest == "self_attn.o_proj.weight":
            out += [(a + "ssmax.s", "norm", (n,)), (a + "ssmax.b", "norm", (n,))]
        if i is not None and rest == "self_attn.indexer.k_norm.bias" and full[i] == "full":
            h, heads = spec.hidden_size, spec.index_n_heads
            out += [(a + "indexer.q_input_norm.weight", "norm", (h,)), (a + "indexer.q_input_norm.bias", "bias", (h,)),
                    (a + "indexer.ssmax.s", "norm", (heads,)), (a + "indexer.ssmax.b", "norm", (heads,))]  # fmt: skip
    return [*out, ("model.lerope.alpha", "f32", (spec.qk_rope_head_dim // 2,)), *_demo_draft(spec)]


def _demo_params_json(spec, cfg: dict) -> dict:
    """Mistral-Large-4's params.json at the spec's dims (its keys, model-family.md)."""
    params = {
        "dim": spec.hidden_size, "n_layers": spec.num_hidden_layers, "head_dim": spec.qk_nope_head_dim + spec.qk_rope_head_dim,
        "hidden_dim": spec.intermediate_size, "n_heads": spec.num_attention_heads, "n_kv_heads": spec.num_attention_heads,
        "norm_eps": 1e-06, "vocab_size": spec.vocab_size, "rope_theta": 10000.0, "max_position_embeddings": 4096,
        "q_lora_rank": None, "kv_lora_rank": spec.kv_lora_rank, "qk_nope_head_dim": spec.qk_nope_head_dim,
        "qk_rope_head_dim": spec.qk_rope_head_dim, "v_head_dim": spec.v_head_dim, "tied_embeddings": False,
        "nope": DEMO_NOPE, "ssmax_scaling": True, "lerope": True,
        "kv_sharing": {"source_layers_str": ",".join(map(str, DEMO_KV_SOURCES))},
        "moe": {"expert_hidden_dim": spec.moe_intermediate_size, "first_k_dense_replace": spec.first_k_dense_replace,
                "num_expert_groups": 1, "num_expert_groups_per_tok": 1, "num_experts": spec.n_routed_experts,
                "num_experts_per_tok": spec.num_experts_per_tok, "num_shared_experts": spec.n_shared_experts,
                "route_every_n": 1, "routed_scale": 1.0},
        "dsa": {"topk": 8, "n_heads": spec.index_n_heads, "head_dim": spec.index_head_dim, "norm_eps": 1e-06,
                "ssmax_scaling": True, "fp8_indexer": True, "nope": False, "sharing": DEMO_INDEX_SHARING},
        "mtp": {"n_layers": _DRAFT_LAYERS, "depth": 4, "target_activation_layers": "3,7,11", "ragged_attention": None,
                "dspark": {"markov_rank": _MARKOV_RANK, "head_type": "vanilla", "draft_input": "shared_mask"}},
        "yarn": {"alpha": 1, "apply_scale": False, "beta": 32, "factor": 4, "original_max_position_embeddings": 1024},
    }  # fmt: skip
    if "quantization_config" in cfg:
        params["quantization_config"] = cfg["quantization_config"]
    return params


LAYOUT = "mistral-dsa"  # the demo's CheckpointSpec.layout
_CT_IGNORE = ("model.embed_tokens", "lm_head", "re:.*kv_a_proj_with_mqa$", "re:.*kv_b_proj$",
              r"re:.*indexer\.(wk|weights_proj)$", r"re:.*mlp\.gate$", r"re:mtp_dspark\..*")  # fmt: skip
_DEMO = dict(
    architecture=_ARCH, model_type="mistral_large_4", layout=LAYOUT, num_nextn_predict_layers=0,
    topk_method="softmax", n_group=1, topk_group=1, auto_map=(), remote_code=(), num_shards=3,
    shard_name="consolidated-{i:05d}-of-{n:05d}.safetensors", hidden_size=96, num_hidden_layers=12,
    num_attention_heads=4, q_lora_rank=None, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
    v_head_dim=32, intermediate_size=192, moe_intermediate_size=64, n_routed_experts=4, n_shared_experts=1,
    num_experts_per_tok=2, vocab_size=256, index_n_heads=2, index_head_dim=16,
    indexer_types=tuple(model_configs.tile(DEMO_INDEX_SHARING.split(","), 12)), split_scale_of="",
)  # fmt: skip

MEMBER = Member(
    name="mistral-large-4",
    rank=8,
    architecture=_ARCH,
    short="Mistral-Large-4",
    help_who="Mistral-Large-4 in Mistral's own layout (params.json with a dsa block, consolidated shards)",
    help_what="BF16 or compressed-tensors FP8_BLOCK; output in the same layout and names, every layer's W_UK_T / W_UV at its own dims (NoPE "
    "and KV-sharing layers); wkv_a_with_mqa, wkv_b, the indexer's wk / weights_proj, the router and the DSpark "
    "draft stay BF16",
    indexer=True,
    kept_16bit=r"self_attn\.(kv_a_proj_with_mqa|kv_b_proj|indexer\.wk)$",
    own_layout=is_large4_dir,
    read_own_layout=read_layout,
    config_file=PARAMS_JSON_NAME,
    index_file=CONSOLIDATED_INDEX_NAME,
    layout_help="Mistral-Large-4 in Mistral's own layout (params.json with a dsa block, consolidated shards)",
    refuse=refuse,
    layer_dims=layer_dims,
    layer_inventory=layer_inventory,
    nvfp4_release="Mistral-Large-4's NVFP4 release",
    supported=(
        SupportedCheckpoint(
            "Mistral-Large-4 (1T-A52B, BF16)",
            "Mistral's own layout: `params.json` with a `dsa` block, `consolidated-*.safetensors`, `tekken.json`",
            "BF16, or compressed-tensors FP8_BLOCK (BF16 scales)",
            "the same layout out, Mistral tensor names; W_UK_T / W_UV of every layer at its own dims (NoPE layers: "
            "qk_nope + qk_rope; KV-sharing layers from their own `wkv_b`); `wkv_a_with_mqa`, `wkv_b`, the indexer's "
            "`wk` / `weights_proj`, the router and the DSpark draft (`mtp_dspark.*`) copied BF16 and listed in the "
            "`ignore` in vLLM's module names",
            ("mistral-large-4", "mistral-large-4-fp8"),
        ),
    ),
    demos={
        # Mistral-Large-4-1T-A52B's BF16 release: NoPE and KV-sharing layers, indexer full / shared,
        # per-head SSMax, shared experts after one dense layer, a DSpark draft, no vision encoder.
        "mistral-large-4": _DEMO | dict(weights="bf16"),
        # The same in compressed-tensors FP8_BLOCK with BF16 block multipliers (Mistral-Large-3's
        # FP8 format), its ignore list naming what vLLM builds unquantized.
        "mistral-large-4-fp8": _DEMO | dict(weights="ct-fp8-block", scale_dtype="bf16", quant_ignore=_CT_IGNORE),
    },
    demo_layout=DemoLayout(
        LAYOUT,
        native_name=_demo_native_name,
        config_file=lambda spec, cfg: (PARAMS_JSON_NAME, _demo_params_json(spec, cfg)),
        index_name=CONSOLIDATED_INDEX_NAME,
        side_files=large3._demo_side_files,
        edit_tensors=_demo_tensors,
    ),
)
