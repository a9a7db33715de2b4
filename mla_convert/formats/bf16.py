"""bf16: every block-FP8 weight dequantized to bf16 (bit-exact to DeepSeek's own converter), an
INT4 source's experts too; no quantization_config, no FP8 range (the same bytes for every target:
it takes the default target only)."""

from __future__ import annotations

from mla_convert.formats.format import Becomes, Format

BF16_DTYPE = "BF16"


class Bf16(Format):
    name = "bf16"
    rank = 1
    help = "bf16"
    words = "bf16"
    block_fp8 = Becomes("bf16", BF16_DTYPE)  # kernels.transforms.block_fp8_to_bf16
    int4 = Becomes("int4_bf16", BF16_DTYPE)  # kernels.transforms.int4_to_bf16
    fp8_range = False
    tags = ("bf16",)

    def card_words(self, target: str, fp8_max: float) -> str:
        return "bf16"

    def card_weights(self, facts) -> str:
        int4 = (
            "; the source's INT4 experts are `(nibble - 8) * scale`, computed in fp32 and rounded once to bf16"
            if facts.int4_experts
            else ""
        )
        return (
            "## The weights\n\n"
            "Every block-FP8 weight of the source is stored in bf16, `bf16(fp32(w) * scale)` (bit-exact to "
            "DeepSeek's own converter)"
            + int4
            + f", and `{facts.config_name}` has no `quantization_config`. Every other tensor "
            "(16-bit linears, embeddings, norms in their own dtype, the router, `lm_head`) is the source's, "
            "bit for bit; the MTP layer is kept where the source has one."
        )


FORMAT = Bf16()
