"""The tensor shapes a member's config fixes, each named by the config fields it depends on, so that
a config that does not describe its tensors is refused in one sentence naming the field, the
tensor and both numbers. Written in DeepSeek-V3's names and config.json's field names; a member's
own names (its own config file's fields, its tensor names) are put into the sentence by the caller's
`labels`. Standard library only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mla_convert.source.family import ModelLayout


@dataclass(frozen=True)
class ShapeRule:
    """One dimension of one tensor of a layer: the product of sums of config fields."""

    suffix: str  # after 'model.layers.N.'
    axis: int  # 0: rows, 1: columns
    factors: tuple[tuple[str, ...], ...]  # e.g. (("num_attention_heads",), ("qk_nope_head_dim", "v_head_dim"))

    def value(self, cfg: dict) -> int:
        out = 1
        for factor in self.factors:
            out *= sum(cfg[f] for f in factor)
        return out

    def formula(self, cfg: dict | None = None, field: Callable[[str], str] = str) -> str:
        """'num_attention_heads x (qk_nope_head_dim + v_head_dim)', or with cfg its numbers."""

        def term(factor):
            parts = [str(cfg[f]) if cfg else field(f) for f in factor]
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


def _rule(suffix: str, axis: int, *factors: tuple[str, ...]) -> ShapeRule:
    return ShapeRule(suffix, axis, tuple(factors))


def shape_rules(layout: ModelLayout, layer: int) -> list[ShapeRule]:
    """Layer `layer`'s tensor dims a config fixes: the attention's (kv_b_proj, what the artifacts
    split, first), then the dense MLP's or the router's and experts' (expert 0 stands for all)."""
    heads, h = ("num_attention_heads",), ("hidden_size",)
    a = "self_attn."
    rules = [
        _rule(a + "kv_b_proj.weight", 0, heads, ("qk_nope_head_dim", "v_head_dim")),
        _rule(a + "kv_b_proj.weight", 1, ("kv_lora_rank",)),
        _rule(a + "kv_a_proj_with_mqa.weight", 0, ("kv_lora_rank", "qk_rope_head_dim")),
        _rule(a + "kv_a_proj_with_mqa.weight", 1, h),
        _rule(a + "o_proj.weight", 0, h),
        _rule(a + "o_proj.weight", 1, heads, ("v_head_dim",)),
    ]
    if layout.q_lora_rank:
        rules += [
            _rule(a + "q_a_proj.weight", 0, ("q_lora_rank",)),
            _rule(a + "q_a_proj.weight", 1, h),
            _rule(a + "q_b_proj.weight", 0, heads, ("qk_nope_head_dim", "qk_rope_head_dim")),
            _rule(a + "q_b_proj.weight", 1, ("q_lora_rank",)),
        ]
    else:
        rules += [
            _rule(a + "q_proj.weight", 0, heads, ("qk_nope_head_dim", "qk_rope_head_dim")),
            _rule(a + "q_proj.weight", 1, h),
        ]
    if layer in layout.indexer_layers:
        x = a + "indexer."
        rules += [
            _rule(x + "wq_b.weight", 0, ("index_n_heads",), ("index_head_dim",)),
            _rule(x + "wq_b.weight", 1, ("q_lora_rank",) if layout.q_lora_rank else h),
            _rule(x + "wk.weight", 0, ("index_head_dim",)),
            _rule(x + "wk.weight", 1, h),
            _rule(x + "weights_proj.weight", 0, ("index_n_heads",)),
            _rule(x + "weights_proj.weight", 1, h),
        ]
    if layer in layout.moe_layers:
        e, inter = "mlp.experts.0.", ("moe_intermediate_size",)
        rules += [
            _rule("mlp.gate.weight", 0, ("n_routed_experts",)),
            _rule("mlp.gate.weight", 1, h),
            _rule(e + "up_proj.weight", 0, inter),
            _rule(e + "up_proj.weight", 1, h),
            _rule(e + "down_proj.weight", 1, inter),
        ]
    else:
        rules += [
            _rule("mlp.up_proj.weight", 0, ("intermediate_size",)),
            _rule("mlp.up_proj.weight", 1, h),
            _rule("mlp.down_proj.weight", 1, ("intermediate_size",)),
        ]
    return rules


@dataclass(frozen=True)
class Labels:
    """How the sentence names things: a config field (its own config file's names, for a
    member with one) and a tensor (the checkpoint's own name of a DeepSeek-V3 name)."""

    field: Callable[[str], str] = str
    tensor: Callable[[str], str] = str


def shape_mismatch(
    cfg: dict,
    layout: ModelLayout,
    layer: int,
    shapes: dict[str, tuple[int, ...]],
    labels: Labels = Labels(),
) -> str | None:
    """The first disagreement between the config and one layer's tensors, as one sentence naming
    the field, the tensor and both numbers; None when they agree. `shapes`: suffix (after
    'model.layers.N.') -> shape of the layer's tensors; absent ones are not checked here."""
    rules = [
        r for r in shape_rules(layout, layer) if r.suffix in shapes and len(shapes[r.suffix]) == 2 and _has(cfg, r)
    ]
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
        tensor = labels.tensor(f"model.layers.{layer}.{rule.suffix}")
        head = f"{tensor!r} {shape} has {found} {what}"
        formula = rule.formula(field=labels.field)
        if len(fits) == 1:
            (field, x) = next(iter(fits.items()))
            name = labels.field(field)
            return f"{name} is {cfg[field]}, but {head}: {formula} = {rule.formula(cfg)} = {want}; the tensor fits {name} {x}"
        return f"{head}, but the config's {formula} = {rule.formula(cfg)} = {want}"
    return None


def _has(cfg: dict, rule: ShapeRule) -> bool:
    """Every field the rule needs is an integer in the config (the MoE and MLP sizes are not
    required of every config; a missing one is left to verify's tensor set)."""
    return all(isinstance(cfg.get(f), int) and not isinstance(cfg.get(f), bool) for f in rule.fields())
