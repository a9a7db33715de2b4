"""The converted model's config (config.json, or a member's own params.json), in the source's shape:
bf16 (no quantization_config), compressed-tensors channel FP8, or for an INT4 source channel FP8
next to the source's INT4 group, unchanged but for its targets (mixed-precision)."""

from __future__ import annotations

import copy

from mla_convert.source.model_config import ModelConfig
from mla_convert.source.quantization import PACK_QUANTIZED, Int4Scheme

MIXED_PRECISION = "mixed-precision"  # compressed-tensors' format of a config whose groups differ


def channel_fp8_quantization_config(ignore: list[str]) -> dict:
    """The compressed-tensors config vLLM and vllm-gaudi load as channel FP8 without conversion.

    Weights: static symmetric per-channel e4m3 (`X.weight` + float32 `X.weight_scale` [N, 1]).
    Activations: dynamic per-token FP8. `ignore` lists the linear modules left unquantized.
    The same for either target: the bytes are float8_e4m3fn, only their range differs, so no
    `fp8_dtype_flavor` ('float8_e4m3fnuz' would claim another encoding).
    """
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "type": "float", "num_bits": 8, "strategy": "channel",
                    "symmetric": True, "dynamic": False, "group_size": None, "observer": "minmax",
                },
                "input_activations": {
                    "type": "float", "num_bits": 8, "strategy": "token",
                    "symmetric": True, "dynamic": True, "group_size": None, "observer": None,
                },
                "output_activations": None,
                "format": "float-quantized",
            }
        },
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
    }  # fmt: skip


def int4_and_channel_fp8_config(int4: Int4Scheme, int4_targets: list[str], ignore: list[str]) -> dict:
    """Channel FP8 for every linear but the INT4 ones, which keep the source's INT4 group (its
    weights, activations and format as the source states them) with `int4_targets` naming exactly
    them. The FP8 group targets the class "Linear"; vLLM and compressed-tensors both let a name or
    regex target win over a class target, so each module gets one scheme. Two groups that both
    targeted "Linear" would collide: the later one silently replaces the earlier in both."""
    cfg = channel_fp8_quantization_config(ignore)
    fp8_group = cfg["config_groups"].pop("group_0")
    kept = copy.deepcopy(int4.group) | {"targets": list(int4_targets)}
    kept.setdefault("format", PACK_QUANTIZED)
    fp8_name = next(f"group_{i}" for i in range(1, 100) if f"group_{i}" != int4.group_name)
    cfg["config_groups"] = {int4.group_name: kept, fp8_name: fp8_group}
    cfg["format"] = MIXED_PRECISION
    return cfg


def output_config(model: ModelConfig, fmt: str, ignore: list[str], int4: Int4Scheme | None = None,
                  int4_targets: list[str] | None = None) -> dict:  # fmt: skip
    """The source's config (architectures, model_type, auto_map, nesting and all) with the source's
    own quantization_config replaced where it was: none for bf16, compressed-tensors channel FP8
    (with the source's INT4 group, for an INT4 source) for channel-fp8."""
    if fmt == "bf16":
        return model.output(None)
    if int4 is not None:
        return model.output(int4_and_channel_fp8_config(int4, int4_targets or [], ignore))
    return model.output(channel_fp8_quantization_config(ignore))
