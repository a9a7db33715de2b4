"""Mistral-Large-4 in Mistral's own layout (shared/reference/model-family.md, "Mistral-Large-4",
read from vLLM 0.34.0): params.json with a `dsa` block, NoPE layers (qk_nope + qk_rope spent on
nope), KV-sharing layers (no wkv_a_with_mqa / kv_a_norm, their own wkv_b), indexer layers full /
shared, per-head SSMax, a DSpark draft copied as it is. Its demo converts in both formats to the
reference, every layer's W_UK_T / W_UV at that layer's shapes; what vLLM keeps unquantized stays
BF16 and is ignored in vLLM's names; verify knows every layer kind; what vLLM 0.34 refuses is
refused in one line; the output is served through the 0.34 stand-in from the artifacts."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mla_convert.source import family
from mla_convert.source.checkpoint import open_source
from mla_convert.verification import verify
from mla_runtime import model_configs, plugin
from mla_runtime.format import read_manifest, w_uk_t_name, w_uv_name
from support import checkpoints
from support.cli_runner import cli_error
from support.edits import edit_json, fix_hash, rewrite_output_tensor
from support.mistral_layout import expected_output
from support.serving_034 import assert_served_from_artifacts, serve

MEMBER, FP8, BF16 = "mistral-large-4", "channel-fp8", "bf16"
MEMBERS = [MEMBER, "mistral-large-4-fp8"]  # its BF16 release, and the same in compressed-tensors FP8_BLOCK
PARAMS, INDEX = "params.json", "consolidated.safetensors.index.json"

# The demo's geometry, written again here: the AMD kernels' (H 64, kv_lora 512, rope 64, nope 64,
# v 128; layers 39, 43, ..., 71 reading layer 35's KV) shrunk.
HEADS, NOPE, ROPE, V, KV_LORA, HIDDEN, LAYERS = 4, 32, 16, 32, 64, 96, 12
NOPE_LAYERS = {3, 7, 11}
SOURCES = [0, 1, 2, 3, 4, 5, 6, 7, 8, 8, 8, 7]
FULL_INDEXER = {0, 2, 4, 6, 8, 10}

# model-family.md's tensor names of Large 4 (vLLM 0.34's `_CHECKPOINT_NAME_MAP`): a layer's
# Mistral module -> vLLM's (HF) module after `model.layers.N.`.
LAYER = {
    "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attention.wq": "self_attn.q_proj",
    "attention.wkv_a_with_mqa": "self_attn.kv_a_proj_with_mqa", "attention.kv_a_norm": "self_attn.kv_a_layernorm",
    "attention.wkv_b": "self_attn.kv_b_proj", "attention.wo": "self_attn.o_proj",
    "attention.ssmax_scaling": "self_attn.ssmax", "attention.indexer.ssmax_scaling": "self_attn.indexer.ssmax",
    "attention.indexer.q_input_norm": "self_attn.indexer.q_input_norm", "attention.indexer.wq_b": "self_attn.indexer.wq_b",
    "attention.indexer.wk": "self_attn.indexer.wk", "attention.indexer.weights_proj": "self_attn.indexer.weights_proj",
    "attention.indexer.k_norm": "self_attn.indexer.k_norm", "gate": "mlp.gate",
}  # fmt: skip
W = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
TOP = {"tok_embeddings": "model.embed_tokens", "norm": "model.norm", "output": "lm_head"}
# What vLLM 0.34 quantizes when the checkpoint is (the rest is built unquantized whatever the config says).
QUANTIZED = re.compile(
    r"layers\.\d+\.(attention\.(wq|wo|indexer\.wq_b)|(feed_forward|shared_experts|experts\.\d+)\.w[123])$"
)
DRAFT = "mtp_dspark."


def hf_module(module: str) -> str:
    """vLLM's (HF) name of a Mistral module of the text model; an MLP's w1 / w2 / w3 as
    gate_proj / down_proj / up_proj (the names its quantization config matches once fused)."""
    if module in TOP:
        return TOP[module]
    if module == "lerope":  # vLLM reads lerope.alpha itself; the converter's name for it
        return "model.lerope"
    layer, rest = re.fullmatch(r"layers\.(\d+)\.(.+)", module).groups()
    if rest in LAYER:
        return f"model.layers.{layer}.{LAYER[rest]}"
    where, w = re.fullmatch(r"(feed_forward|shared_experts|experts\.\d+)\.(w[123])", rest).groups()
    mlp = {"feed_forward": "mlp"}.get(where, "mlp." + where)
    return f"model.layers.{layer}.{mlp}.{W[w]}"


def module_of(name: str) -> str:
    return name.rsplit(".", 1)[0]


def load_all(root: Path) -> dict[str, torch.Tensor]:
    return checkpoints.load_all(root, INDEX)


def ok(report) -> bool:
    failures = [f.line() for f in report.failures()]
    assert not failures, "\n".join(failures[:10])
    return report.ok


def _copy(path: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(path, tmp_path / path.name))


# --- the tiny checkpoint has Large 4's structure -------------------------------------------------


@pytest.mark.parametrize("member", MEMBERS)
def test_the_demo_checkpoint_has_every_layer_kind(family_checkpoints, member):
    src = family_checkpoints.source(member)
    assert not (src / "config.json").exists() and (src / "tekken.json").exists()
    params = json.loads((src / PARAMS).read_text())
    assert params["q_lora_rank"] is None and params["dsa"]["ssmax_scaling"] and params["moe"]["num_shared_experts"]
    t = load_all(src)
    fp8 = {module_of(n) for n, x in t.items() if x.dtype == torch.float8_e4m3fn}
    assert fp8 == (set() if member == MEMBER else {module_of(n) for n in t if QUANTIZED.match(module_of(n))})
    lerope = t.pop("lerope.alpha")  # LeRoPE's one tensor, [qk_rope_head_dim / 2]
    assert lerope.dtype == torch.float32 and tuple(lerope.shape) == (ROPE // 2,) and params["lerope"]
    assert all(x.dtype == torch.bfloat16 for n, x in t.items() if module_of(n) not in fp8)  # scales included
    for i in range(LAYERS):
        a = f"layers.{i}.attention."
        p = NOPE + ROPE if i in NOPE_LAYERS else NOPE
        assert tuple(t[a + "wkv_b.weight"].shape) == (HEADS * (p + V), KV_LORA), i
        assert tuple(t[a + "wq.weight"].shape) == (HEADS * (NOPE + ROPE), HIDDEN), i
        if SOURCES[i] == i:
            assert tuple(t[a + "wkv_a_with_mqa.weight"].shape) == (KV_LORA + (0 if i in NOPE_LAYERS else ROPE), HIDDEN)
            assert a + "kv_a_norm.weight" in t
        else:
            assert a + "wkv_a_with_mqa.weight" not in t and a + "kv_a_norm.weight" not in t
        assert tuple(t[a + "ssmax_scaling.s"].shape) == tuple(t[a + "ssmax_scaling.b"].shape) == (HEADS,)
        has = {n[len(a + "indexer.") :] for n in t if n.startswith(a + "indexer.") and not n.endswith("_scale")}
        assert has == (
            {"q_input_norm.weight", "q_input_norm.bias", "wq_b.weight", "wk.weight", "weights_proj.weight",
             "k_norm.weight", "k_norm.bias", "ssmax_scaling.s", "ssmax_scaling.b"} if i in FULL_INDEXER else set()
        ), i  # fmt: skip
        assert (f"layers.{i}.feed_forward.w1.weight" in t) == (i == 0)
        assert (f"layers.{i}.shared_experts.w1.weight" in t) == (i > 0)
    assert any(n.startswith(DRAFT + "backbone.layers.12.attention.wkv_b") for n in t)


def test_params_json_is_read_as_vllm_034_reads_it_and_agrees_with_the_runtime(family_checkpoints):
    """The converter's per-layer dims (the MLA manifest's) are the ones mla_runtime.model_configs
    serves, and its inventory is the checkpoint's tensor set, both ways through the names."""
    src = open_source(family_checkpoints.source(MEMBER))
    cfg = src.config
    assert cfg["architectures"] == ["MistralLarge4ForCausalLM"] and cfg["q_lora_rank"] is None
    assert [i for i, f in enumerate(cfg["nope_layer_flags"]) if f] == sorted(NOPE_LAYERS)
    assert cfg["kv_source_layers"] == SOURCES
    assert src.layout.indexer_layers == frozenset(FULL_INDEXER) and src.layout.moe_layers == frozenset(range(1, 12))
    params = json.loads((src.root / PARAMS).read_text())
    assert model_configs.kv_sources(params) == SOURCES
    runtime = model_configs.layer_fields(params)
    assert (
        {i: src.own_dims(i) for i in range(LAYERS) if src.own_dims(i)}
        == runtime
        == {i: {"qk_nope_head_dim": NOPE + ROPE} for i in NOPE_LAYERS}
    )
    implied = family.implied_tensors(cfg)
    text = {n for n in src.weight_map if not n.startswith(DRAFT)}
    assert {src.names.from_deepseek(n) for n in implied} == text
    for n in text:
        module, suffix = n.rsplit(".", 1)
        assert src.names.to_deepseek(n) == f"{hf_module(module)}.{suffix}"
    kinds = {src.names.from_deepseek(n): k for n, (_, k) in implied.items()}
    fp8 = {module_of(n) for n, k in kinds.items() if k == family.FP8_LINEAR}
    assert fp8 == {module_of(n) for n in text if QUANTIZED.match(module_of(n)) and n.endswith(".weight")}
    assert all(src.names.to_deepseek(n) is None for n in src.weight_map if n.startswith(DRAFT))


# --- conversions ---------------------------------------------------------------------------------


@pytest.mark.parametrize("member", MEMBERS)
@pytest.mark.parametrize("fmt", [FP8, BF16])
def test_converts_to_the_reference_in_the_same_layout(family_checkpoints, reference, member, fmt):
    src_dir, out_dir = family_checkpoints.source(member), family_checkpoints.converted(member, fmt)
    src, got = load_all(src_dir), load_all(out_dir)
    want = expected_output(src, fmt, reference, fp8_source=member.endswith("-fp8"), quantized=QUANTIZED)
    assert set(got) == set(want)
    for name, t in want.items():
        assert reference.same_bits(got[name], t), name
    assert not (out_dir / "config.json").exists()
    out_params, src_params = (json.loads((d / PARAMS).read_text()) for d in (out_dir, src_dir))
    assert {k: v for k, v in out_params.items() if k != "quantization_config"} == {
        k: v for k, v in src_params.items() if k != "quantization_config"
    }
    assert ("quantization_config" in out_params) == (fmt == FP8)


@pytest.mark.parametrize("member", MEMBERS)
@pytest.mark.parametrize("fmt", [FP8, BF16])
def test_every_layers_artifacts_are_bit_exact_splits_at_its_own_shapes(family_checkpoints, reference, member, fmt):
    src = load_all(family_checkpoints.source(member))
    out = family_checkpoints.converted(member, fmt)
    manifest = read_manifest(out / "mla")
    assert manifest.layer_ids() == list(range(LAYERS))  # NoPE and KV-sharing layers included; no draft layer
    for i in range(LAYERS):
        p = NOPE + ROPE if i in NOPE_LAYERS else NOPE
        assert manifest.entry(i).dims == ({"qk_nope_head_dim": p} if i in NOPE_LAYERS else None)
        uk_t, uv = reference.seed_split(src[f"layers.{i}.attention.wkv_b.weight"], HEADS, p, V, KV_LORA)
        with safe_open(str(out / "mla" / manifest.entry(i).file), "pt") as f:
            assert reference.same_bits(f.get_tensor(w_uk_t_name(i)), uk_t), i
            assert reference.same_bits(f.get_tensor(w_uv_name(i)), uv), i
    raw = json.loads((out / "mla" / "manifest.json").read_text())
    assert [e["layer"] for e in raw["layers"] if "dims" in e] == sorted(NOPE_LAYERS)


@pytest.mark.parametrize("member", MEMBERS)
def test_the_ignore_list_names_what_vllm_keeps_unquantized_in_its_names(family_checkpoints, member):
    """Every text linear written 16-bit is ignored by its vLLM name (wkv_a_with_mqa, wkv_b, the
    indexer's wk / weights_proj, the router, lm_head), every other is channel FP8; the draft is
    ignored as a whole. compressed-tensors' own matching agrees."""
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils.match import is_match

    out = family_checkpoints.converted(member, FP8)
    qc = json.loads((out / PARAMS).read_text())["quantization_config"]
    QuantizationConfig.model_validate(qc)
    t = load_all(out)
    lin = torch.nn.Linear(1, 1)
    text = {module_of(n) for n, x in t.items() if n.endswith(".weight") and x.dim() == 2 and not n.startswith(DRAFT)}
    text -= {"tok_embeddings"}
    for module in text:
        quantized = t[module + ".weight"].dtype == torch.float8_e4m3fn
        assert quantized == bool(QUANTIZED.match(module)) == (not is_match(hf_module(module), lin, qc["ignore"])), (
            module
        )
    kept = {hf_module(m) for m in text if not QUANTIZED.match(m)}
    assert {e for e in qc["ignore"] if not e.startswith("re:")} == kept
    assert {k.rsplit(".", 1)[-1] for k in kept} == {
        "kv_a_proj_with_mqa",
        "kv_b_proj",
        "wk",
        "weights_proj",
        "gate",
        "lm_head",
    }
    draft = [n for n, x in t.items() if n.startswith(DRAFT) and x.dim() == 2]
    assert draft and all(t[n].dtype == torch.bfloat16 and is_match(module_of(n), lin, qc["ignore"]) for n in draft)


# --- verify knows every layer kind ---------------------------------------------------------------


@pytest.mark.parametrize("member", MEMBERS)
@pytest.mark.parametrize("fmt", [FP8, BF16])
def test_verify_passes_with_and_without_the_source(family_checkpoints, member, fmt):
    src, out = family_checkpoints.source(member), family_checkpoints.converted(member, fmt)
    assert ok(verify(out)) and ok(verify(out, src))


def test_verify_catches_a_nope_layers_artifact_at_the_rope_layers_shape(family_checkpoints, reference, tmp_path):
    out = _copy(family_checkpoints.converted(MEMBER, BF16), tmp_path)
    w = load_all(out)["layers.3.attention.wkv_b.weight"]
    rows = torch.cat([w.view(HEADS, NOPE + ROPE + V, KV_LORA)[:, ROPE:]]).reshape(-1, KV_LORA)  # nope + v per head
    uk_t, uv = reference.seed_split(rows, HEADS, NOPE, V, KV_LORA)
    save_file({w_uk_t_name(3): uk_t, w_uv_name(3): uv}, str(out / "mla" / "layer-003.safetensors"))
    fix_hash(out, "mla/layer-003.safetensors")
    report = verify(out)
    lines = [f.line() for f in report.failures()]
    assert lines and all("layer-003" in line or "layer 3" in line for line in lines), lines
    assert any("W_UK_T" in line and "[4, 48, 64]" in line and "[4, 32, 64]" in line for line in lines), lines


def test_verify_catches_a_manifest_recording_the_model_dims_for_a_nope_layer(family_checkpoints, tmp_path):
    out = _copy(family_checkpoints.converted(MEMBER, BF16), tmp_path)
    edit_json(out / "mla" / "manifest.json", lambda m: m["layers"][7].pop("dims"))
    fix_hash(out, "mla/manifest.json")
    lines = [f.line() for f in verify(out).failures()]
    assert any("mla-manifest" in line and "layer 7" in line for line in lines), lines


def test_verify_catches_a_kv_sharing_layer_given_a_wkv_a(family_checkpoints, tmp_path):
    out = _copy(family_checkpoints.converted(MEMBER, BF16), tmp_path)
    name, like = "layers.9.attention.wkv_a_with_mqa.weight", "layers.8.attention.wkv_a_with_mqa.weight"
    shard = json.loads((out / INDEX).read_text())["weight_map"][like]
    rewrite_output_tensor(out, like, lambda t: t.__setitem__(name, t[like].clone()), INDEX)
    edit_json(out / INDEX, lambda i: i["weight_map"].__setitem__(name, shard))
    fix_hash(out, INDEX)
    lines = [f.line() for f in verify(out).failures()]
    assert lines and any(name in line for line in lines), lines


def test_verify_catches_a_quantized_wkv_b(family_checkpoints, reference, tmp_path):
    """vLLM builds kv_b_proj unquantized: an FP8 wkv_b (with its channel scale) is refused."""
    out = _copy(family_checkpoints.converted(MEMBER, FP8), tmp_path)
    name = "layers.5.attention.wkv_b.weight"
    scale = module_of(name) + ".weight_scale"
    shard = json.loads((out / INDEX).read_text())["weight_map"][name]

    def quantize(t):
        t[name], t[scale] = reference.channel_fp8(t[name].float(), 448.0)

    rewrite_output_tensor(out, name, quantize, INDEX)
    edit_json(out / INDEX, lambda i: i["weight_map"].__setitem__(scale, shard))
    fix_hash(out, INDEX)
    lines = [f.line() for f in verify(out).failures()]
    assert any("wkv_b" in line for line in lines), lines


# --- what vLLM 0.34 refuses: one line, nothing written -------------------------------------------


def _dsa(**kw):
    return lambda p: p["dsa"].update(kw)


REFUSALS = {
    "q_lora": (lambda p: p.update(q_lora_rank=32), "q_lora_rank 32: vLLM 0.34 builds wq as a plain q_proj"),
    "no shared experts": (lambda p: p["moe"].update(num_shared_experts=0), "requires MLA (qk_nope_head_dim) and a moe"),
    "source shares": (
        lambda p: p["kv_sharing"].update(source_layers_str="0,1,2,3,4,5,6,7,8,8,9,7"),
        "layer 10 shares the KV cache of layer 9, which itself shares layer 8's",
    ),
    "later source": (
        lambda p: p["kv_sharing"].update(source_layers_str="0,1,2,3,4,5,6,7,9,9,10,11"),
        "layer 8 shares the KV cache of layer 9, a later one",
    ),
    "other kind": (
        lambda p: p["kv_sharing"].update(source_layers_str="0,1,2,3,4,5,6,7,8,8,8,8"),
        "layer 11 shares the KV cache of layer 8, of the other NoPE kind",
    ),
    "sources count": (
        lambda p: p["kv_sharing"].update(source_layers_str="0,1,2"),
        "names 3 source layers for n_layers 12",
    ),
    "kv_sharing key": (lambda p: p["kv_sharing"].update(window=4), "reads only source_layers_str"),
    "indexer nope": (_dsa(nope=True), "dsa.nope true (an indexer without RoPE) is not supported"),
    "no ssmax": (lambda p: p["dsa"].pop("ssmax_scaling"), "dsa lacks indexer_ssmax_scaling"),
    "fp8_indexer": (_dsa(fp8_indexer=False), "supports only the FP8 indexer cache"),
    "sharing first": (_dsa(sharing="shared,full"), "must tile 'full' / 'shared' with layer 0 full"),
    "unknown dsa key": (_dsa(index_window=3), "dsa has keys vLLM 0.34 does not read (index_window)"),
    "rope_head_dim": (_dsa(rope_head_dim=8), "dsa.rope_head_dim 8 differs from qk_rope_head_dim 16"),
    "conflicting": (_dsa(index_topk=4), "dsa has topk=8 and index_topk=4, which conflict"),
    "expert groups": (lambda p: p["moe"].update(num_expert_groups=2), "grouped top-k is not supported"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_what_vllm_034_refuses_is_refused_in_one_line(family_checkpoints, tmp_path, case):
    src = _copy(family_checkpoints.source(MEMBER), tmp_path)
    change, words = REFUSALS[case]
    edit_json(src / PARAMS, change)
    line = cli_error(["convert", src, "--out", tmp_path / "o"], tmp_path / "o")
    assert f"{src / PARAMS}: " in line and words in line, line


# --- served through the vLLM 0.34 stand-in --------------------------------------------------------


@pytest.mark.parametrize("vllm_codebase", ["vllm 0.34.0"])
@pytest.mark.parametrize("member", MEMBERS)
@pytest.mark.parametrize("fmt", [FP8, BF16])
def test_the_demo_output_is_served_from_its_artifacts_at_every_layers_shapes(v034, family_checkpoints, tmp_path,
                                                                             caplog, member, fmt):  # fmt: skip

    out = _copy(family_checkpoints.converted(member, fmt), tmp_path)
    with caplog.at_level(logging.INFO, logger="vllm.mla_runtime"):
        layers = serve(v034, out)
    assert sorted(layers) == list(range(LAYERS))
    assert_served_from_artifacts(layers, out)
    assert [hasattr(b.self_attn, "kv_a_proj_with_mqa") for b in layers.model.model.layers] == [
        s == i for i, s in enumerate(SOURCES)
    ]
    summary = plugin.summary()[0]
    assert summary["loaded"] == summary["spot_checked"] == LAYERS


def test_demo_shows_mistral_large_4(tmp_path):
    from typer.testing import CliRunner

    from mla_convert.cli.app import app

    res = CliRunner().invoke(app, ["demo", "--family", MEMBER, "--out", str(tmp_path / "d"), "--json"])
    assert res.exit_code == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["verify"]["ok"] and summary["verify"]["failed"] == 0
    params = json.loads((tmp_path / "d" / "source" / PARAMS).read_text())
    assert params["dsa"] and params["nope"] and params["kv_sharing"]["source_layers_str"]


def test_a_dsa_block_selects_large_4_and_large_3_keeps_its_own(family_checkpoints):
    """The registry asks the later member first: a params.json with `dsa` is Large 4's; Large 3's
    checkpoints (no `dsa`) stay Large 3's, its module untouched."""
    from mla_convert.source import members

    assert members.own_layout_of(family_checkpoints.source(MEMBER)).name == MEMBER
    assert members.own_layout_of(family_checkpoints.source("mistral-large-3")).name == "mistral-large-3"
    assert open_source(family_checkpoints.source("mistral-large-3")).layout.architecture == "MistralLarge3ForCausalLM"
