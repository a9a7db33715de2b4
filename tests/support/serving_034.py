"""Mistral-Large-4 served through the vllm 0.34.0 stand-in (tests/support/standins/vllm_034/):
`serve` builds vLLM's MistralLarge4ForCausalLM over a model directory, `assert_served_from_artifacts`
checks every layer took its W_UK_T / W_UV from the directory's mla/ at that layer's shapes. Tests
take the `v034` fixture (tests/conftest.py: the stand-in with the plugin registered) and pass it here."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import torch

from support.artifacts import read_artifacts


def serve(codebase, model_dir: Path, **kwargs):
    """{layer: MLAAttention} of vLLM 0.34's MistralLarge4ForCausalLM serving `model_dir`."""
    return importlib.import_module("mla_engine").build_mistral_large4(codebase, model_dir, **kwargs)


def assert_served_from_artifacts(layers, model_dir: Path) -> None:
    params = json.loads((model_dir / "params.json").read_text())
    nope = params["nope"].split(",")
    for i, layer in layers.items():
        a_uk_t, a_uv = read_artifacts(model_dir / "mla", i)
        p = params["qk_nope_head_dim"] + (params["qk_rope_head_dim"] if nope[i % len(nope)] == "nope" else 0)
        assert layer.qk_nope_head_dim == p and tuple(a_uk_t.shape) == (params["n_heads"], p, params["kv_lora_rank"])
        assert torch.equal(layer.W_UK_T, a_uk_t) and torch.equal(layer.W_UV, a_uv), f"layer {i}"
        assert layer.kv_b_proj.quant_method.__class__.__name__ == "UnquantizedLinearMethod"
