"""The plugin's hook on upstream MLAAttention, without vLLM: a module shaped like vLLM's
mla_attention (a module-level split_kv_b_proj called from MLAAttention.process_weights_after_loading,
which then stores the transposes). The real engine is exercised in test_vllm_engine.py."""

from __future__ import annotations

import logging
import sys
import textwrap
import types
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from mla_runtime import ArtifactError, plugin, spot_check
from mla_runtime.format import MlaDims
from support.artifacts import write_artifacts

DIMS = MlaDims(num_heads=4, qk_nope_head_dim=128, v_head_dim=128, kv_lora_rank=512)

FAKE_UPSTREAM = textwrap.dedent(
    """
    import torch
    from torch import nn

    def split_kv_b_proj(kv_b_proj, out_dtype, kv_lora_rank, num_heads, qk_nope_head_dim, v_head_dim):
        global split_calls
        split_calls += 1
        w = kv_b_proj.weight.to(out_dtype).T
        w = w.view(kv_lora_rank, num_heads, qk_nope_head_dim + v_head_dim)
        return w.split([qk_nope_head_dim, v_head_dim], dim=-1)

    split_calls = 0

    class MLAAttention(nn.Module):
        def __init__(self, kv_b_proj, prefix, num_heads=4):
            super().__init__()
            self.kv_b_proj, self.layer_name, self.num_heads = kv_b_proj, prefix, num_heads
            self.qk_nope_head_dim, self.v_head_dim, self.kv_lora_rank = 128, 128, 512
            self.after = []

        def process_weights_after_loading(self, act_dtype):
            self.after.append("impl")  # what comes before the split keeps running
            W_UK, W_UV = split_kv_b_proj(self.kv_b_proj, act_dtype, self.kv_lora_rank, self.num_heads,
                                         self.qk_nope_head_dim, self.v_head_dim)
            self.W_UV = W_UV.transpose(0, 1)
            self.W_UK_T = W_UK.permute(1, 2, 0)
            self.after.append("scales")  # ... and what comes after it
    """
)


@pytest.fixture
def upstream(monkeypatch):
    mod = types.ModuleType("fake_mla_attention")
    exec(compile(FAKE_UPSTREAM, "fake_mla_attention.py", "exec"), mod.__dict__)
    monkeypatch.setitem(sys.modules, "fake_mla_attention", mod)
    for var in ("MLA_RUNTIME_DIR", "MLA_RUNTIME_DISABLE", "MLA_RUNTIME_FALLBACK", "MLA_RUNTIME_CHECK"):
        monkeypatch.delenv(var, raising=False)
    plugin.reset()
    assert plugin.wrap_upstream(mod.MLAAttention, mod) is True
    assert plugin.wrap_upstream(mod.MLAAttention, mod) is False  # idempotent
    yield mod
    plugin.reset()


def _layers(mod, tmp_path, n=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weights = {i: torch.randn(DIMS.kv_b_shape(), generator=gen) * 0.02 for i in range(n)}
    model_dir = tmp_path / "model"
    write_artifacts(model_dir / "mla", weights, DIMS)
    ctx: dict = {}
    layers = []
    for i in range(n):
        kv_b = nn.Module()
        kv_b.weight = nn.Parameter(weights[i].to(torch.bfloat16), requires_grad=False)
        layer = mod.MLAAttention(kv_b, f"model.layers.{i}.self_attn.attn")
        layer._vllm_config = SimpleNamespace(
            model_config=SimpleNamespace(model=str(model_dir)),
            compilation_config=SimpleNamespace(static_forward_context=ctx),
        )
        ctx[layer.layer_name] = layer
        layers.append(layer)
    return layers, model_dir


def test_split_is_taken_from_artifacts_and_the_rest_runs(upstream, tmp_path, caplog):
    layers, model_dir = _layers(upstream, tmp_path)
    reference = []
    for layer in layers:  # what the unwrapped method computes
        twin = upstream.MLAAttention(layer.kv_b_proj, "twin")
        upstream.MLAAttention.process_weights_after_loading.__wrapped__(twin, torch.bfloat16)
        reference.append(twin)
    calls_before = upstream.split_calls
    with caplog.at_level(logging.INFO, logger="vllm.mla_runtime"):
        for layer in layers:
            layer.process_weights_after_loading(torch.bfloat16)
    assert upstream.split_calls == calls_before  # vLLM's split never ran
    assert upstream.split_kv_b_proj.__name__ == "split_kv_b_proj"  # and is back in place
    for layer, ref in zip(layers, reference, strict=True):
        assert layer.after == ["impl", "scales"]
        assert torch.equal(layer.W_UK_T, ref.W_UK_T) and torch.equal(layer.W_UV, ref.W_UV)
        assert layer.W_UK_T.is_contiguous() and layer.W_UV.is_contiguous()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("mla_runtime:")]
    assert lines == [lines[0]] and f"of 3/3 MLA layers from {model_dir / 'mla'}" in lines[0]


def test_split_error_names_layer_and_restores_the_module(upstream, tmp_path):
    layers, model_dir = _layers(upstream, tmp_path)
    (model_dir / "mla" / "layer-001.safetensors").write_bytes(b"\0" * 10)  # wrong size
    with pytest.raises(ArtifactError, match=r"layer 1 \(.*layer-001\.safetensors\)"):
        layers[0].process_weights_after_loading(torch.bfloat16)  # refused when the artifacts are opened
    assert upstream.split_kv_b_proj.__name__ == "split_kv_b_proj"


def test_fallback_recomputes_with_a_warning(upstream, tmp_path, monkeypatch, caplog):
    layers, model_dir = _layers(upstream, tmp_path)
    (model_dir / "mla" / "layer-001.safetensors").write_bytes(b"\0" * 10)
    monkeypatch.setenv("MLA_RUNTIME_FALLBACK", "1")
    with caplog.at_level(logging.INFO, logger="vllm.mla_runtime"):
        for layer in layers:
            layer.process_weights_after_loading(torch.bfloat16)
    assert upstream.split_calls == 3  # all recomputed: the artifacts could not be opened
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "layer 1" in warnings[0].getMessage()
    info = [r.getMessage() for r in caplog.records if r.getMessage().startswith("mla_runtime: loaded")]
    assert len(info) == 1 and "0/3" in info[0] and "3 recomputed by vLLM" in info[0]


def test_env_dir_and_model_without_artifacts(upstream, tmp_path, monkeypatch):
    layers, model_dir = _layers(upstream, tmp_path)
    (model_dir / "mla").rename(tmp_path / "moved")
    layers[0].process_weights_after_loading(torch.bfloat16)
    assert upstream.split_calls == 1 and plugin.summary() == []
    plugin.reset()
    monkeypatch.setenv("MLA_RUNTIME_DIR", str(tmp_path / "moved"))
    layers[1].process_weights_after_loading(torch.bfloat16)
    assert upstream.split_calls == 1 and plugin.summary()[0]["loaded"] == 1


def test_a_failing_hook_does_not_break_the_import(monkeypatch, caplog, tmp_path):
    (tmp_path / "fake_vllm_mod_without_class.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "fake_vllm_mod_without_class", raising=False)
    plugin.when_imported("fake_vllm_mod_without_class", lambda mod: plugin.wrap_upstream(mod.MLAAttention, mod))
    with caplog.at_level(logging.WARNING, logger="vllm.mla_runtime"):
        import fake_vllm_mod_without_class as mod
    assert mod.X == 1
    assert any("cannot hook fake_vllm_mod_without_class (AttributeError" in r.getMessage() for r in caplog.records)


# --------------------------------------------------------------------------- the spot check's arithmetic


def test_spot_check_compares_value_by_value():
    ours = torch.tensor([[1.0, -2.0, 0.0, 0.5]])
    ok = spot_check.compare(ours * (1 + 2**-4), None, ours)  # 2^-4 relative: inside 2^-3
    assert ok.outside == 0 and ok.bound_use == pytest.approx(0.5)
    one_off = ours.clone()
    one_off[0, 2] = 1e-6  # a zero artifact, an unquantized weight: nothing is allowed
    assert spot_check.compare(one_off, None, ours).outside == 1
    scale = torch.full_like(ours, 2.0)  # ... but an FP8 code's subnormal rounding is, up to 2^-7 s
    assert spot_check.compare(one_off, scale, ours).outside == 0
    nan = ours.clone()
    nan[0, 0] = float("nan")
    assert spot_check.compare(nan, None, ours).outside == 1
    assert spot_check.compare(ours, None, ours).bound_use == 0.0


@pytest.mark.parametrize(
    "layout", ["bf16", "per-channel [N, 1]", "per-channel [N]", "per-tensor", "block", "transposed"]
)
def test_spot_check_reads_the_served_layouts(layout):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 512, generator=gen) * 0.02
    kv_b = torch.nn.Module()
    if layout == "bf16":
        kv_b.weight = torch.nn.Parameter(x.to(torch.bfloat16), requires_grad=False)
    elif layout == "block":
        s = x.view(4, 128, 4, 128).abs().amax(dim=(1, 3)) / 448
        q = (x.view(4, 128, 4, 128) / s[:, None, :, None]).view(512, 512).to(torch.float8_e4m3fn)
        kv_b.weight = torch.nn.Parameter(q, requires_grad=False)
        kv_b.weight_scale_inv, kv_b.weight_block_size = s, [128, 128]
    else:
        s = x.abs().amax() / 448 if layout == "per-tensor" else x.abs().amax(dim=1, keepdim=True) / 448
        q = (x / s).to(torch.float8_e4m3fn)
        kv_b.weight = torch.nn.Parameter(q.T if layout == "transposed" else q, requires_grad=False)
        kv_b.weight_scale = s.reshape(-1) if layout == "per-channel [N]" else s
    w_uk_t = x.view(2, 256, 512)[:, :128].to(torch.bfloat16)
    w_uv = x.view(2, 256, 512)[:, 128:].transpose(1, 2).to(torch.bfloat16)
    got = spot_check.spot_check(kv_b, w_uk_t, w_uv, where="layer 0")
    assert got is not None and got.compared == 256 * 64 and got.outside == 0 and got.bound_use <= 0.6
    with pytest.raises(ArtifactError, match=r"layer 0: .* values of this rank's first head lie outside"):
        spot_check.spot_check(kv_b, w_uk_t * 1.2, w_uv, where="layer 0")
