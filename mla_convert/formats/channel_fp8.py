"""channel-fp8: compressed-tensors channel FP8, which vLLM and vllm-gaudi load as it is. Each
linear the source holds in block FP8 (and, from a 16-bit source, each linear the member's FP8
releases quantize) becomes an e4m3fn weight [N, K] with a float32 scale per output row [N, 1],
`max|row| / FP8_MAX` of its exact value (so every non-zero row reaches FP8_MAX: verify's
`fp8-row-max`); an INT4 source's experts are copied as they are."""

from __future__ import annotations

from mla_convert.constants import CHANNEL_SCALE_SUFFIX, FP8_E4M3
from mla_convert.formats.compressed_tensors import CompressedTensorsFp8, static_fp8_weights
from mla_convert.formats.format import Becomes, ScaleLayout

SCALE = ScaleLayout(CHANNEL_SCALE_SUFFIX, "F32", lambda shape: (shape[0], 1))


class ChannelFp8(CompressedTensorsFp8):
    name = "channel-fp8"
    rank = 0
    help = "channel-fp8 (compressed-tensors, loads as is in vLLM/vllm-gaudi)"
    words = "channel FP8"
    block_fp8 = Becomes("fp8", FP8_E4M3, SCALE)  # kernels.transforms.block_fp8_to_channel_fp8
    float_linear = Becomes("quant", FP8_E4M3, SCALE)  # kernels.transforms.float_to_channel_fp8
    weights = static_fp8_weights("channel")
    value_checks = ("nan-inf", "fp8-range", "fp8-negative-zero", "fp8-row-max", "fp8-scale")

    def card_words(self, target: str, fp8_max: float) -> str:
        return f"channel FP8 (compressed-tensors) for {target} (FP8 max {fp8_max:g})"

    def card_weights(self, facts) -> str:
        int4 = (
            " The source's pack-quantized INT4 routed experts are copied bit for bit, never requantized; their "
            "group keeps the source's scheme next to the channel-FP8 group."
            if facts.int4_experts
            else ""
        )
        return (
            "## The weights\n\n"
            "Each linear the source holds in block FP8 (and, from a BF16 source, each linear DeepSeek's FP8 "
            "releases quantize) is `X.weight` float8_e4m3fn [N, K] with `X.weight_scale` float32 [N, 1]: one "
            f"scale per output row, `max|row| / {facts.fp8_max:g}`, from the exact fp32 value of the source weight, "
            "rounded to nearest once."
            + int4
            + f" `{facts.config_name}` carries a compressed-tensors `quantization_config` (static "
            "per-channel FP8 weights, dynamic per-token FP8 activations) whose `ignore` list names the "
            f"{facts.ignored_modules} modules left in 16 bits. Every other tensor (embeddings, norms in their own "
            "dtype, the router, `lm_head`) is the source's, bit for bit; the MTP layer is kept where the source "
            "has one."
        )

    def card_serving_note(self) -> str:
        return (
            " Its CPU build has no FP8 MoE: serve a conversion whose routed experts were left in bf16 "
            "(`--ignore 'model\\.layers\\.\\d+\\.mlp\\.experts\\.'`)."
        )


FORMAT = ChannelFp8()
