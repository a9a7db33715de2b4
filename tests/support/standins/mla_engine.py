"""Build and load upstream vLLM MLA layers in the order a vLLM engine does, on the stand-in of one
vLLM code base (codebases.py; tests only): per layer an unquantized `ColumnParallelLinear` kv_b_proj
and the code base's `MLAAttention`, the weights through their loader, then vLLM's
`process_weights_after_loading` (quant methods first, attention layers second); and a weight
reload as vLLM's layerwise reload does it (the new weights copied into the existing parameters,
then each layer's `process_weights_after_loading` again). hpu_engine.py does the same for
vllm-gaudi's layers.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import vllm_upstream
from torch import nn


def random_kv_b(layers: int, rows: int, cols: int, seed: int = 0) -> dict[int, torch.Tensor]:
    """{layer: fp32 kv_b_proj weight [rows, cols]}, N(0, 0.02^2) values."""
    gen = torch.Generator().manual_seed(seed)
    return {i: torch.randn(rows, cols, generator=gen) * 0.02 for i in range(layers)}


def perturbed(weights: dict[int, torch.Tensor], rel: float, seed: int = 1) -> dict[int, torch.Tensor]:
    """A sibling fine-tune's weights: each off by `rel` (relative Frobenius) in random directions."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i, x in weights.items():
        noise = torch.randn(x.shape, generator=gen)
        out[i] = x + noise * (rel * x.norm() / noise.norm())
    return out


def build_and_load(codebase, model_dir, served: dict[int, torch.Tensor], *, num_heads: int, kv_lora_rank: int = 512,
                   act_dtype: torch.dtype = torch.bfloat16, impl_cls=None, dcp_q_replicate: bool = False):  # fmt: skip
    """{layer index: MLAAttention} of `codebase` (a codebases.Codebase), kv_b_proj holding bf16(`served`)."""
    cls = codebase.mla_attention.MLAAttention
    if impl_cls is not None:
        cls = type(f"{cls.__name__}With{impl_cls.__name__}", (cls,), {"impl_cls": impl_cls})
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(model=None if model_dir is None else str(model_dir), hf_config=None),
        compilation_config=SimpleNamespace(static_forward_context={}),
    )
    model = nn.ModuleList()
    layers = {}
    for i, w in served.items():
        block = nn.Module()
        prefix = f"model.layers.{i}.self_attn"
        block.kv_b_proj = vllm_upstream.ColumnParallelLinear(kv_lora_rank, w.shape[0], prefix=f"{prefix}.kv_b_proj")
        block.kv_b_proj.weight.weight_loader(block.kv_b_proj.weight, w.to(torch.bfloat16))
        block.attn = cls(
            num_heads=num_heads, scale=1.0, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
            q_lora_rank=None, kv_lora_rank=kv_lora_rank, kv_b_proj=block.kv_b_proj,
            dcp_q_replicate=dcp_q_replicate, prefix=f"{prefix}.attn", vllm_config=vllm_config,
        )  # fmt: skip
        model.append(block)
        layers[i] = block.attn
    vllm_upstream.process_weights_after_loading(model, act_dtype)
    return layers


def reload(layers: dict, weights: dict[int, torch.Tensor], act_dtype: torch.dtype = torch.bfloat16) -> None:
    """vLLM's layerwise reload for these layers: kv_b_proj's new weights copied into its existing
    parameter (the original storage), then every layer's process_weights_after_loading again."""
    with torch.no_grad():
        for i, layer in layers.items():
            layer.kv_b_proj.weight.copy_(weights[i].to(torch.bfloat16))
    for layer in layers.values():
        layer.process_weights_after_loading(act_dtype)
