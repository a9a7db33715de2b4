"""Build and load upstream vLLM MLA layers in the order a vLLM engine does, on the stand-in of one
vLLM code base (codebases.py; tests only): per layer an unquantized `ColumnParallelLinear` kv_b_proj
and the code base's `MLAAttention`, the weights through their loader, then vLLM's
`process_weights_after_loading` (quant methods first, attention layers second); and a weight
reload as vLLM's layerwise reload does it (the new weights copied into the existing parameters,
then each layer's `process_weights_after_loading` again). hpu_engine.py does the same for
vllm-gaudi's layers.

From vllm 0.34.0 on (a code base with `loader`), as that vLLM does it: the model is built under the
activation dtype as the default dtype (MLAAttention reads `act_dtype` from it), its reload metadata
recorded, and post-processed by the code base's `process_weights_after_loading(model, ...)` (quant
methods, then `finalize_model_weights`: every hook with no argument, children first); a reload goes
through the code base's reload (layerwise, direct with `VLLM_RELOAD_MODE=direct`, or kernel format).
`build_mistral_large4` builds a Mistral-native model directory as vllm 0.34.0's
MistralLarge4ForCausalLM (vllm_034/mistral_large4.py) and loads it the same way.
"""

from __future__ import annotations

import contextlib
import importlib
import json
from pathlib import Path
from types import SimpleNamespace

import torch
import vllm_upstream
from safetensors import safe_open
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


class Layers(dict):
    """{layer index: MLAAttention}, with the model they belong to (`.model`) and its code base."""

    model: nn.Module
    codebase: object


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def vllm_config_for(model_dir, dcp_comm_backend: str = "ag_rs"):
    return SimpleNamespace(
        model_config=SimpleNamespace(model=None if model_dir is None else str(model_dir), hf_config=None),
        compilation_config=SimpleNamespace(static_forward_context={}),
        parallel_config=SimpleNamespace(dcp_comm_backend=dcp_comm_backend),
    )


def build_and_load(codebase, model_dir, served: dict[int, torch.Tensor], *, num_heads: int, kv_lora_rank: int = 512,
                   act_dtype: torch.dtype = torch.bfloat16, impl_cls=None, dcp_q_replicate: bool = False,
                   dcp_a2a_ranks: int = 1):  # fmt: skip
    """{layer index: MLAAttention} of `codebase` (a codebases.Codebase), kv_b_proj holding bf16(`served`).
    `dcp_a2a_ranks` > 1 (vllm 0.34.0): DCP over that many ranks with the A2A combine (W_UV_dcp)."""
    cls = codebase.mla_attention.MLAAttention
    if impl_cls is not None:
        cls = type(f"{cls.__name__}With{impl_cls.__name__}", (cls,), {"impl_cls": impl_cls})
    if dcp_a2a_ranks > 1:
        if not hasattr(codebase.mla_attention, "_DCP_WORLD_SIZE"):
            raise ValueError(f"{codebase.name}: the stand-in has no W_UV_dcp")
        cls = type(f"{cls.__name__}WithDcp", (cls,), {"impl_cls": _dcp_impl(cls.impl_cls, dcp_a2a_ranks)})
    if hasattr(codebase.mla_attention, "_DCP_WORLD_SIZE"):
        codebase.mla_attention._DCP_WORLD_SIZE = dcp_a2a_ranks
    vllm_config = vllm_config_for(model_dir, "a2a" if dcp_a2a_ranks > 1 else "ag_rs")
    if codebase.loader is not None:
        with default_dtype(act_dtype):
            model, layers = _build(cls, served, kv_lora_rank, num_heads, dcp_q_replicate, vllm_config)
        codebase.loader.initialize_model_done(model)
        _load(model, served)
        codebase.loader.process_weights_after_loading(model, vllm_config.model_config, torch.device("cpu"))
    else:
        model, layers = _build(cls, served, kv_lora_rank, num_heads, dcp_q_replicate, vllm_config)
        _load(model, served)
        vllm_upstream.process_weights_after_loading(model, act_dtype)
    out = Layers(layers)
    out.model, out.codebase = model, codebase
    return out


def _dcp_impl(base, ranks: int):
    return type(f"{base.__name__}Dcp{ranks}", (base,), {"dcp_world_size": ranks})


def _build(cls, served, kv_lora_rank, num_heads, dcp_q_replicate, vllm_config):
    model = nn.ModuleList()
    layers = {}
    for i, w in served.items():
        block = nn.Module()
        prefix = f"model.layers.{i}.self_attn"
        block.kv_b_proj = vllm_upstream.ColumnParallelLinear(kv_lora_rank, w.shape[0], prefix=f"{prefix}.kv_b_proj")
        block.attn = cls(
            num_heads=num_heads, scale=1.0, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
            q_lora_rank=None, kv_lora_rank=kv_lora_rank, kv_b_proj=block.kv_b_proj,
            dcp_q_replicate=dcp_q_replicate, prefix=f"{prefix}.attn", vllm_config=vllm_config,
        )  # fmt: skip
        model.append(block)
        layers[i] = block.attn
    return model, layers


def _load(model: nn.Module, served: dict[int, torch.Tensor]) -> None:
    for block, w in zip(model, served.values(), strict=True):
        block.kv_b_proj.weight.weight_loader(block.kv_b_proj.weight, w.to(torch.bfloat16))


def reload(layers: dict, weights: dict[int, torch.Tensor], act_dtype: torch.dtype = torch.bfloat16,
           kernel_format: bool = False) -> None:  # fmt: skip
    """vLLM's layerwise reload for these layers: kv_b_proj's new weights copied into its existing
    parameter (the original storage), then every layer's process_weights_after_loading again.
    On vllm 0.34.0: the code base's reload of the whole model (the mode $VLLM_RELOAD_MODE names,
    or with `kernel_format` the weights copied by name and finalize_model_weights run)."""
    codebase = getattr(layers, "codebase", None)
    if codebase is not None and codebase.reload is not None:
        names = {f"{pos}.kv_b_proj.weight": weights[i].to(torch.bfloat16) for pos, i in enumerate(layers)}
        codebase.reload.reload_weights(layers.model, names, is_checkpoint_format=not kernel_format)
        return
    with torch.no_grad():
        for i, layer in layers.items():
            layer.kv_b_proj.weight.copy_(weights[i].to(torch.bfloat16))
    for layer in layers.values():
        layer.process_weights_after_loading(act_dtype)


class HfConfig(dict):
    """The hf_config vLLM hands its model: here the adapted params.json, with `to_dict()` as a
    PreTrainedConfig has (what the plugin reads for a model served by Hub id)."""

    def to_dict(self) -> dict:
        return dict(self)


def build_mistral_large4(codebase, model_dir, *, hub_id: str | None = None, act_dtype: torch.dtype = torch.bfloat16):
    """{layer index: MLAAttention} of vllm 0.34.0's MistralLarge4ForCausalLM built from the Mistral-native
    model in `model_dir` (params.json, consolidated*.safetensors; a converted output or a test's own),
    loaded and post-processed as that vLLM does. `hub_id`: served by that id (vLLM's model_config.model)
    rather than by the directory's path."""
    large4 = importlib.import_module(f"{codebase.mla_attention.__package__}.mistral_large4")
    model_dir = Path(model_dir)
    config = HfConfig(large4.adapt_config_dict(json.loads((model_dir / "params.json").read_text())))
    vllm_config = vllm_config_for(hub_id or model_dir)
    vllm_config.model_config.hf_config = config
    with default_dtype(act_dtype):
        model = large4.MistralLarge4ForCausalLM(vllm_config=vllm_config)
    codebase.loader.initialize_model_done(model)

    def weights():
        for shard in sorted(model_dir.glob("consolidated*.safetensors")):
            with safe_open(str(shard), "pt") as f:
                for name in f.keys():  # noqa: SIM118
                    yield name, f.get_tensor(name)

    model.load_weights(weights())
    codebase.loader.process_weights_after_loading(model, vllm_config.model_config, torch.device("cpu"))
    out = Layers({i: block.self_attn.attn for i, block in enumerate(model.model.layers)})
    out.model, out.codebase = model, codebase
    return out
