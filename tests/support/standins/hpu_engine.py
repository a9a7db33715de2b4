"""Build and load MLA layers as a vLLM engine on vllm-gaudi does, in the same order, from the
stand-ins in this folder (tests and scripts/accuracy_runtime.py; see README.md):

1. engine configuration: the quantization config is built from config.json's `quantization_config`
   (`HPUCompressedTensorsConfig.from_config` / `Fp8Config.from_config`); this is where vllm-gaudi
   reads `fp8_dtype_flavor`;
2. the worker creates its `HPUModelRunner`, whose init runs `clear_config(); finalize_config()`;
3. the model is built: per layer a `ColumnParallelLinear` kv_b_proj holding this rank's rows, its
   parameters made by the quant config's linear method, and an `HPUMLAAttention`;
4. each checkpoint tensor goes through its parameter's `weight_loader` (on Gaudi2, the scale-
   adjustment wrapper);
5. vLLM's `process_weights_after_loading`: every quant method (kv_b_proj's linear method, the MLA
   layer's KV-cache method), then every attention layer (where mla_runtime's wrappers run).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

# vLLM module names that vllm-gaudi and mla_runtime import from (codebases.py points them at a stand-in).
VLLM_MODULE_NAMES = (
    "vllm.model_executor.layers.attention.mla_attention",
    "vllm.model_executor.layers.attention",
    "vllm.model_executor.layers.attention.attention",
    "vllm.model_executor.utils",
)


def vllm_module_names(codebase: str | None = None) -> dict:
    """{vLLM module name: its stand-in in `codebase` (default: vLLM 0.32.0)}, for sys.modules."""
    import codebases

    return codebases.load(codebase or codebases.DEFAULT).vllm_modules()


@dataclass(frozen=True)
class MlaShape:
    num_heads: int  # all ranks together
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64


@dataclass
class LoadedModel:
    model: nn.Module
    layers: dict[int, nn.Module]  # decoder layer index -> HPUMLAAttention
    vllm_config: SimpleNamespace
    scale_adjustment_after_quant_config: bool | None = None
    scale_adjustment_at_load: bool | None = None
    runner: object = field(default=None, repr=False)


def quant_config_from(quantization_config: dict | None):
    """What vLLM's engine configuration builds from config.json's quantization_config."""
    if quantization_config is None:
        return None
    method = quantization_config.get("quant_method")
    if method == "compressed-tensors":
        from vllm_gaudi.ops.hpu_compressed_tensors import HPUCompressedTensorsConfig

        return HPUCompressedTensorsConfig.from_config(quantization_config)
    if method == "fp8":
        from vllm_upstream import Fp8Config

        return Fp8Config.from_config(quantization_config)
    raise NotImplementedError(f"stand-in: quant_method {method!r}")


def build_and_load(model_dir: str | Path | None, quantization_config: dict | None,
                   kv_b: dict[int, dict[str, torch.Tensor]], shape: MlaShape, *, tp_rank: int = 0,
                   tp_size: int = 1, act_dtype: torch.dtype = torch.bfloat16,
                   device: str | torch.device = "cpu", prefix: str = "model") -> LoadedModel:  # fmt: skip
    """Steps 1-5 of the module docstring for the layers in `kv_b` ({layer: {tensor suffix: full
    checkpoint tensor}}, e.g. {"weight": ..., "weight_scale_inv": ...}). `prefix`: the text model's
    module path (vLLM's `language_model.model` inside a multimodal wrapper)."""
    from vllm_gaudi.attention.oot_mla import HPUMLAAttention
    from vllm_gaudi.extension.runtime import get_config
    from vllm_gaudi.v1.worker.hpu_model_runner import HPUModelRunner
    from vllm_upstream import ColumnParallelLinear, process_weights_after_loading

    quant_config = quant_config_from(quantization_config)
    adjustment_after_config = get_config().scale_adjustment
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(model=None if model_dir is None else str(model_dir), hf_config=None),
        compilation_config=SimpleNamespace(static_forward_context={}),
        quant_config=quant_config,
    )
    runner = HPUModelRunner(vllm_config)

    model = nn.Module()
    model.layers = nn.ModuleList()
    layers = {}
    per_head = shape.qk_nope_head_dim + shape.v_head_dim
    with torch.device(device):
        for index in sorted(kv_b):
            attn = f"{prefix}.layers.{index}.self_attn"
            block = nn.Module()
            block.kv_b_proj = ColumnParallelLinear(
                shape.kv_lora_rank, shape.num_heads * per_head, quant_config=quant_config,
                prefix=f"{attn}.kv_b_proj", params_dtype=act_dtype, tp_rank=tp_rank, tp_size=tp_size,
            )  # fmt: skip
            block.attn = HPUMLAAttention(
                num_heads=shape.num_heads // tp_size, scale=1.0, qk_nope_head_dim=shape.qk_nope_head_dim,
                qk_rope_head_dim=shape.qk_rope_head_dim, v_head_dim=shape.v_head_dim, q_lora_rank=None,
                kv_lora_rank=shape.kv_lora_rank, kv_b_proj=block.kv_b_proj, quant_config=quant_config,
                prefix=f"{attn}.attn", vllm_config=vllm_config,
            )  # fmt: skip
            model.layers.append(block)
            layers[index] = block.attn

    adjustment_at_load = get_config().scale_adjustment
    for index, tensors in kv_b.items():
        linear = layers[index].kv_b_proj
        for suffix, tensor in tensors.items():
            param = getattr(linear, suffix)
            param.weight_loader(param, tensor)

    process_weights_after_loading(model, act_dtype)
    return LoadedModel(model, layers, vllm_config, adjustment_after_config, adjustment_at_load, runner)


def install(modules: dict | None = None, setitem=None, codebase: str | None = None) -> None:
    """Point the vLLM module names at the stand-in of `codebase` (or at `modules`):
    `setitem(sys.modules, name, module)`; default: set them."""
    for name, module in (modules or vllm_module_names(codebase)).items():
        if setitem is None:
            sys.modules[name] = module
        else:
            setitem(sys.modules, name, module)
