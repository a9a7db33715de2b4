"""The slow reference of a conversion in Mistral's own layout (Mistral-Large-3 and Large-4 test
modules both check their demos against it, each with its own set of quantized modules)."""

from __future__ import annotations

import re

import torch

FP8, BF16 = "channel-fp8", "bf16"


def expected_output(
    src: dict[str, torch.Tensor], fmt: str, reference, fp8_source: bool, quantized: re.Pattern
) -> dict[str, torch.Tensor]:
    """From the slow reference (`reference`, tests/support/reference.py), a conversion in Mistral's
    layout: an FP8 source's weights dequantized with their BF16 block multipliers (bf16), or
    requantized per row (channel FP8); a BF16 source's linears that `quantized` names (by Mistral
    module name: the member's FP8 release's) quantized per row; everything else (vision, a draft) copied."""
    out = {}
    for name, t in src.items():
        module = name.rsplit(".", 1)[0]
        if name.endswith(".weight_scale") and fp8_source:
            continue
        if fp8_source and t.dtype == torch.float8_e4m3fn:
            x = reference.dequant_block(t, src[module + ".weight_scale"], (128, 128))
        elif not fp8_source and fmt == FP8 and quantized.match(module) and name.endswith(".weight"):
            x = t.float()
        else:
            out[name] = t
            continue
        if fmt == BF16:
            out[name] = x.to(torch.bfloat16)
        else:
            out[name], out[module + ".weight_scale"] = reference.channel_fp8(x, 448.0)
    return out
