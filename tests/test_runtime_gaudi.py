"""The plugin on vllm-gaudi's HPUMLAAttention, without Gaudi: against a stand-in (tests/support/standins/)
that follows the documented process_weights_after_loading of vllm_gaudi.attention.oot_mla.

For FP8 kv_b_proj with block (2-D) and channel (1-D) `weight_scale_inv`, a layer processed with
the plugin must hold the same W_UK_T / W_UV as the same layer processed by the documented code, keep
its quant-scale handling, and hold them on the device of its weights.
"""

from __future__ import annotations

import importlib
import logging
import math
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from mla_runtime import ArtifactError, plugin
from mla_runtime.format import MlaDims
from support.artifacts import any_scales, block_dequant_fp32, fp8_weight, pow2_scales, write_artifacts

DIMS = MlaDims(num_heads=8, qk_nope_head_dim=128, v_head_dim=128, kv_lora_rank=512)
ROWS = DIMS.num_heads * (DIMS.qk_nope_head_dim + DIMS.v_head_dim)  # 2048
L = DIMS.kv_lora_rank
QUANT_SCALE_MODULE = "vllm.model_executor.layers.attention.attention"


class _QuantizedMethod:
    """A quant method for which should_load_quant_weights() is true (kv-cache scales come from the checkpoint)."""


class _QuantConfig:
    def __init__(self, method):
        self.method = method
        self.calls = []

    def get_quant_method(self, layer, prefix=""):
        self.calls.append(prefix)
        return self.method


def _standin_quant_scale_module() -> types.ModuleType:
    """Stand-in for vllm.model_executor.layers.attention.attention's two helpers, from their documented
    behaviour: quantized weights are loaded for any method but none/unquantized; the defaults are 1.0."""
    mod = types.ModuleType(QUANT_SCALE_MODULE)

    def should_load_quant_weights(quant_method) -> bool:
        # The string "unquantized" stands for UnquantizedLinearMethod.
        return quant_method is not None and not isinstance(quant_method, str)

    def set_default_quant_scales(layer, register_buffer=False):
        assert register_buffer is False
        for name in ("_k_scale", "_v_scale", "_q_scale", "_prob_scale"):
            getattr(layer, name).fill_(1.0)
        layer._q_scale_float = layer._k_scale_float = layer._v_scale_float = layer._prob_scale_float = 1.0
        layer.default_scales_set = getattr(layer, "default_scales_set", 0) + 1

    mod.should_load_quant_weights = should_load_quant_weights
    mod.set_default_quant_scales = set_default_quant_scales
    return mod


@pytest.fixture
def gaudi(monkeypatch, vllm_gaudi_standin):
    """The stand-in oot_mla module, imported fresh after plugin.register() (so the post-import hook wraps it)."""
    monkeypatch.setitem(sys.modules, QUANT_SCALE_MODULE, _standin_quant_scale_module())
    for var in (
        "MLA_RUNTIME_DIR",
        "MLA_RUNTIME_DISABLE",
        "MLA_RUNTIME_FALLBACK",
        "MLA_RUNTIME_VERIFY",
        "MLA_RUNTIME_CHECK",
    ):
        monkeypatch.delenv(var, raising=False)
    plugin.reset()
    plugin.register()
    mod = importlib.import_module("vllm_gaudi.attention.oot_mla")
    yield mod
    plugin.reset()


def make_kv_b_proj(kind: str, gen: torch.Generator, scales=pow2_scales, heads=slice(0, 8), device="cpu"):
    """(kv_b_proj module holding `heads` of an 8-head weight, exact fp32 dequant of all 8 heads).

    kind: block (2-D weight_scale_inv + weight_block_size), channel (1-D weight_scale_inv), bf16.
    """
    w = fp8_weight((ROWS, L), gen)
    kv_b = nn.Module()
    scale = None
    if kind == "block":
        scale = scales((math.ceil(ROWS / 128), math.ceil(L / 128)), gen)
        exact = block_dequant_fp32(w, scale)
        kv_b.weight_block_size = [128, 128]
    elif kind == "channel":
        scale = scales((ROWS,), gen)
        exact = w.float() * scale[:, None]
    else:
        exact = w.float() * 1e-3
        w = exact.to(torch.bfloat16)
    per_head = DIMS.qk_nope_head_dim + DIMS.v_head_dim
    rows = slice(heads.start * per_head, heads.stop * per_head)  # whole 128-row blocks here
    kv_b.weight = nn.Parameter(w[rows].to(device), requires_grad=False)
    if kind == "block":
        kv_b.weight_scale_inv = scale[rows.start // 128 : rows.stop // 128].to(device)
    elif kind == "channel":
        kv_b.weight_scale_inv = scale[rows].to(device)
    return kv_b, exact


def make_layer(mod, kv_b, index: int, model_dir: Path, ctx: dict, quant_config=None, num_heads=DIMS.num_heads):
    name = f"model.layers.{index}.self_attn.attn"
    layer = mod.HPUMLAAttention(
        num_heads=num_heads, qk_nope_head_dim=DIMS.qk_nope_head_dim, v_head_dim=DIMS.v_head_dim,
        kv_lora_rank=L, kv_b_proj=kv_b, quant_config=quant_config, prefix=name,
    )  # fmt: skip
    layer._vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(model=str(model_dir), hf_config=None),
        compilation_config=SimpleNamespace(static_forward_context=ctx),
    )
    ctx[name] = layer
    return layer


def documented(mod, kv_b, quant_config=None, num_heads=DIMS.num_heads):
    """The same layer processed by the stand-in's own (documented) method, plugin bypassed."""
    layer = mod.HPUMLAAttention(
        num_heads=num_heads, qk_nope_head_dim=DIMS.qk_nope_head_dim, v_head_dim=DIMS.v_head_dim,
        kv_lora_rank=L, kv_b_proj=kv_b, quant_config=quant_config, prefix="documented",
    )  # fmt: skip
    mod.HPUMLAAttention.process_weights_after_loading.__wrapped__(layer, torch.bfloat16)
    return layer


def served_model(tmp_path: Path, exact: dict[int, torch.Tensor]) -> Path:
    model_dir = tmp_path / "model"
    write_artifacts(model_dir / "mla", exact, DIMS)
    return model_dir


def count_block_dequant_calls(monkeypatch) -> list:
    ops = importlib.import_module("vllm_gaudi.extension.ops")
    calls = []
    real = ops.dequant_block_fp8_weight_naive

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(ops, "dequant_block_fp8_weight_naive", spy)
    return calls


@pytest.mark.parametrize("kind", ["block", "channel"])
@pytest.mark.parametrize("quantized_kv_cache", [False, True])
def test_wrapper_gives_the_documented_weights_and_quant_scales(gaudi, tmp_path, monkeypatch, caplog, kind,
                                                               quantized_kv_cache):  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    kv_bs = {i: make_kv_b_proj(kind, gen) for i in (0, 1)}
    model_dir = served_model(tmp_path, {i: exact for i, (_, exact) in kv_bs.items()})
    method = _QuantizedMethod() if quantized_kv_cache else "unquantized"
    ctx: dict = {}
    layers = [make_layer(gaudi, kv_bs[i][0], i, model_dir, ctx, _QuantConfig(method)) for i in (0, 1)]
    dequant_calls = count_block_dequant_calls(monkeypatch)

    with caplog.at_level(logging.INFO, logger="vllm.mla_runtime"):
        for layer in layers:
            layer.process_weights_after_loading(torch.bfloat16)
    assert dequant_calls == []  # nothing was dequantized: the weights came from the artifacts

    for i, layer in enumerate(layers):
        ref = documented(gaudi, kv_bs[i][0], _QuantConfig(method))
        # Power-of-two scales are exact in bf16, so the documented bf16 dequant is exact too.
        assert torch.equal(layer.W_UK_T, ref.W_UK_T) and torch.equal(layer.W_UV, ref.W_UV)
        assert layer.W_UK_T.shape == (8, 128, 512) and layer.W_UV.shape == (8, 512, 128)
        assert layer.W_UK_T.is_contiguous() and layer.W_UV.is_contiguous()
        assert layer.W_UK_T.dtype == layer.W_UV.dtype == torch.bfloat16
        # Quant scales: the same as the documented path, which asked the quant config for this layer.
        assert layer.quant_config.calls == [layer.layer_name]
        want = 7.0 if quantized_kv_cache else 1.0
        for name in ("_k_scale", "_v_scale", "_q_scale", "_prob_scale"):
            assert getattr(layer, name).item() == getattr(ref, name).item() == want
        assert (
            getattr(layer, "default_scales_set", 0)
            == getattr(ref, "default_scales_set", 0)
            == (0 if quantized_kv_cache else 1)
        )

    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("mla_runtime:")]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"mla_runtime: loaded W_UK_T/W_UV of 2/2 MLA layers from {model_dir / 'mla'}")
    assert "2 spot-checked against kv_b_proj" in lines[0]


@pytest.mark.parametrize("kind", ["block", "channel"])
def test_full_precision_scales_artifacts_are_the_exact_dequant(gaudi, tmp_path, kind):
    """With fp32 scales the documented path rounds each scale to bf16 first; the artifacts hold the exact
    fp32 dequant rounded once. They agree to bf16 precision, not bit for bit."""
    gen = torch.Generator().manual_seed(2)
    kv_b, exact = make_kv_b_proj(kind, gen, scales=any_scales)
    model_dir = served_model(tmp_path, {5: exact})
    layer = make_layer(gaudi, kv_b, 5, model_dir, {})
    layer.process_weights_after_loading(torch.bfloat16)
    ref = documented(gaudi, kv_b)
    exact_bf16 = exact.to(torch.bfloat16).view(8, 256, L)
    assert torch.equal(layer.W_UK_T, exact_bf16[:, :128, :])
    assert torch.equal(layer.W_UV, exact_bf16[:, 128:, :].transpose(1, 2))
    torch.testing.assert_close(layer.W_UK_T.float(), ref.W_UK_T.float(), rtol=2**-7, atol=0)
    torch.testing.assert_close(layer.W_UV.float(), ref.W_UV.float(), rtol=2**-7, atol=0)
    assert not torch.equal(layer.W_UK_T, ref.W_UK_T)  # the test is sensitive to the difference


def test_tensors_land_on_the_device_of_the_layer_weights(gaudi, tmp_path):
    gen = torch.Generator().manual_seed(3)
    devices = ["meta"] + (["cuda"] if torch.cuda.is_available() else [])
    for i, device in enumerate(devices):
        kv_b, exact = make_kv_b_proj("block", gen, device=device)
        model_dir = served_model(tmp_path / device, {i: exact})
        layer = make_layer(gaudi, kv_b, i, model_dir, {})
        layer.process_weights_after_loading(torch.bfloat16)
        assert layer.W_UK_T.device == layer.W_UV.device == kv_b.weight.device
        assert layer.W_UK_T.shape == (8, 128, 512) and layer.W_UK_T.is_contiguous()


def test_tensor_parallel_rank_gets_its_heads(gaudi, tmp_path, monkeypatch):
    gen = torch.Generator().manual_seed(4)
    rank, size = 1, 2
    monkeypatch.setattr(plugin, "_tp_rank_size", lambda: (rank, size))
    kv_b_local, exact = make_kv_b_proj("block", gen, heads=slice(4, 8))
    model_dir = served_model(tmp_path, {2: exact})
    layer = make_layer(gaudi, kv_b_local, 2, model_dir, {}, num_heads=4)
    layer.process_weights_after_loading(torch.bfloat16)
    ref = documented(gaudi, kv_b_local, num_heads=4)
    assert layer.W_UK_T.shape == (4, 128, 512)
    assert torch.equal(layer.W_UK_T, ref.W_UK_T) and torch.equal(layer.W_UV, ref.W_UV)
    assert plugin.summary()[0]["tp_rank"] == 1 and plugin.summary()[0]["tp_size"] == 2


def test_artifacts_of_another_checkpoint_are_refused_or_fall_back(gaudi, tmp_path, monkeypatch, caplog):
    gen = torch.Generator().manual_seed(5)
    kv_b, _ = make_kv_b_proj("channel", gen)
    _, other = make_kv_b_proj("channel", gen)  # unrelated weights, no fingerprint to catch it
    model_dir = served_model(tmp_path, {3: other})
    layer = make_layer(gaudi, kv_b, 3, model_dir, {})
    with pytest.raises(ArtifactError) as e:
        layer.process_weights_after_loading(torch.bfloat16)
    assert (
        "layer 3" in str(e.value) and "layer-003.safetensors" in str(e.value) and "another checkpoint" in str(e.value)
    )

    plugin.reset()
    monkeypatch.setenv("MLA_RUNTIME_FALLBACK", "1")
    layer = make_layer(gaudi, kv_b, 3, model_dir, {})
    with caplog.at_level(logging.WARNING, logger="vllm.mla_runtime"):
        layer.process_weights_after_loading(torch.bfloat16)
    ref = documented(gaudi, kv_b)
    assert torch.equal(layer.W_UK_T, ref.W_UK_T) and torch.equal(layer.W_UV, ref.W_UV)
    assert any("MLA_RUNTIME_FALLBACK=1" in r.getMessage() for r in caplog.records)
    assert plugin.summary()[0]["fallback"] == 1 and plugin.summary()[0]["loaded"] == 0


def test_head_count_mismatch_names_layer_and_file(gaudi, tmp_path):
    gen = torch.Generator().manual_seed(6)
    kv_b, _ = make_kv_b_proj("block", gen, heads=slice(0, 4))
    model_dir = served_model(tmp_path, {7: make_kv_b_proj("block", gen)[1]})  # 8 heads, TP 1
    layer = make_layer(gaudi, kv_b, 7, model_dir, {}, num_heads=4)
    with pytest.raises(ArtifactError, match=r"layer 7 \(.*layer-007\.safetensors\): the artifacts have 8 heads"):
        layer.process_weights_after_loading(torch.bfloat16)


def test_missing_layer_names_layer_and_file(gaudi, tmp_path):
    gen = torch.Generator().manual_seed(7)
    kv_b, exact = make_kv_b_proj("block", gen)
    model_dir = served_model(tmp_path, {0: exact})
    layer = make_layer(gaudi, kv_b, 9, model_dir, {})
    with pytest.raises(ArtifactError, match=r"layer 9: no MLA artifacts .*layer-009\.safetensors"):
        layer.process_weights_after_loading(torch.bfloat16)


def test_non_fp8_kv_b_proj_goes_to_the_original_method(gaudi, tmp_path):
    gen = torch.Generator().manual_seed(8)
    kv_b, exact = make_kv_b_proj("bf16", gen)
    model_dir = served_model(tmp_path, {0: exact})
    layer = make_layer(gaudi, kv_b, 0, model_dir, {})
    layer.process_weights_after_loading(torch.bfloat16)
    assert layer.upstream_calls == 1  # handed to MLAAttention's method, as vllm-gaudi does
    assert plugin.summary() == []  # the HPU wrapper did not touch it


def test_disabled_and_absent_artifacts_leave_the_documented_path(gaudi, tmp_path, monkeypatch):
    gen = torch.Generator().manual_seed(9)
    kv_b, _ = make_kv_b_proj("block", gen)
    layer = make_layer(gaudi, kv_b, 0, tmp_path / "no-artifacts", {})
    (tmp_path / "no-artifacts").mkdir()
    layer.process_weights_after_loading(torch.bfloat16)
    ref = documented(gaudi, kv_b)
    assert torch.equal(layer.W_UK_T, ref.W_UK_T) and plugin.summary() == []

    model_dir = served_model(tmp_path, {0: make_kv_b_proj("block", gen)[1]})  # would fail the spot check
    monkeypatch.setenv("MLA_RUNTIME_DISABLE", "1")
    layer = make_layer(gaudi, kv_b, 0, model_dir, {})
    layer.process_weights_after_loading(torch.bfloat16)
    assert torch.equal(layer.W_UK_T, ref.W_UK_T)


def test_artifacts_dir_from_environment(gaudi, tmp_path, monkeypatch):
    gen = torch.Generator().manual_seed(10)
    kv_b, exact = make_kv_b_proj("channel", gen)
    elsewhere = write_artifacts(tmp_path / "elsewhere", {4: exact}, DIMS)
    monkeypatch.setenv("MLA_RUNTIME_DIR", str(elsewhere))
    (tmp_path / "model").mkdir()
    layer = make_layer(gaudi, kv_b, 4, tmp_path / "model", {})
    layer.process_weights_after_loading(torch.bfloat16)
    assert plugin.summary()[0]["where"] == str(elsewhere) and plugin.summary()[0]["loaded"] == 1


def test_register_is_idempotent(gaudi):
    wrapped = gaudi.HPUMLAAttention.process_weights_after_loading
    plugin.register()
    plugin.register()
    assert gaudi.HPUMLAAttention.process_weights_after_loading is wrapped
    assert not getattr(wrapped.__wrapped__, "__mla_runtime_wrapped__", False)  # wrapped exactly once
    assert plugin.wrap_gaudi(gaudi.HPUMLAAttention) is False
