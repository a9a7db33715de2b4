"""The plugin on what vllm 0.34.0 changed (tests/support/standins/vllm_034/, pinned to the PyPI wheel):
the finalize order, each reload mode, and Kimi-K3.1's DSA layers with their specialized decode.
(The first load, the step-asides and W_UV_dcp run on every code base in test_runtime_codebases.py.)

- `finalize_model_weights`: every hook without argument, children first, a shared module once, the
  root model last; so a parent's hook (Kimi-K3's model) sees the artifacts the layer's hook placed;
- reloads: layerwise (the default), direct (`VLLM_RELOAD_MODE=direct`) and kernel format all leave
  vLLM's recomputed W_UK_T / W_UV (of the new kv_b_proj) in the tensors, at the addresses of the
  first load (captured CUDA graphs read those); the direct mode's checks accept what the plugin did
  (the parameter objects are kept, kv_b_proj untouched);
- Kimi-K3.1's DSA layers (a quantized kv_b_proj, MultiHeadLatentAttentionWrapper): served from the
  artifacts, the specialized decode's references and DCP copy included; with the A2A combine, vLLM's
  values everywhere, with the reason.
"""

from __future__ import annotations

import importlib
import logging

import pytest
import torch
from torch import nn

from mla_runtime import envs, plugin
from mla_runtime.format import MlaDims
from mla_runtime.layout import split_kv_b_proj
from support.artifacts import read_artifacts, write_artifacts

pytestmark = pytest.mark.parametrize("vllm_codebase", ["vllm 0.34.0"])

HEADS, LAYERS = 4, 3
DIMS = MlaDims(num_heads=HEADS, qk_nope_head_dim=128, v_head_dim=128, kv_lora_rank=512)


@pytest.fixture
def v034(vllm_standin, monkeypatch):
    for var in (*envs.ALL, "VLLM_RELOAD_MODE"):
        monkeypatch.delenv(var, raising=False)
    plugin.reset()
    plugin.register()
    assert vllm_standin.mla_attention.MLAAttention.process_weights_after_loading.__mla_runtime_wrapped__
    yield vllm_standin
    plugin.reset()


def engine():
    return importlib.import_module("mla_engine")


def addresses(layer) -> list[tuple]:
    return [(id(t), t.data_ptr(), t.stride()) for t in (layer.W_UK_T, layer.W_UV)]


def plugin_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("mla_runtime:")]


# --------------------------------------------------------------------------- finalize order


def test_finalize_calls_every_hook_without_argument_children_first_shared_once_root_last(v034):
    calls = []

    class Hooked(nn.Module):
        def __init__(self, name, *children):
            super().__init__()
            self.name = name
            for i, c in enumerate(children):
                self.add_module(f"c{i}", c)

        def process_weights_after_loading(self, *args, **kwargs):
            calls.append((self.name, args, kwargs))

    shared = Hooked("shared")
    quantized = Hooked("quantized", Hooked("inside-quantized"))
    quantized.quant_method = importlib.import_module("vllm_upstream").UnquantizedLinearMethod()
    root = Hooked("root", Hooked("a", shared, Hooked("a1")), Hooked("b", shared), quantized)
    importlib.import_module("vllm_034.weight_utils").finalize_model_weights(root)
    assert [c[0] for c in calls] == ["shared", "a1", "a", "b", "quantized", "root"]
    assert all(c[1:] == ((), {}) for c in calls)


def test_a_parents_hook_sees_the_artifacts(v034, tmp_path):
    """MLAAttention's hook runs (and the plugin places the artifacts) before the hook of the module
    holding it: what Kimi-K3's model hook or any parent derives afterwards is derived from them."""
    exact = engine().random_kv_b(LAYERS, *DIMS.kv_b_shape())
    write_artifacts(tmp_path / "mla", exact, DIMS)
    served = {i: x * (1 + 2**-9) for i, x in exact.items()}
    layers = engine().build_and_load(v034, tmp_path, served, num_heads=HEADS)
    seen = {}

    class Root(nn.Module):
        def __init__(self, body):
            super().__init__()
            self.body = body

        def process_weights_after_loading(self):
            seen.update({i: b.attn.W_UK_T.clone() for i, b in enumerate(self.body)})

    root = Root(layers.model)
    plugin.reset()
    v034.loader.process_weights_after_loading(root)  # a fresh process's load of the same model
    for i in range(LAYERS):
        assert torch.equal(seen[i], read_artifacts(tmp_path / "mla", i)[0])


# --------------------------------------------------------------------------- reload modes


@pytest.mark.parametrize("mode", ["layerwise", "direct", "kernel format"])
@pytest.mark.parametrize("act_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("served_is", ["the artifacts' bf16", "1 ulp off in places"])
def test_each_reload_mode_keeps_vllms_new_values_at_the_first_addresses(v034, tmp_path, monkeypatch, caplog, mode,
                                                                        act_dtype, served_is):  # fmt: skip
    exact = engine().random_kv_b(LAYERS, *DIMS.kv_b_shape())
    write_artifacts(tmp_path / "mla", exact, DIMS)
    served = exact if served_is == "the artifacts' bf16" else {i: x * (1 + 2**-9) for i, x in exact.items()}
    new = engine().perturbed(exact, 0.01)
    if mode == "direct":
        monkeypatch.setenv("VLLM_RELOAD_MODE", "direct")  # fixed for the process: the cold start records layouts
    monkeypatch.setenv("MLA_RUNTIME_DISABLE", "1")
    off = engine().build_and_load(v034, tmp_path, served, num_heads=HEADS, act_dtype=act_dtype)
    engine().reload(off, new, act_dtype, kernel_format=mode == "kernel format")
    monkeypatch.delenv("MLA_RUNTIME_DISABLE")
    with caplog.at_level(logging.INFO, logger="vllm.mla_runtime"):
        on = engine().build_and_load(v034, tmp_path, served, num_heads=HEADS, act_dtype=act_dtype)
        first = {i: addresses(layer) for i, layer in on.items()}
        for i in range(LAYERS):
            assert torch.equal(on[i].W_UK_T, read_artifacts(tmp_path / "mla", i)[0].to(act_dtype))
        engine().reload(on, new, act_dtype, kernel_format=mode == "kernel format")
    for i, layer in on.items():
        w_uk_t, w_uv = split_kv_b_proj(new[i].to(torch.bfloat16), DIMS, act_dtype)
        assert torch.equal(layer.W_UK_T, w_uk_t) and torch.equal(layer.W_UV, w_uv)  # vLLM's, of the new weights
        assert torch.equal(layer.W_UK_T, off[i].W_UK_T) and torch.equal(layer.W_UV, off[i].W_UV)
        assert addresses(layer) == first[i]
        assert torch.equal(layer.kv_b_proj.weight, new[i].to(torch.bfloat16))
    assert plugin.summary()[0]["reloads"] == LAYERS
    assert sum("weights reloaded" in line for line in plugin_lines(caplog)) == 1


def test_direct_reload_refuses_what_vllm_refuses_not_what_the_plugin_did(v034, tmp_path, monkeypatch):
    """The direct mode's begin raises when post-load processing replaced a checkpoint parameter's
    object; the plugin's new storage for views of kv_b_proj (bf16, other values) keeps the objects."""
    exact = engine().random_kv_b(LAYERS, *DIMS.kv_b_shape())
    write_artifacts(tmp_path / "mla", exact, DIMS)
    served = {i: x * (1 + 2**-9) for i, x in exact.items()}
    monkeypatch.setenv("VLLM_RELOAD_MODE", "direct")
    on = engine().build_and_load(v034, tmp_path, served, num_heads=HEADS)
    assert plugin.summary()[0]["placed"] == {"new storage": LAYERS}
    reload = v034.reload
    reload.begin_direct_reload(on.model)  # accepted
    reload.finish_direct_reload(on.model)
    on[0].kv_b_proj.weight = nn.Parameter(on[0].kv_b_proj.weight.clone(), requires_grad=False)
    with pytest.raises(RuntimeError, match="replaced the parameter object of 2 checkpoint"):  # both names of kv_b_proj
        reload.begin_direct_reload(on.model)  # the check is live


# --------------------------------------------------------------------------- Kimi-K3.1 DSA


def channel_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row round-to-nearest e4m3 (as mla-convert's channel FP8): codes, scale [rows, 1]."""
    scale = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 448.0
    return (w / scale).to(torch.float8_e4m3fn), scale.float()


def build_kimi(v034, model_dir, served: dict[int, torch.Tensor], *, dcp_a2a: bool = False, dense: tuple = ()):
    """Kimi-K3.1 DSA layers as vLLM 0.34 builds and loads them (channel-FP8 kv_b_proj), then the
    specialized decode built once the weights are loaded, as the model state does."""
    kimi = importlib.import_module("vllm_034.kimi_k3")
    mla = v034.mla_attention
    vllm_config = engine().vllm_config_for(model_dir, "a2a" if dcp_a2a else "ag_rs")
    mla._DCP_WORLD_SIZE = 2 if dcp_a2a else 1
    if dcp_a2a:
        base = mla.MLAAttention.impl_cls
        impl = type("DcpImpl", (base,), {"dcp_world_size": 2})
        v034.mla_attention.MLAAttention.impl_cls = impl
    layers = nn.ModuleList()
    with engine().default_dtype(torch.bfloat16):
        for i in range(len(served)):
            block = nn.Module()
            kw = dict(num_heads=HEADS, qk_nope_head_dim=128, v_head_dim=128, kv_lora_rank=512,
                      quant_config=kimi.ChannelFp8Config(), prefix=f"model.layers.{i}.self_attn", vllm_config=vllm_config)  # fmt: skip
            if i in dense:  # Kimi-K3's dense MLA (no MLAAttention)
                block.self_attn = kimi.MultiHeadLatentAttention(**kw)
            else:
                block.self_attn = kimi.KimiK3DSAAttention(qk_rope_head_dim=64, **kw)
            layers.append(block)
        model = kimi.KimiK3ForCausalLM(layers, specialized_decode=True)
    v034.loader.initialize_model_done(model)
    for block, w in zip(layers, served.values(), strict=True):
        kv_b = block.self_attn.kv_b_proj
        codes, scale = channel_fp8(w)
        kv_b.weight.weight_loader(kv_b.weight, codes)
        kv_b.weight_scale.weight_loader(kv_b.weight_scale, scale)
    v034.loader.process_weights_after_loading(model)
    model.build_specialized_decode(mla.get_dcp_group() if dcp_a2a else mla._DcpGroup(2))
    return model, {i: b.self_attn if i in dense else b.self_attn.mla_attn.mla_attn for i, b in enumerate(layers)}


@pytest.mark.parametrize("dcp_a2a", [False, True])
def test_kimi_k31_dsa_layers_and_their_specialized_decode(v034, tmp_path, monkeypatch, caplog, dcp_a2a):
    exact = engine().random_kv_b(LAYERS, *DIMS.kv_b_shape())
    write_artifacts(tmp_path / "mla", exact, DIMS)
    monkeypatch.setenv("MLA_RUNTIME_DISABLE", "1")
    _, off = build_kimi(v034, tmp_path, exact, dcp_a2a=dcp_a2a)
    monkeypatch.delenv("MLA_RUNTIME_DISABLE")
    with caplog.at_level(logging.INFO, logger="vllm.mla_runtime"):
        model, on = build_kimi(v034, tmp_path, exact, dcp_a2a=dcp_a2a)
    decode = model.specialized_decode
    for i, layer in on.items():
        assert layer.layer_name == f"model.layers.{i}.self_attn.attn"
        assert layer.kv_b_proj.weight.dtype == torch.float8_e4m3fn  # quantized: nothing aliases it
        a_uk_t, a_uv = read_artifacts(tmp_path / "mla", i)
        assert not torch.equal(off[i].W_UK_T, a_uk_t)  # vLLM's dequantized values are other values
        want = (off[i].W_UK_T, off[i].W_UV) if dcp_a2a else (a_uk_t, a_uv)
        assert torch.equal(layer.W_UK_T, want[0]) and torch.equal(layer.W_UV, want[1])
        refs = decode.query_weights[layer.layer_name]
        assert refs[0] is layer.W_UK_T and refs[1] is layer.W_UV  # the decode reads the layer's own tensors
        assert torch.equal(decode.uv_gathered[layer.layer_name], torch.cat([want[1]] * 2))  # its DCP copy
        if dcp_a2a:
            assert torch.equal(layer.W_UV_dcp, decode.uv_gathered[layer.layer_name])
    summary = plugin.summary()[0]
    if dcp_a2a:
        assert summary["not-used"] == LAYERS
        assert sum("W_UV_dcp" in line for line in plugin_lines(caplog)) == 1
    else:
        assert summary["loaded"] == summary["spot_checked"] == LAYERS

    # a layerwise reload: the decode's references follow vLLM's new values, at the same addresses
    first = {i: addresses(layer) for i, layer in on.items()}
    new = engine().perturbed(exact, 0.01)
    v034.reload.start_reload(model)
    for i, block in enumerate(model.model.layers):
        codes, scale = channel_fp8(new[i])
        kv_b = block.self_attn.kv_b_proj
        kv_b.weight.weight_loader(kv_b.weight, codes)
        kv_b.weight_scale.weight_loader(kv_b.weight_scale, scale)
    v034.reload.finish_reload(model)
    for i, layer in on.items():
        assert addresses(layer) == first[i]
        refs = decode.query_weights[layer.layer_name]
        assert refs[0] is layer.W_UK_T and not torch.equal(refs[0], read_artifacts(tmp_path / "mla", i)[0])


def test_mla_layers_that_are_no_mlaattention_are_named_once_and_the_count_is_of_the_others(v034, tmp_path,
                                                                                           monkeypatch, caplog):  # fmt: skip
    """A model with Kimi-K3's dense MultiHeadLatentAttention beside DSA layers: vLLM computes the dense
    layers' weights (one line names the class), the DSA layers take the artifacts, and the summary
    line counts the layers the plugin serves, so it is still written once."""
    exact = engine().random_kv_b(LAYERS, *DIMS.kv_b_shape())
    write_artifacts(tmp_path / "mla", exact, DIMS)
    with caplog.at_level(logging.INFO, logger="vllm.mla_runtime"):
        _, on = build_kimi(v034, tmp_path, exact, dense=(1,))
    lines = plugin_lines(caplog)
    named = [line for line in lines if "MultiHeadLatentAttention" in line]
    assert (
        len(named) == 1 and "1 MLA layers of MultiHeadLatentAttention do not run the hooked MLAAttention" in named[0]
    ), lines
    summary = [line for line in lines if line.startswith("mla_runtime: loaded")]
    assert len(summary) == 1 and "2/2 MLA layers" in summary[0], lines
    dense_uk_t = split_kv_b_proj(on[1].kv_b_proj.weight.float() * on[1].kv_b_proj.weight_scale, DIMS)[0]
    assert torch.equal(on[1].W_UK_T, dense_uk_t.to(torch.bfloat16))  # vLLM's (eye-path) dequant, not the artifacts
    assert torch.equal(on[0].W_UK_T, read_artifacts(tmp_path / "mla", 0)[0])
