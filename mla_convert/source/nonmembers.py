"""Checkpoints that look like the MLA family but are not this tool's, each refused in one line that
says what the checkpoint is and why it is not converted (shared/reference/model-family.md).

They have no `kv_b_proj` (so no latent up-projection to precompute), or a layout the family's rules
do not describe, and vllm-gaudi's MLA layer (HPUMLAAttention) serves none of them. Standard
library only.
"""

from __future__ import annotations

from mla_convert.source import members
from mla_convert.source.members import NonMember

_NOT_SERVED = "vllm-gaudi's MLA layer (HPUMLAAttention) does not serve it, and its layers are not DeepSeek-V3's"
# Look-alikes of no member; a member's own look-alikes are declared in its module (Member.non_members).
_OTHERS = (
    NonMember(
        "LongCat-Flash", ("LongcatFlashForCausalLM", "LongcatFlashNgramForCausalLM"),
        ("longcat_flash", "longcat_flash_ngram"),
        "two attention blocks per layer and zero-computation experts; " + _NOT_SERVED,
    ),
)  # fmt: skip


def non_members() -> tuple[NonMember, ...]:
    """Every refused look-alike: the members' own, then the others."""
    return members.non_members() + _OTHERS


def non_member(config: dict) -> str | None:
    """One sentence saying which non-member `config` describes and why it is not converted; None
    when it is none of them."""
    archs = config.get("architectures")
    archs = archs if isinstance(archs, list) else []
    model_type = config.get("model_type")
    for nm in non_members():
        if any(a in nm.architectures for a in archs) or model_type in nm.model_types:
            label = ", ".join(str(a) for a in archs) or "no architectures"
            return f"{nm.what} ({label}, model_type {model_type!r}) is not converted by mla-convert: {nm.why}"
    return None


def nvfp4_release(quantization_config: dict | None) -> str | None:
    """The reason an NVFP4 (FP4) source is refused; None otherwise."""
    if not isinstance(quantization_config, dict):
        return None
    groups = quantization_config.get("config_groups")
    groups = groups.values() if isinstance(groups, dict) else []
    fp4 = any(
        isinstance(g, dict)
        and isinstance(g.get("weights"), dict)
        and g["weights"].get("type") == "float"
        and g["weights"].get("num_bits") == 4
        for g in groups
    )
    formats = {quantization_config.get("format")} | {g.get("format") for g in groups if isinstance(g, dict)}
    if not fp4 and not any(isinstance(f, str) and "fp4" in f for f in formats):
        return None
    releases = "".join(f", such as {r}" for r in members.nvfp4_releases()[:1])
    return (
        f"an NVFP4 checkpoint (4-bit float weights, compressed-tensors nvfp4-pack-quantized){releases}, is not "
        "converted by mla-convert: it reads block-FP8, BF16 and pack-quantized INT4 sources only; convert the "
        "model's FP8 or BF16 release instead"
    )
