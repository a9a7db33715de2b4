"""Mistral-Large-4 served through the vllm 0.34.0 stand-in (tests/support/standins/vllm_034/
mistral_large4.py): every layer takes its W_UK_T / W_UV from the artifacts at that layer's shapes
(NoPE layers: qk_nope + qk_rope; KV-sharing layers: their own kv_b_proj), and a layer whose dims
disagree with the artifacts is refused with one line naming it, as any dims mismatch is (a failed
start, or with MLA_RUNTIME_FALLBACK=1 one warning and vLLM's values).

`serve(model_dir)` (tests/support/serving_034.py) takes any Mistral-native model directory (params.json, consolidated shards,
mla/): the tests build a tiny one here with the structure of the real geometry (every fourth layer
NoPE, later layers sharing an earlier layer's KV cache), written with the runtime's format pieces.
A converted demo output can be pointed at it as it is.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from mla_runtime import ArtifactError, plugin
from mla_runtime.artifacts import open_artifacts
from mla_runtime.format import MANIFEST_NAME, LayerEntry, MlaDims, MlaManifest, layer_file_name, w_uk_t_name, w_uv_name
from mla_runtime.layout import split_kv_b_proj
from support.serving_034 import assert_served_from_artifacts, serve

pytestmark = pytest.mark.parametrize("vllm_codebase", ["vllm 0.34.0"])

# Shrunk from the AMD kernels' geometry (H 64, kv_lora 512, rope 64, nope 64, v 128; layers 39, 43,
# ..., 71 sharing layer 35's KV): a NoPE layer every fourth, layer 11 sharing layer 7's (NoPE) and
# layer 10 sharing layer 9's (RoPE) cache.
HEADS, NOPE, ROPE, V, KV_LORA, HIDDEN, LAYERS = 4, 32, 16, 32, 64, 96, 12
PATTERN = "rope,rope,rope,nope"
SOURCES = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 7]
NOPE_LAYERS = {3, 7, 11}
MODEL_DIMS = MlaDims(num_heads=HEADS, qk_nope_head_dim=NOPE, v_head_dim=V, kv_lora_rank=KV_LORA)


def params_json(pattern: str = PATTERN, sources: list[int] = SOURCES) -> dict:
    """A Mistral-Large-4 params.json (a `dsa` block, MoE with shared experts, q_lora_rank null)."""
    return {
        "dim": HIDDEN, "n_layers": LAYERS, "n_heads": HEADS, "n_kv_heads": HEADS, "head_dim": NOPE + ROPE,
        "hidden_dim": 4 * HIDDEN, "norm_eps": 1e-6, "vocab_size": 256, "q_lora_rank": None,
        "kv_lora_rank": KV_LORA, "qk_nope_head_dim": NOPE, "qk_rope_head_dim": ROPE, "v_head_dim": V,
        "nope": pattern, "kv_sharing": {"source_layers_str": ",".join(map(str, sources))},
        "moe": {"num_experts": 4, "num_experts_per_tok": 2, "expert_hidden_dim": HIDDEN, "num_shared_experts": 1,
                "first_k_dense_replace": 1, "route_every_n": 1, "routed_scale": 1.0},
        "dsa": {"topk": 8, "n_heads": 2, "head_dim": 16, "norm_eps": 1e-6, "ssmax_scaling": True,
                "fp8_indexer": True, "nope": False, "sharing": "full,shared"},
    }  # fmt: skip


def dims_of(layer: int, nope_layers=NOPE_LAYERS) -> MlaDims:
    return replace(MODEL_DIMS, qk_nope_head_dim=NOPE + ROPE) if layer in nope_layers else MODEL_DIMS


def write_model(model_dir: Path, *, per_layer_dims: bool = True, rel_off: float = 2**-9, seed: int = 0) -> dict:
    """A tiny Mistral-Large-4 model directory: params.json, consolidated.safetensors (bf16 wkv_b of
    every layer at its dims, wkv_a_with_mqa of the non-sharing ones) and mla/ (the artifacts of the
    exact fp32 weights; the served wkv_b is `rel_off` off them, so vLLM's own values are other
    values). `per_layer_dims=False`: the manifest records no layer's own dims (one set for all).
    Returns {layer: the exact fp32 kv_b_proj}."""
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "params.json").write_text(json.dumps(params_json()))
    gen = torch.Generator().manual_seed(seed)
    exact, tensors = {}, {}
    for i in range(LAYERS):
        exact[i] = torch.randn(*dims_of(i).kv_b_shape(), generator=gen) * 0.02
        tensors[f"layers.{i}.attention.wkv_b.weight"] = (exact[i] * (1 + rel_off)).to(torch.bfloat16)
        if SOURCES[i] == i:
            rows = KV_LORA + (0 if i in NOPE_LAYERS else ROPE)
            tensors[f"layers.{i}.attention.wkv_a_with_mqa.weight"] = torch.zeros(rows, HIDDEN, dtype=torch.bfloat16)
        tensors[f"layers.{i}.attention.wq.weight"] = torch.zeros(HEADS * (NOPE + ROPE), HIDDEN, dtype=torch.bfloat16)
    tensors["mtp_dspark.backbone.layers.0.attention.wkv_b.weight"] = torch.zeros(1, 1, dtype=torch.bfloat16)
    save_file(tensors, str(model_dir / "consolidated.safetensors"))
    mla = model_dir / "mla"
    mla.mkdir()
    entries = []
    for i in range(LAYERS):
        w_uk_t, w_uv = split_kv_b_proj(exact[i], dims_of(i))
        path = mla / layer_file_name(i)
        save_file({w_uk_t_name(i): w_uk_t, w_uv_name(i): w_uv}, str(path))
        data = path.read_bytes()
        own = {"qk_nope_head_dim": NOPE + ROPE} if per_layer_dims and i in NOPE_LAYERS else None
        entries.append(LayerEntry(i, path.name, len(data), hashlib.sha256(data).hexdigest(), own))
    manifest = MlaManifest(dims=MODEL_DIMS, layers=tuple(entries), source_fingerprint="f" * 64)
    (mla / MANIFEST_NAME).write_text(manifest.to_json())
    return exact


def plugin_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("mla_runtime:")]


# --------------------------------------------------------------------------- served


@pytest.mark.parametrize("served_by", ["path", "hub id"])
@pytest.mark.parametrize("rel_off", [2**-9, 0.0], ids=["other values", "the artifacts' bf16"])
def test_every_layer_is_served_from_the_artifacts_at_its_own_shapes(v034, tmp_path, monkeypatch, caplog, served_by,
                                                                    rel_off):  # fmt: skip
    """NoPE layers (3, 7, 11: W_UK_T [H, nope + rope, L]), KV-sharing layers (10, 11: no
    kv_a_proj_with_mqa, their own kv_b_proj) and RoPE layers all take the artifacts' values; by path
    the plugin checks params.json's pattern, by Hub id vLLM's adapted config (nope_layer_flags).
    kv_b_proj is bf16 in both output formats (vLLM keeps it unquantized): where its values are the
    artifacts' (rel_off 0) vLLM's views of it stay; otherwise new storage, kv_b_proj never written."""
    exact = write_model(tmp_path, rel_off=rel_off)
    monkeypatch.setenv("MLA_RUNTIME_DISABLE", "1")
    off = serve(v034, tmp_path)
    monkeypatch.delenv("MLA_RUNTIME_DISABLE")
    hub = {}
    if served_by == "hub id":
        monkeypatch.setenv("MLA_RUNTIME_DIR", str(tmp_path / "mla"))
        hub = {"hub_id": "mistralai/Mistral-Large-4-tiny"}
    with caplog.at_level(logging.INFO, logger="vllm.mla_runtime"):
        on = serve(v034, tmp_path, **hub)
    assert_served_from_artifacts(on, tmp_path)
    for i in range(LAYERS):
        assert torch.equal(off[i].W_UK_T, on[i].W_UK_T) == (rel_off == 0)  # vLLM's own, other values or not
        assert torch.equal(on[i].kv_b_proj.weight, (exact[i] * (1 + rel_off)).to(torch.bfloat16))  # untouched
    blocks = on.model.model.layers
    assert [hasattr(b.self_attn, "kv_a_proj_with_mqa") for b in blocks] == [s == i for i, s in enumerate(SOURCES)]
    summary = plugin.summary()[0]
    assert summary["loaded"] == summary["spot_checked"] == LAYERS
    assert summary["placed"] == ({"equal": LAYERS} if rel_off == 0 else {"new storage": LAYERS})
    summary_lines = [line for line in plugin_lines(caplog) if "loaded W_UK_T/W_UV of" in line]
    assert len(summary_lines) == 1 and f"of {LAYERS}/{LAYERS} MLA layers" in summary_lines[0], summary_lines


def test_the_loader_checks_each_layers_file_at_its_dims(v034, tmp_path):
    write_model(tmp_path)
    arts = open_artifacts(tmp_path / "mla", model_dir=tmp_path)
    for i in range(LAYERS):
        d = dims_of(i)
        assert arts.dims_of(i) == d
        arts.check_served_dims(layer=i, num_heads=HEADS, tp_size=1, qk_nope_head_dim=d.qk_nope_head_dim,
                               v_head_dim=V, kv_lora_rank=KV_LORA)  # fmt: skip
        for rank in range(2):
            w_uk_t, w_uv = arts.load_layer(i, tp_rank=rank, tp_size=2)
            assert tuple(w_uk_t.shape) == (HEADS // 2, d.qk_nope_head_dim, KV_LORA)
            assert tuple(w_uv.shape) == (HEADS // 2, KV_LORA, V)
    with pytest.raises(ArtifactError, match=r"layer 3 .*qk_nope_head_dim=32, the artifacts 48"):
        arts.check_served_dims(layer=3, num_heads=HEADS, tp_size=1, qk_nope_head_dim=NOPE, v_head_dim=V,
                               kv_lora_rank=KV_LORA)  # fmt: skip


# --------------------------------------------------------------------------- refused


def test_artifacts_with_one_set_of_dims_are_refused_naming_the_nope_layers(v034, tmp_path, monkeypatch, caplog):
    """A manifest that records no layer's own dims (every layer at the RoPE layers' qk_nope) for a
    model with NoPE layers: the start fails with one line naming those layers; with
    MLA_RUNTIME_FALLBACK=1, one warning and vLLM's values on every layer."""
    write_model(tmp_path, per_layer_dims=False)
    with pytest.raises(ArtifactError) as e:
        serve(v034, tmp_path)
    line = str(e.value)
    assert "MLA dims differ from the served model's config (qk_nope_head_dim: served 48 vs artifacts 32)" in line
    assert line.endswith("on layers 3, 7, 11") and "\n" not in line

    plugin.reset()
    monkeypatch.setenv("MLA_RUNTIME_FALLBACK", "1")
    monkeypatch.setenv("MLA_RUNTIME_DISABLE", "1")
    off = serve(v034, tmp_path)
    monkeypatch.delenv("MLA_RUNTIME_DISABLE")
    with caplog.at_level(logging.INFO, logger="vllm.mla_runtime"):
        on = serve(v034, tmp_path)
    for i in range(LAYERS):
        assert torch.equal(on[i].W_UK_T, off[i].W_UK_T) and torch.equal(on[i].W_UV, off[i].W_UV)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "on layers 3, 7, 11" in warnings[0].getMessage()
    assert plugin.summary()[0]["fallback"] == LAYERS


def test_a_served_pattern_other_than_the_artifacts_is_refused(v034, tmp_path):
    """The artifacts of a model whose NoPE layers are 3, 7, 11, served under a params.json whose
    pattern makes 1, 3, 5, ... NoPE: the layers whose dims differ are named."""
    write_model(tmp_path)
    other = params_json(pattern="rope,nope", sources=list(range(LAYERS)))
    with pytest.raises(ArtifactError, match=r"qk_nope_head_dim: served 48 vs artifacts 32\) on layers 1, 5, 9"):
        open_artifacts(tmp_path / "mla", model_config=other)


def test_a_layers_served_dims_are_checked_where_no_config_is_seen(v034, tmp_path, monkeypatch):
    """Served from $MLA_RUNTIME_DIR with no config to check first (a Hub id vLLM gives no
    hf_config of): each layer's own check refuses the NoPE layer's served qk_nope_head_dim."""
    write_model(tmp_path, per_layer_dims=False)
    monkeypatch.setenv("MLA_RUNTIME_DIR", str(tmp_path / "mla"))
    monkeypatch.setattr(importlib.import_module("mla_engine"), "HfConfig", dict)  # a config without to_dict()
    with pytest.raises(ArtifactError, match=r"^layer 3 \(.*layer-003.safetensors\): the served model has "
                                            r"qk_nope_head_dim=48, the artifacts 32$"):  # fmt: skip
        serve(v034, tmp_path, hub_id="mistralai/Mistral-Large-4-tiny")
