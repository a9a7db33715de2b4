"""What the supported-checkpoints page (docs/checkpoints.md) says, one record per kind of
checkpoint users bring, each naming the `demo --family` member that exercises it. The page is
generated from these records and the non-members (`python scripts/checkpoints_doc.py`); a test
keeps the page, the demo members and these records in step. Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SupportedCheckpoint:
    checkpoints: str  # as a user knows them
    declares: str  # the `architectures` (`model_type`) the files declare, or Mistral's layout
    source: str  # what the source's weights are
    conversion: str  # what happens to them
    demos: tuple[str, ...]  # the demo members (source.family.MEMBERS) built like it


SUPPORTED = (
    SupportedCheckpoint(
        "DeepSeek-V3, R1, V3.1, FP8 fine-tunes", "`DeepseekV3ForCausalLM` (`deepseek_v3`, any)",
        "block FP8 (F32 or E8M0 scales, any block size)",
        "FP8 linears to channel FP8 or bf16; the rest copied; the MTP layer kept",
        ("deepseek-v3", "deepseek-v3.1"),
    ),
    SupportedCheckpoint(
        "Kimi-K2-Instruct", "`DeepseekV3ForCausalLM` (`kimi_k2`)", "block FP8",
        "as V3; each layer's `rotary_emb.inv_freq` copied", ("kimi-k2",),
    ),
    SupportedCheckpoint(
        "Kimi-K2-Thinking", "`DeepseekV3ForCausalLM` (`kimi_k2`)",
        "compressed-tensors pack-quantized INT4 routed experts, the rest BF16",
        "channel FP8: the INT4 experts copied bit for bit, the BF16 linears DeepSeek's FP8 releases quantize "
        "become channel FP8, one config with both groups; bf16: the experts dequantized, `(nibble - 8) * scale` "
        "rounded once",
        ("kimi-k2-thinking",),
    ),
    SupportedCheckpoint(
        "Kimi-K2.5, K2.6", "`KimiK25ForConditionalGeneration` (`kimi_k25`, nested `text_config`)",
        "as K2-Thinking, text tensors under `language_model.`",
        "as K2-Thinking; `vision_tower.*` and `mm_projector.*` copied; the config keeps its nesting",
        ("kimi-k2.5", "kimi-k2.6"),
    ),
    SupportedCheckpoint(
        "Mistral-Large-3 (Instruct, Base, BF16)",
        "Mistral's own layout: `params.json`, `consolidated-*.safetensors`, `tekken.json`",
        "compressed-tensors FP8_BLOCK (BF16 or F32 scales), or BF16",
        "the same layout out: Mistral tensor names, `params.json` and the consolidated index rewritten, no "
        "`config.json`; the `quantization_config`'s `ignore` in HF module names, as vLLM matches them; no MTP "
        "layer, no `e_score_correction_bias`",
        ("mistral-large-3", "mistral-large-3-bf16"),
    ),
    SupportedCheckpoint(
        "Moonlight-16B-A3B, BF16 fine-tunes", "`DeepseekV3ForCausalLM`", "BF16",
        "channel FP8 quantizes the linears below per row; bf16 copies", ("moonlight",),
    ),
    SupportedCheckpoint(
        "DeepSeek-V3.2(-Exp)", "`DeepseekV32ForCausalLM`", "block FP8",
        "as V3, plus the indexer: `wq_b` / `wk` converted, `weights_proj` and `k_norm` copied; F32 norms stay F32",
        ("deepseek-v3.2",),
    ),
    SupportedCheckpoint(
        "GLM-5, GLM-5.1 FP8", "`GlmMoeDsaForCausalLM`", "block FP8 + BF16 `modules_to_not_convert`",
        "as V3.2 at GLM's dims (nope 192, v 256); BF16 modules copied and ignored; MTP layer without its own head",
        ("glm-5",),
    ),
    SupportedCheckpoint(
        "GLM-5.2, GLM-5.3 (IndexShare)", "`GlmMoeDsaForCausalLM`", "as GLM-5",
        "as GLM-5; which layers hold an indexer is read from `indexer_types`, derived from `index_topk_freq` / "
        "`index_skip_topk_offset` only where that is absent, and a disagreement with the tensors is refused "
        "naming the layer",
        ("glm-5.2",),
    ),
    SupportedCheckpoint(
        "DeepSeek-V2-Lite, V2, V2.5", "`DeepseekV2ForCausalLM`", "BF16",
        "as Moonlight; without `q_lora_rank`, `q_proj`", ("deepseek-v2-lite",),
    ),
)  # fmt: skip
