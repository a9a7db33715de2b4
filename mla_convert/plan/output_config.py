"""config.json of the converted model: bf16, or compressed-tensors channel FP8."""

from __future__ import annotations

import copy


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


def output_config(source_config: dict, fmt: str, ignore: list[str]) -> dict:
    """The source's config (architectures, model_type, auto_map and all) with the source's own
    quantization_config replaced: none for bf16, compressed-tensors for channel FP8."""
    cfg = copy.deepcopy(source_config)
    if fmt == "bf16":
        cfg.pop("quantization_config", None)
    else:
        cfg["quantization_config"] = channel_fp8_quantization_config(ignore)
    cfg["torch_dtype"] = "bfloat16"
    if "dtype" in cfg:
        cfg["dtype"] = "bfloat16"
    return cfg
