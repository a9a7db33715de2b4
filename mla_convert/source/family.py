"""The MLA family: which architectures convert, and what a member's config says its checkpoint holds.

The members and their facts are declared in `source/members/` (one module each; its registry
answers here). The rules are written in DeepSeek-V3's tensor names (source.naming maps a member's
own names to them); the MLA dims come from the text model's config (source.model_config reads it
from config.json, a nested text_config or a member's own config file); a member may add a
lightning indexer (on every layer, or on those a config's `indexer_types` names "full"), an MTP
layer that reuses the main model's embeddings and head, linears its releases keep 16-bit, and its
own per-layer dims and tensors. Some checkpoints also store each layer's rotary `inv_freq`
buffer. Standard library only, so the CLI's --help can list the architectures without torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from mla_convert.source import members
from mla_convert.source.nonmembers import non_member

DEEPSEEK_V3 = "DeepseekV3ForCausalLM"  # the architecture the rules are written for


def supported_architectures() -> tuple[str, ...]:
    """Every architecture a config may declare (a wrapper's included), from the members."""
    return members.architectures()


def architectures_help() -> str:
    """The supported architectures, one paragraph each, for --help."""
    return members.architectures_help()


def demo_members() -> tuple[str, ...]:
    """The tiny synthetic checkpoints (demo.specs) and `demo --family`, by name."""
    return members.demo_members()


INDEXER_TYPES = ("full", "shared")  # indexer_types (IndexShare): a layer with its own indexer, or one sharing

MLA_KEYS = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
)  # fmt: skip
INDEXER_KEYS = ("index_n_heads", "index_head_dim")

# What each config field the converter reads must be where the config has it (null: absent, the
# default): an integer of at least N, a boolean, a string or a list. A config of another type is
# refused before anything is written, naming the field, instead of converting into an output that
# verify rejects (the MLA dims and the indexer's are required besides: ModelLayout.of).
_POSITIVE, _COUNT = ("integer", 1), ("integer", 0)
FIELD_TYPES = {
    **dict.fromkeys(MLA_KEYS + INDEXER_KEYS, _POSITIVE),
    **dict.fromkeys(("vocab_size", "intermediate_size", "moe_intermediate_size", "q_lora_rank"), _POSITIVE),
    **dict.fromkeys(("moe_layer_freq", "index_topk_freq", "index_topk"), _POSITIVE),
    **dict.fromkeys(("num_nextn_predict_layers", "n_routed_experts", "n_shared_experts"), _COUNT),
    **dict.fromkeys(("first_k_dense_replace", "index_skip_topk_offset"), _COUNT),
    **dict.fromkeys(("tie_word_embeddings", "ssmax_scaling", "indexer_ssmax_scaling", "lerope"), ("boolean", None)),
    **dict.fromkeys(("model_type", "topk_method"), ("string", None)),
    "index_topk_pattern": ("string or list", None),  # one letter per layer ('S': shares the top-k)
    **dict.fromkeys(
        ("architectures", "mlp_layer_types", "indexer_types", "nope_layer_flags", "kv_source_layers"), ("list", None)
    ),
}
_PYTHON_TYPE = {"boolean": bool, "string": str, "list": list, "string or list": (str, list)}


def field_type_problem(config: dict, label=str) -> str | None:
    """The first field of `config` (FIELD_TYPES) whose value the converter cannot interpret, as a
    sentence naming it (`label`: the field as the member's config file spells it) and what it must
    be; None when every one it has is of its type."""
    for name, (kind, least) in FIELD_TYPES.items():
        value = config.get(name)
        if value is None:
            continue
        if kind == "integer":
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= least
            want = "a positive integer" if least == 1 else "a non-negative integer"
        else:
            ok, want = isinstance(value, _PYTHON_TYPE[kind]), f"a {kind}"
        if not ok:
            return f"{label(name)} {_short(value)} must be {want}"
    return None


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# Linear kinds. FP8_LINEAR: one that the member's FP8 releases quantize (DeepSeek's: attention
# projections with the indexer's wq_b / wk, dense MLP, routed and shared experts; a member may keep
# some of them 16-bit, Member.kept_16bit); a BF16 (or INT4) source's channel-FP8 conversion
# quantizes exactly these. LINEAR: a linear that stays in 16-bit (lm_head, the router gate, the MTP
# eh_proj and shared head, the indexer's weights_proj). OTHER: embeddings, norms, biases, buffers.
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
# Buffers some real checkpoints store (every layer's rotary inv_freq, BF16): copied, and
# accepted by verify for the layers the config has, whatever their length.
EXTRA_BUFFER_RE = re.compile(r"model\.layers\.(\d+)\.self_attn\.rotary_emb\.inv_freq$")


def linear_kind(module: str, architecture: str = DEEPSEEK_V3) -> str:
    """FP8_LINEAR, LINEAR or OTHER for a module name like 'model.layers.3.mlp.experts.7.up_proj'."""
    if _FP8_LINEAR_RE.match(module):
        kept = members.kept_16bit(architecture)
        return LINEAR if kept is not None and kept.match(module) else FP8_LINEAR
    if _LINEAR_RE.match(module):
        return LINEAR
    return OTHER


class FamilyError(ValueError):
    """A config that no supported architecture explains; the message is one line naming the fix."""


def architecture_of(config: dict) -> str:
    """The supported text-model architecture a config declares; FamilyError saying why for a known
    non-member (source.nonmembers), naming the supported list for anything else."""
    refusal = non_member(config)
    if refusal:
        raise FamilyError(refusal)
    archs = config.get("architectures") or []
    found = [a for a in archs if a in members.text_architectures()] if isinstance(archs, list) else []
    if not found:
        raise FamilyError(
            f"architectures {archs!r} (model_type {config.get('model_type')!r}) is not a supported MLA model; "
            f"expected one of {', '.join(supported_architectures())}"
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
    moe_layers: frozenset[int] = frozenset()  # the layers with routed experts (the others: a dense MLP)

    @classmethod
    def of(cls, config: dict, label=str) -> ModelLayout:
        """Raises FamilyError for an unsupported architecture, a missing dimension or a field of
        another type than the converter reads (`label`: a field as the config file spells it)."""
        problem = field_type_problem(config, label)
        if problem:
            raise FamilyError(problem)
        arch = architecture_of(config)
        member = members.member_of(arch)
        refusal = member.refuse(config) if member.refuse is not None else None
        if refusal:
            raise FamilyError(refusal)
        keys = MLA_KEYS + (INDEXER_KEYS if member.indexer else ())
        missing = [k for k in keys if not _is_int(config.get(k))]
        if missing:
            raise FamilyError(f"{arch} config lacks integer {', '.join(map(label, missing))}")
        q_lora = config.get("q_lora_rank")
        if q_lora is not None and not _is_int(q_lora):
            raise FamilyError(f"q_lora_rank {q_lora!r} must be an integer or null")
        mtp = config.get("num_nextn_predict_layers") or 0
        if not _is_int(mtp) or mtp < 0:
            raise FamilyError(f"num_nextn_predict_layers {mtp!r} must be a non-negative integer")
        indexer = (config["index_n_heads"], config["index_head_dim"]) if member.indexer else None
        layers = config["num_hidden_layers"]
        _check_indexer_types(config, layers)
        with_indexer = frozenset(i for i in range(layers + mtp) if indexer and _has_indexer(config, i, layers))
        moe = frozenset(i for i in range(layers + mtp) if is_moe_layer(config, i))
        return cls(arch, layers, mtp, q_lora or None, indexer, member.mtp_own_head,
                   with_indexer, moe)  # fmt: skip

    @property
    def all_layers(self) -> int:
        return self.layers + self.mtp_layers


def indexer_placement(config: dict) -> str:
    """Where the config says which layers hold an indexer, for messages."""
    for key in ("indexer_types", "index_topk_pattern", "index_topk_freq"):
        if config.get(key) is not None:
            return key if key != "index_topk_freq" else "index_topk_freq / index_skip_topk_offset"
    return "an indexer on every layer"


def _check_indexer_types(config: dict, layers: int) -> None:
    types = config.get("indexer_types")
    if types is None:
        return
    if not isinstance(types, list) or len(types) != layers or any(t not in INDEXER_TYPES for t in types):
        raise FamilyError(
            f"indexer_types must list 'full' or 'shared' for each of the {layers} decoder layers "
            f"(num_hidden_layers); it is {str(types)[:120]}"
        )


def _has_indexer(config: dict, i: int, layers: int) -> bool:
    """Whether layer i holds an indexer: indexer_types (IndexShare) says so per decoder layer ('full'
    holds one, 'shared' reuses another layer's top-k), where the config has it; else every layer
    does unless the config shares one layer's top-k with the next ones (index_topk_pattern 'S', or
    index_topk_freq > 1 as vLLM and transformers read it); MTP layers always do."""
    if i >= layers:
        return True
    types = config.get("indexer_types")
    if types is not None:
        return types[i] == "full"
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
        _ffn_tensors(out, cfg, lay, i)
        if i >= lay.layers:  # the MTP layer's own modules
            out[pre + "enorm.weight"] = ((h,), OTHER)
            out[pre + "hnorm.weight"] = ((h,), OTHER)
            out[pre + "eh_proj.weight"] = ((h, 2 * h), LINEAR)
            out[pre + "shared_head.norm.weight"] = ((h,), OTHER)
            if lay.mtp_own_head:
                out[pre + "embed_tokens.weight"] = ((vocab, h), OTHER)
                out[pre + "shared_head.head.weight"] = ((vocab, h), LINEAR)
    member = members.member_of(lay.architecture)
    if member.layer_inventory is not None:
        for i in range(lay.all_layers):
            member.layer_inventory(cfg, i, out)
    if members.kept_16bit(lay.architecture) is not None:
        for name, (shape, kind) in out.items():
            if kind == FP8_LINEAR:
                out[name] = (shape, linear_kind(name.rsplit(".", 1)[0], lay.architecture))
    return out


def layer_config(cfg: dict, architecture: str, i: int) -> dict:
    """The config as layer i sees it: the model's, with the MLA dims (config.json's names) its
    member gives that layer of its own (Member.layer_dims)."""
    hook = members.member_of(architecture).layer_dims
    own = hook(cfg, i) if hook is not None else None
    return cfg | own if own else cfg


def _attention_tensors(out: Implied, cfg: dict, lay: ModelLayout, i: int) -> None:
    """Layer i's MLA projections and norms, and its indexer where it has one."""
    cfg = layer_config(cfg, lay.architecture, i)
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


def is_moe_layer(cfg: dict, i: int) -> bool:
    """Whether layer i has routed experts: a per-layer mlp_layer_types where present, else
    first_k_dense_replace and moe_layer_freq."""
    if not cfg.get("n_routed_experts"):
        return False
    types = cfg.get("mlp_layer_types")
    if isinstance(types, list) and i < len(types):
        return types[i] == "sparse"
    return i >= (cfg.get("first_k_dense_replace") or 0) and i % (cfg.get("moe_layer_freq") or 1) == 0


def _ffn_tensors(out: Implied, cfg: dict, lay: ModelLayout, i: int) -> None:
    """Layer i's dense MLP, or its router with the routed and shared experts."""
    h, experts, pre = cfg["hidden_size"], cfg.get("n_routed_experts") or 0, f"model.layers.{i}."

    def mlp(prefix: str, inter: int) -> None:
        out[prefix + "gate_proj.weight"] = ((inter, h), FP8_LINEAR)
        out[prefix + "up_proj.weight"] = ((inter, h), FP8_LINEAR)
        out[prefix + "down_proj.weight"] = ((h, inter), FP8_LINEAR)

    if i not in lay.moe_layers:
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
