"""The MLA family: which architectures convert, and what a member's config says its checkpoint holds.

Facts from the members' real checkpoints (DeepSeek-V3/R1/V3.1/V3.2, Kimi-K2, GLM-5, DeepSeek-V2,
Moonlight): the tensor names are DeepSeek-V3's; the MLA dims come from the config; V3.2 and GLM add
a lightning indexer to every layer; GLM's MTP layer reuses the main model's embeddings and head;
some checkpoints also store each layer's rotary `inv_freq` buffer. Standard library only, so the
CLI's --help can list the architectures without importing torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DEEPSEEK_V3 = "DeepseekV3ForCausalLM"
DEEPSEEK_V32 = "DeepseekV32ForCausalLM"
DEEPSEEK_V2 = "DeepseekV2ForCausalLM"
GLM_MOE_DSA = "GlmMoeDsaForCausalLM"

# architecture -> (the checkpoints that declare it, what the conversion does with them)
ARCHITECTURES: dict[str, tuple[str, str]] = {
    DEEPSEEK_V3: (
        "DeepSeek-V3, R1, V3.1 (deepseek_v3); Kimi-K2 (kimi_k2); Moonlight; fine-tunes; any model_type",
        "Block-FP8 (F32 or E8M0 scales, any block size) or BF16 source; MTP layer kept where present; "
        "Kimi's rotary inv_freq copied",
    ),
    DEEPSEEK_V32: (
        "DeepSeek-V3.2, V3.2-Exp (deepseek_v32)",
        "As DeepseekV3, plus the lightning indexer: wq_b / wk converted, weights_proj and k_norm copied; "
        "F32 norms stay F32",
    ),
    GLM_MOE_DSA: (
        "GLM-5, GLM-5.1 FP8 (glm_moe_dsa)",
        "As DeepseekV32 with its own dims (qk_nope 192, v_head 256); modules_to_not_convert copied as BF16 "
        "and ignored; MTP layer without embed_tokens / shared_head.head",
    ),
    DEEPSEEK_V2: (
        "DeepSeek-V2, V2.5, V2-Lite (deepseek_v2)",
        "BF16 source: channel FP8 quantizes the linears per row, bf16 copies them; without q_lora, q_proj",
    ),
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)


def architectures_help() -> str:
    """The supported architectures, one paragraph each, for --help."""
    return "\n\n".join(f"{arch}: {who}. {what}." for arch, (who, what) in ARCHITECTURES.items())


INDEXER_ARCHITECTURES = (DEEPSEEK_V32, GLM_MOE_DSA)
# MTP layers that reuse the main model's embed_tokens and lm_head instead of storing their own.
SHARED_MTP_HEAD_ARCHITECTURES = (GLM_MOE_DSA,)

# The tiny synthetic checkpoints (demo.specs.FAMILY) and `demo --family`, by member name.
MEMBERS = ("deepseek-v3", "deepseek-v3.1", "deepseek-v3.2", "kimi-k2", "glm-5", "deepseek-v2-lite", "moonlight")

MLA_KEYS = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
)  # fmt: skip
INDEXER_KEYS = ("index_n_heads", "index_head_dim")

# Linear kinds. FP8_LINEAR: one that DeepSeek's FP8 releases quantize (attention projections with
# the indexer's wq_b / wk, dense MLP, routed and shared experts); a BF16 source's channel-FP8
# conversion quantizes exactly these. LINEAR: a linear that stays in 16-bit (lm_head, the router
# gate, the MTP eh_proj and shared head, the indexer's weights_proj). OTHER: embeddings, norms,
# biases, buffers.
FP8_LINEAR = "fp8-linear"
LINEAR = "linear"
OTHER = "other"

_LAYER = r"model\.layers\.\d+\."
_FP8_LINEAR_RE = re.compile(
    _LAYER + r"(self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|indexer\.wq_b|indexer\.wk)"
    r"|mlp\.(experts\.\d+\.|shared_experts\.)?(gate_proj|up_proj|down_proj))$"
)
_LINEAR_RE = re.compile(
    r"lm_head$|" + _LAYER + r"(mlp\.gate|eh_proj|shared_head\.head|self_attn\.indexer\.weights_proj)$"
)
# Buffers some real checkpoints store (Kimi-K2: every layer's rotary inv_freq, BF16): copied, and
# accepted by verify for the layers the config has, whatever their length.
EXTRA_BUFFER_RE = re.compile(r"model\.layers\.(\d+)\.self_attn\.rotary_emb\.inv_freq$")


def linear_kind(module: str) -> str:
    """FP8_LINEAR, LINEAR or OTHER for a module name like 'model.layers.3.mlp.experts.7.up_proj'."""
    if _FP8_LINEAR_RE.match(module):
        return FP8_LINEAR
    if _LINEAR_RE.match(module):
        return LINEAR
    return OTHER


class FamilyError(ValueError):
    """A config that no supported architecture explains; the message is one line naming the fix."""


def architecture_of(config: dict) -> str:
    """The supported architecture a config declares; FamilyError naming the supported list if none."""
    archs = config.get("architectures") or []
    found = [a for a in archs if a in ARCHITECTURES] if isinstance(archs, list) else []
    if not found:
        raise FamilyError(
            f"architectures {archs!r} (model_type {config.get('model_type')!r}) is not a supported MLA model; "
            f"expected one of {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return found[0]


@dataclass(frozen=True)
class ModelLayout:
    """What a member's config says about its checkpoint's tensors."""

    architecture: str
    layers: int  # decoder layers
    mtp_layers: int  # MTP layers after them (num_nextn_predict_layers)
    q_lora_rank: int | None  # None: a single q_proj
    indexer: tuple[int, int] | None  # (index_n_heads, index_head_dim) of the lightning indexer
    mtp_own_head: bool  # the MTP layer stores its own embed_tokens and shared_head.head
    indexer_layers: frozenset[int] = frozenset()  # the layers that hold an indexer

    @classmethod
    def of(cls, config: dict) -> ModelLayout:
        """Raises FamilyError for an unsupported architecture or a missing or non-integer dimension."""
        arch = architecture_of(config)
        keys = MLA_KEYS + (INDEXER_KEYS if arch in INDEXER_ARCHITECTURES else ())
        missing = [k for k in keys if not _is_int(config.get(k))]
        if missing:
            raise FamilyError(f"{arch} config lacks integer {', '.join(missing)}")
        q_lora = config.get("q_lora_rank")
        if q_lora is not None and not _is_int(q_lora):
            raise FamilyError(f"q_lora_rank {q_lora!r} must be an integer or null")
        mtp = config.get("num_nextn_predict_layers") or 0
        if not _is_int(mtp) or mtp < 0:
            raise FamilyError(f"num_nextn_predict_layers {mtp!r} must be a non-negative integer")
        indexer = (config["index_n_heads"], config["index_head_dim"]) if arch in INDEXER_ARCHITECTURES else None
        layers = config["num_hidden_layers"]
        with_indexer = frozenset(i for i in range(layers + mtp) if indexer and _has_indexer(config, i, layers))
        return cls(arch, layers, mtp, q_lora or None, indexer, arch not in SHARED_MTP_HEAD_ARCHITECTURES,
                   with_indexer)  # fmt: skip

    @property
    def all_layers(self) -> int:
        return self.layers + self.mtp_layers


def _has_indexer(config: dict, i: int, layers: int) -> bool:
    """Whether layer i holds an indexer. Every layer does unless the config shares one layer's
    top-k with the next ones (index_topk_pattern 'S', or index_topk_freq > 1 as vLLM and
    transformers read it); MTP layers always do."""
    if i >= layers:
        return True
    pattern = config.get("index_topk_pattern")
    if pattern is not None:
        return not (i < len(pattern) and pattern[i] == "S")
    freq = config.get("index_topk_freq") or 1
    return max(i - (config.get("index_skip_topk_offset", 2)) + 1, 0) % freq == 0


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


Implied = dict[str, tuple[tuple[int, ...], str]]  # tensor name -> (shape, kind)


def implied_tensors(cfg: dict) -> Implied:
    """Every tensor a member's checkpoint holds: name -> (shape, kind), MTP layers included.

    Raises FamilyError for a config ModelLayout.of refuses, KeyError/TypeError for a missing MoE or
    vocabulary dimension."""
    lay = ModelLayout.of(cfg)
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    out: Implied = {"model.embed_tokens.weight": ((vocab, h), OTHER), "model.norm.weight": ((h,), OTHER)}
    if not cfg.get("tie_word_embeddings"):
        out["lm_head.weight"] = ((vocab, h), LINEAR)
    for i in range(lay.all_layers):
        pre = f"model.layers.{i}."
        out[pre + "input_layernorm.weight"] = ((h,), OTHER)
        out[pre + "post_attention_layernorm.weight"] = ((h,), OTHER)
        _attention_tensors(out, cfg, lay, i)
        _ffn_tensors(out, cfg, i)
        if i >= lay.layers:  # the MTP layer's own modules
            out[pre + "enorm.weight"] = ((h,), OTHER)
            out[pre + "hnorm.weight"] = ((h,), OTHER)
            out[pre + "eh_proj.weight"] = ((h, 2 * h), LINEAR)
            out[pre + "shared_head.norm.weight"] = ((h,), OTHER)
            if lay.mtp_own_head:
                out[pre + "embed_tokens.weight"] = ((vocab, h), OTHER)
                out[pre + "shared_head.head.weight"] = ((vocab, h), LINEAR)
    return out


def _attention_tensors(out: Implied, cfg: dict, lay: ModelLayout, i: int) -> None:
    """Layer i's MLA projections and norms, and its indexer where it has one."""
    h, n, q_lora = cfg["hidden_size"], cfg["num_attention_heads"], lay.q_lora_rank
    p, r, v, l = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
    a = f"model.layers.{i}.self_attn."
    if q_lora:
        out[a + "q_a_proj.weight"] = ((q_lora, h), FP8_LINEAR)
        out[a + "q_a_layernorm.weight"] = ((q_lora,), OTHER)
        out[a + "q_b_proj.weight"] = ((n * (p + r), q_lora), FP8_LINEAR)
    else:
        out[a + "q_proj.weight"] = ((n * (p + r), h), FP8_LINEAR)
    out[a + "kv_a_proj_with_mqa.weight"] = ((l + r, h), FP8_LINEAR)
    out[a + "kv_a_layernorm.weight"] = ((l,), OTHER)
    out[a + "kv_b_proj.weight"] = ((n * (p + v), l), FP8_LINEAR)
    out[a + "o_proj.weight"] = ((h, n * v), FP8_LINEAR)
    if i in lay.indexer_layers:
        heads, dim = lay.indexer
        x = a + "indexer."
        out[x + "wq_b.weight"] = ((heads * dim, q_lora or h), FP8_LINEAR)
        out[x + "wk.weight"] = ((dim, h), FP8_LINEAR)
        out[x + "weights_proj.weight"] = ((heads, h), LINEAR)
        out[x + "k_norm.weight"] = ((dim,), OTHER)
        out[x + "k_norm.bias"] = ((dim,), OTHER)


def _ffn_tensors(out: Implied, cfg: dict, i: int) -> None:
    """Layer i's dense MLP, or its router with the routed and shared experts."""
    h, experts, pre = cfg["hidden_size"], cfg.get("n_routed_experts") or 0, f"model.layers.{i}."

    def mlp(prefix: str, inter: int) -> None:
        out[prefix + "gate_proj.weight"] = ((inter, h), FP8_LINEAR)
        out[prefix + "up_proj.weight"] = ((inter, h), FP8_LINEAR)
        out[prefix + "down_proj.weight"] = ((h, inter), FP8_LINEAR)

    moe = experts and i >= (cfg.get("first_k_dense_replace") or 0) and i % (cfg.get("moe_layer_freq") or 1) == 0
    types = cfg.get("mlp_layer_types")  # GLM's explicit per-layer list, where present
    if isinstance(types, list) and i < len(types):
        moe = experts and types[i] == "sparse"
    if not moe:
        mlp(pre + "mlp.", cfg["intermediate_size"])
        return
    out[pre + "mlp.gate.weight"] = ((experts, h), LINEAR)
    if cfg.get("topk_method") == "noaux_tc":
        out[pre + "mlp.gate.e_score_correction_bias"] = ((experts,), OTHER)
    for e in range(experts):
        mlp(f"{pre}mlp.experts.{e}.", cfg["moe_intermediate_size"])
    if cfg.get("n_shared_experts"):
        mlp(pre + "mlp.shared_experts.", cfg["moe_intermediate_size"] * cfg["n_shared_experts"])


def extra_buffer_layer(name: str) -> int | None:
    """The layer of a known extra buffer (a layer's rotary inv_freq), else None."""
    m = EXTRA_BUFFER_RE.match(name)
    return int(m.group(1)) if m else None


# --- the MLA shapes a config fixes, each named by the config fields it depends on ------------------


@dataclass(frozen=True)
class ShapeRule:
    """One dimension of one attention tensor: the product of sums of config fields."""

    suffix: str  # after 'model.layers.N.self_attn.'
    axis: int  # 0: rows, 1: columns
    factors: tuple[tuple[str, ...], ...]  # e.g. (("num_attention_heads",), ("qk_nope_head_dim", "v_head_dim"))

    def value(self, cfg: dict) -> int:
        out = 1
        for factor in self.factors:
            out *= sum(cfg[f] for f in factor)
        return out

    def formula(self, cfg: dict | None = None) -> str:
        """'num_attention_heads x (qk_nope_head_dim + v_head_dim)', or with cfg its numbers."""

        def term(factor):
            parts = [str(cfg[f]) if cfg else f for f in factor]
            return parts[0] if len(parts) == 1 else f"({' + '.join(parts)})"

        return " x ".join(term(f) for f in self.factors)

    def fields(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(f for factor in self.factors for f in factor))

    def solve(self, cfg: dict, field: str, found: int) -> int | None:
        """The positive integer value of `field` that makes this rule give `found`, if any (the
        rule is linear in each field)."""
        at0, at1 = self.value(cfg | {field: 0}), self.value(cfg | {field: 1})
        if at1 == at0 or (found - at0) % (at1 - at0):
            return None
        x = (found - at0) // (at1 - at0)
        return x if x > 0 else None


def shape_rules(layout: ModelLayout, layer: int) -> list[ShapeRule]:
    """The attention tensors' dims a config fixes, kv_b_proj (what the artifacts split) first."""
    heads = ("num_attention_heads",)
    rules = [
        ShapeRule("kv_b_proj.weight", 0, (heads, ("qk_nope_head_dim", "v_head_dim"))),
        ShapeRule("kv_b_proj.weight", 1, (("kv_lora_rank",),)),
        ShapeRule("kv_a_proj_with_mqa.weight", 0, (("kv_lora_rank", "qk_rope_head_dim"),)),
        ShapeRule("kv_a_proj_with_mqa.weight", 1, (("hidden_size",),)),
        ShapeRule("o_proj.weight", 0, (("hidden_size",),)),
        ShapeRule("o_proj.weight", 1, (heads, ("v_head_dim",))),
    ]
    if layout.q_lora_rank:
        rules += [
            ShapeRule("q_a_proj.weight", 0, (("q_lora_rank",),)),
            ShapeRule("q_a_proj.weight", 1, (("hidden_size",),)),
            ShapeRule("q_b_proj.weight", 0, (heads, ("qk_nope_head_dim", "qk_rope_head_dim"))),
            ShapeRule("q_b_proj.weight", 1, (("q_lora_rank",),)),
        ]
    else:
        rules += [
            ShapeRule("q_proj.weight", 0, (heads, ("qk_nope_head_dim", "qk_rope_head_dim"))),
            ShapeRule("q_proj.weight", 1, (("hidden_size",),)),
        ]
    if layer in layout.indexer_layers:
        rules += [
            ShapeRule("indexer.wq_b.weight", 0, (("index_n_heads",), ("index_head_dim",))),
            ShapeRule("indexer.wq_b.weight", 1, (("q_lora_rank",) if layout.q_lora_rank else ("hidden_size",),)),
            ShapeRule("indexer.wk.weight", 0, (("index_head_dim",),)),
            ShapeRule("indexer.wk.weight", 1, (("hidden_size",),)),
            ShapeRule("indexer.weights_proj.weight", 0, (("index_n_heads",),)),
            ShapeRule("indexer.weights_proj.weight", 1, (("hidden_size",),)),
        ]
    return rules


def shape_mismatch(cfg: dict, layout: ModelLayout, layer: int, shapes: dict[str, tuple[int, ...]]) -> str | None:
    """The first disagreement between the config and one layer's attention tensors, as one sentence
    naming the field, the tensor and both numbers; None when they agree. `shapes`: suffix (after
    'self_attn.') -> shape of the layer's tensors; absent ones are not checked here."""
    rules = [r for r in shape_rules(layout, layer) if r.suffix in shapes and len(shapes[r.suffix]) == 2]
    for rule in rules:
        found = shapes[rule.suffix][rule.axis]
        want = rule.value(cfg)
        if found == want:
            continue
        what = ("rows", "columns")[rule.axis]
        shape = list(shapes[rule.suffix])
        # The one field whose change explains this tensor and keeps every other tensor right.
        fits = {}
        for field in rule.fields():
            x = rule.solve(cfg, field, found)
            if x is not None and all(
                o.value(cfg | {field: x}) == shapes[o.suffix][o.axis] for o in rules if o is not rule
            ):
                fits[field] = x
        head = f"{f'model.layers.{layer}.self_attn.{rule.suffix}'!r} {shape} has {found} {what}"
        if len(fits) == 1:
            (field, x) = next(iter(fits.items()))
            return (
                f"{field} is {cfg[field]}, but {head}: {rule.formula()} = {rule.formula(cfg)} = {want}; "
                f"the tensor fits {field} {x}"
            )
        return f"{head}, but the config's {rule.formula()} = {rule.formula(cfg)} = {want}"
    return None
