"""config.json of the converted model: bf16, or compressed-tensors channel FP8."""

from __future__ import annotations

import copy

FP8_FLAVOR_GAUDI2 = "float8_e4m3fnuz"


def channel_fp8_quantization_config(ignore: list[str], target: str) -> dict:
    """The compressed-tensors config vLLM and vllm-gaudi load as channel FP8 without conversion.

    Weights: static symmetric per-channel e4m3 (`X.weight` + float32 `X.weight_scale` [N, 1]).
    Activations: dynamic per-token FP8. `ignore` lists the linear modules left unquantized.
    """
    qc = {
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
    if target == "gaudi2":
        # Values already fit the Gaudi2 e4m3 range (+-240): tells vllm-gaudi not to rescale them
        # again (domain-facts §3; not verified on hardware).
        qc["fp8_dtype_flavor"] = FP8_FLAVOR_GAUDI2
    return qc


def output_config(source_config: dict, fmt: str, target: str, ignore: list[str]) -> dict:
    cfg = copy.deepcopy(source_config)
    if fmt == "bf16":
        cfg.pop("quantization_config", None)
    else:
        cfg["quantization_config"] = channel_fp8_quantization_config(ignore, target)
    cfg["torch_dtype"] = "bfloat16"
    if "dtype" in cfg:
        cfg["dtype"] = "bfloat16"
    return cfg
