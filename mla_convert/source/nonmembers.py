"""Checkpoints that look like the MLA family but are not this tool's, each refused in one line that
says what the checkpoint is and why it is not converted (shared/reference/model-family.md).

They have no `kv_b_proj` (so no latent up-projection to precompute), or a layout the family's rules
do not describe, and vllm-gaudi's MLA layer (HPUMLAAttention) serves none of them. Standard
library only.
"""

from __future__ import annotations

from dataclasses import dataclass

_NO_KV_B = (
    "it has no kv_b_proj (one 512-wide latent serves as key and value), so there is no latent "
    "up-projection to precompute, and vllm-gaudi's MLA layer (HPUMLAAttention) does not serve it"
)
_NOT_SERVED = "vllm-gaudi's MLA layer (HPUMLAAttention) does not serve it, and its layers are not DeepSeek-V3's"


@dataclass(frozen=True)
class NonMember:
    what: str  # the checkpoint, as a user knows it
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    why: str


NON_MEMBERS = (
    NonMember("DeepSeek-V4", ("DeepseekV4ForCausalLM",), ("deepseek_v4",), _NO_KV_B),
    NonMember("DeepSeek-V4.1", ("DeepseekV41ForCausalLM",), ("deepseek_v41", "deepseek_v4_1"), _NO_KV_B),
    NonMember(
        "GLM-5.3-Flash", ("Glm5NextForConditionalGeneration", "Glm5NextForCausalLM"), ("glm5_next",), _NOT_SERVED
    ),
    NonMember(
        "Kimi-K3", ("KimiK3ForConditionalGeneration", "KimiK3ForCausalLM"), ("kimi_k3",),
        "a hybrid of linear attention (KDA) and MLA layers; " + _NOT_SERVED,
    ),
    NonMember(
        "Kimi-Linear", ("KimiLinearForCausalLM",), ("kimi_linear",),
        "a hybrid of linear attention (KDA) and MLA layers; " + _NOT_SERVED,
    ),
    NonMember(
        "LongCat-Flash", ("LongcatFlashForCausalLM", "LongcatFlashNgramForCausalLM"),
        ("longcat_flash", "longcat_flash_ngram"),
        "two attention blocks per layer and zero-computation experts; " + _NOT_SERVED,
    ),
)  # fmt: skip


def non_member(config: dict) -> str | None:
    """One sentence saying which non-member `config` describes and why it is not converted; None
    when it is none of them."""
    archs = config.get("architectures")
    archs = archs if isinstance(archs, list) else []
    model_type = config.get("model_type")
    for nm in NON_MEMBERS:
        if any(a in nm.architectures for a in archs) or model_type in nm.model_types:
            label = ", ".join(str(a) for a in archs) or "no architectures"
            return f"{nm.what} ({label}, model_type {model_type!r}) is not converted by mla-convert: {nm.why}"
    return None


def nvfp4_release(quantization_config: dict | None) -> str | None:
    """The reason an NVFP4 (FP4) source is refused, e.g. Mistral-Large-3's NVFP4 release; None otherwise."""
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
    return (
        "an NVFP4 checkpoint (4-bit float weights, compressed-tensors nvfp4-pack-quantized), such as "
        "Mistral-Large-3's NVFP4 release, is not converted by mla-convert: it reads block-FP8, BF16 and "
        "pack-quantized INT4 sources only; convert the model's FP8 or BF16 release instead"
    )
