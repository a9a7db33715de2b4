"""Mistral-Large-3 in Mistral's own layout (shared/reference/model-family.md, "The members of late
2026"): params.json and no config.json, consolidated shards and index, tekken.json, Mistral's tensor
names, compressed-tensors FP8_BLOCK with BF16 block multipliers, a BF16 vision encoder, no MTP layer
and no e_score_correction_bias. It converts in both formats to the same layout, bit-exact to the
reference; its params.json's ignore list is in vLLM's module names and agrees with what was written;
verify passes with and without --source and catches what it must; bad input is one line."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from mla_convert.cli.app import app
from mla_convert.conversion.pipeline import convert
from mla_convert.demo.specs import CheckpointSpec
from mla_convert.demo.synthetic import write_checkpoint
from mla_convert.settings import Options
from mla_convert.verification import verify
from mla_runtime.format import read_manifest, w_uk_t_name, w_uv_name
from support import checkpoints
from support.edits import rewrite_output_tensor
from support.mistral_layout import expected_output

FP8, BF16 = "channel-fp8", "bf16"
PARAMS, INDEX = "params.json", "consolidated.safetensors.index.json"
MEMBERS = ["mistral-large-3", "mistral-large-3-bf16"]
runner = CliRunner()

# model-family.md's name map: Mistral-Large-3's module names and their DeepSeek-V3 (HF) ones.
TOP = {"tok_embeddings": "model.embed_tokens", "output": "lm_head", "norm": "model.norm"}
LAYER = {
    "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attention.wq_a": "self_attn.q_a_proj", "attention.q_a_norm": "self_attn.q_a_layernorm",
    "attention.wq_b": "self_attn.q_b_proj", "attention.wkv_a_with_mqa": "self_attn.kv_a_proj_with_mqa",
    "attention.kv_a_norm": "self_attn.kv_a_layernorm", "attention.wkv_b": "self_attn.kv_b_proj",
    "attention.wo": "self_attn.o_proj", "gate": "mlp.gate",
}  # fmt: skip
W = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
# What Mistral's FP8 release quantizes, by a module's Mistral name (the rest is BF16).
FP8_MODULE = re.compile(
    r"layers\.\d+\.(attention\.(wq_b|wkv_b|wo)|(feed_forward|shared_experts|experts\.\d+)\.w[123])$"
)
VISION = ("vision_encoder.", "patch_merger.", "pre_mm_projector_norm.", "vision_language_adapter.")


def hf_module(module: str) -> str | None:
    """The HF (vLLM) name of a Mistral module, from the map above; None for the vision part."""
    if module in TOP:
        return TOP[module]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", module)
    if m is None:
        return None
    layer, rest = m.groups()
    if rest in LAYER:
        return f"model.layers.{layer}.{LAYER[rest]}"
    e = re.fullmatch(r"(feed_forward|shared_experts|experts\.\d+)\.(w[123])", rest)
    where = {"feed_forward": "mlp"}.get(e.group(1), f"mlp.{e.group(1)}")
    return f"model.layers.{layer}.{where}.{W[e.group(2)]}"


def module_of(name: str) -> str:
    return name.rsplit(".", 1)[0]


def load_all(root: Path) -> dict[str, torch.Tensor]:
    return checkpoints.load_all(root, INDEX)


def params(root: Path) -> dict:
    return json.loads((root / PARAMS).read_text())


def ok(report) -> bool:
    failures = [f.line() for f in report.failures()]
    assert not failures, "\n".join(failures[:10])
    return report.ok


# --- the tiny checkpoint has the real layout ------------------------------------------------------


def test_the_tiny_checkpoint_has_mistral_large_3s_layout(family_checkpoints):
    src = family_checkpoints.source("mistral-large-3")
    assert not (src / "config.json").exists() and (src / "tekken.json").exists()
    shards = sorted(p.name for p in src.glob("*.safetensors"))
    assert shards == [f"consolidated-{i:05d}-of-00004.safetensors" for i in range(1, 5)]
    p = params(src)
    for key in ("dim", "n_layers", "n_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                "v_head_dim", "hidden_dim", "vocab_size"):  # fmt: skip
        assert isinstance(p[key], int), key
    assert set(p["moe"]) >= {"num_experts", "num_experts_per_tok", "num_shared_experts", "expert_hidden_dim",
                             "first_k_dense_replace"}  # fmt: skip
    qc = p["quantization_config"]
    assert (
        qc["quant_method"] == "compressed-tensors"
        and qc["config_groups"]["FP8_BLOCK"]["weights"]["strategy"] == "block"
    )
    assert "re:.*q_a_proj$" in qc["ignore"] and "lm_head" in qc["ignore"]  # HF names, as Mistral's
    t = load_all(src)
    for name, x in t.items():
        module = module_of(name)
        if name.startswith(VISION):
            assert x.dtype == torch.bfloat16, name
        elif name.endswith(".weight_scale"):
            w = t[module + ".weight"]
            assert x.dtype == torch.bfloat16 and list(x.shape) == [math.ceil(s / 128) for s in w.shape], name
        else:
            assert hf_module(module) is not None, name
            assert (x.dtype == torch.float8_e4m3fn) == bool(FP8_MODULE.match(module)), name
    assert "layers.0.attention.wkv_b.weight" in t and "layers.1.experts.7.w2.weight" in t
    assert not any("e_score_correction_bias" in n or n.startswith("layers.3.") for n in t)  # no bias, no MTP
    assert t["layers.0.attention.wkv_b.weight"].shape == (4 * (128 + 128), 512)


# --- both formats, bit-exact to the reference, in the same layout -----------------------------------


@pytest.mark.parametrize("member", MEMBERS)
@pytest.mark.parametrize("fmt", [FP8, BF16])
def test_converts_to_the_reference_in_the_same_layout(family_checkpoints, reference, member, fmt):
    src_dir, out_dir = family_checkpoints.source(member), family_checkpoints.converted(member, fmt)
    src, got = load_all(src_dir), load_all(out_dir)
    want = expected_output(src, fmt, reference, fp8_source=member == "mistral-large-3", quantized=FP8_MODULE)
    assert set(got) == set(want)
    for name, t in want.items():
        assert reference.same_bits(got[name], t), name
    assert not (out_dir / "config.json").exists()
    assert sorted(p.name for p in out_dir.glob("*.safetensors")) == sorted(
        p.name for p in src_dir.glob("*.safetensors")
    )
    assert (out_dir / "tekken.json").read_bytes() == (src_dir / "tekken.json").read_bytes()
    index = json.loads((out_dir / INDEX).read_text())
    assert set(index["weight_map"]) == set(got)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in got.values())
    out_params, src_params = params(out_dir), params(src_dir)
    rest = {k: v for k, v in out_params.items() if k != "quantization_config"}
    assert rest == {k: v for k, v in src_params.items() if k != "quantization_config"}
    assert ("quantization_config" in out_params) == (fmt == FP8)


@pytest.mark.parametrize("member", MEMBERS)
@pytest.mark.parametrize("fmt", [FP8, BF16])
def test_artifacts_are_bit_exact_splits_of_the_exact_wkv_b(family_checkpoints, reference, member, fmt):
    src = load_all(family_checkpoints.source(member))
    out = family_checkpoints.converted(member, fmt)
    manifest = read_manifest(out / "mla")
    assert manifest.layer_ids() == [0, 1, 2]  # every decoder layer, and no MTP layer
    for i in range(3):
        w = src[f"layers.{i}.attention.wkv_b.weight"]
        scale = src.get(f"layers.{i}.attention.wkv_b.weight_scale")
        exact = reference.dequant_block(w, scale, (128, 128)) if scale is not None else w.float()
        uk_t, uv = reference.seed_split(exact.to(torch.bfloat16), 4, 128, 128, 512)
        with safe_open(str(out / "mla" / manifest.entry(i).file), "pt") as f:
            assert reference.same_bits(f.get_tensor(w_uk_t_name(i)), uk_t)
            assert reference.same_bits(f.get_tensor(w_uv_name(i)), uv)


@pytest.mark.parametrize("member", MEMBERS)
def test_the_ignore_list_is_in_vllms_names_and_agrees_with_the_tensors(family_checkpoints, member):
    """Every linear written in 16 bits is ignored and every other one is channel FP8, in the module
    names vLLM matches: the HF names, behind `language_model.` since the model has a vision encoder
    (vLLM serves it as PixtralForConditionalGeneration). compressed-tensors validates the config and
    its own matching agrees."""
    from compressed_tensors import CompressionFormat
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils.match import is_match

    out = family_checkpoints.converted(member, FP8)
    qc = params(out)["quantization_config"]
    QuantizationConfig.model_validate(qc)
    assert qc["format"] in [f.value for f in CompressionFormat]
    t = load_all(out)
    lin = torch.nn.Linear(1, 1)
    text_linears = {
        module_of(n) for n, x in t.items() if n.endswith(".weight") and x.dim() == 2 and not n.startswith(VISION)
    } - {"tok_embeddings"}
    for module in text_linears:
        served = "language_model." + hf_module(module)
        quantized = t[module + ".weight"].dtype == torch.float8_e4m3fn
        assert quantized == (not is_match(served, lin, qc["ignore"])), module
        assert quantized == bool(FP8_MODULE.match(module)), module
    named = {e for e in qc["ignore"] if not e.startswith("re:")}
    assert named == {"language_model." + hf_module(m) for m in text_linears if t[m + ".weight"].dtype == torch.bfloat16}
    vision = [n for n, x in t.items() if n.startswith(VISION) and x.dim() == 2]
    assert vision and all(is_match(n.rsplit(".", 1)[0], lin, qc["ignore"]) for n in vision)


def test_a_text_only_checkpoint_ignores_by_plain_hf_names(tmp_path, load_json):
    src = write_checkpoint(tmp_path / "src", CheckpointSpec.family("mistral-large-3", vision=False))
    convert(src, tmp_path / "out", Options())
    ignore = load_json(tmp_path / "out" / PARAMS)["quantization_config"]["ignore"]
    assert "lm_head" in ignore and "model.layers.0.self_attn.q_a_proj" in ignore
    assert not any(e.startswith(("language_model.", "re:")) for e in ignore)
    assert ok(verify(tmp_path / "out")) and ok(verify(tmp_path / "out", src))


# --- verify catches what it must ----------------------------------------------------------------


def _copy(path: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(path, tmp_path / path.name))


def test_verify_source_catches_a_changed_vision_tensor(family_checkpoints, tmp_path):
    src = family_checkpoints.source("mistral-large-3")
    out = _copy(family_checkpoints.converted("mistral-large-3", BF16), tmp_path)
    name = "vision_language_adapter.w_in.weight"
    rewrite_output_tensor(out, name, lambda t: t[name].view(torch.int16).__ixor__(1), INDEX)
    assert ok(verify(out))  # without the source a copy cannot be compared
    report = verify(out, src)
    assert [(f.check, f.tensor) for f in report.groups["source"].failures] == [("copy-exact", name)]


def test_verify_catches_an_ignore_list_that_misses_a_bf16_linear(family_checkpoints, tmp_path):
    out = _copy(family_checkpoints.converted("mistral-large-3", FP8), tmp_path)
    p = params(out)
    p["quantization_config"]["ignore"].remove("language_model.model.layers.1.self_attn.q_a_proj")
    (out / PARAMS).write_text(json.dumps(p))
    report = verify(out)
    bad = [f for f in report.groups["structure"].failures if f.check == "quantization_config"]
    assert [f.tensor for f in bad] == ["layers.1.attention.wq_a"]


def test_verify_fails_an_output_whose_wkv_b_artifact_differs(family_checkpoints, tmp_path):
    out = _copy(family_checkpoints.converted("mistral-large-3", BF16), tmp_path)
    name = "layers.2.attention.wkv_b.weight"
    rewrite_output_tensor(out, name, lambda t: t[name].view(torch.int16)[0, :8].__ixor__(0x40), INDEX)
    report = verify(out)
    assert any(f.check == "split-exact" for f in report.groups["mla"].failures)


# --- bad input: one line, exit 2, nothing written ------------------------------------------------------


def cli_error(args: list, out: Path) -> str:
    res = runner.invoke(app, [str(a) for a in args])
    assert res.exit_code == 2, (res.stdout, res.stderr)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert not out.exists()
    return lines[0]


def _edit_params(root: Path, change) -> None:
    p = params(root)
    change(p)
    (root / PARAMS).write_text(json.dumps(p))


@pytest.fixture
def mistral_copy(family_checkpoints, tmp_path) -> Path:
    return _copy(family_checkpoints.source("mistral-large-3"), tmp_path)


def test_params_dims_against_the_tensors_name_the_field_the_tensor_and_the_numbers(mistral_copy, tmp_path):
    _edit_params(mistral_copy, lambda p: p.update(n_heads=8))
    line = cli_error(["convert", mistral_copy, "--out", tmp_path / "o"], tmp_path / "o")
    assert "params.json: n_heads is 8, but 'layers.0.attention.wkv_b.weight' [1024, 512] has 1024 rows" in line
    assert "n_heads x (qk_nope_head_dim + v_head_dim) = 8 x (128 + 128) = 2048; the tensor fits n_heads 4" in line


def test_a_moe_dim_against_the_experts_names_the_params_field(mistral_copy, tmp_path):
    _edit_params(mistral_copy, lambda p: p["moe"].update(expert_hidden_dim=96))
    line = cli_error(["convert", mistral_copy, "--out", tmp_path / "o"], tmp_path / "o")
    assert "moe.expert_hidden_dim is 96, but 'layers.1.experts.0.w3.weight' [192, 256] has 192 rows" in line
    assert "fits moe.expert_hidden_dim 192" in line


def test_the_nvfp4_release_is_refused_saying_what_it_is(mistral_copy, tmp_path):
    def nvfp4(p):
        group = p["quantization_config"]["config_groups"].pop("FP8_BLOCK")
        group["weights"] = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
                            "symmetric": True, "dynamic": False}  # fmt: skip
        group["format"] = "nvfp4-pack-quantized"
        p["quantization_config"]["config_groups"]["NVFP4"] = group
        p["quantization_config"]["format"] = "nvfp4-pack-quantized"

    _edit_params(mistral_copy, nvfp4)
    line = cli_error(["convert", mistral_copy, "--out", tmp_path / "o"], tmp_path / "o")
    assert "NVFP4" in line and "Mistral-Large-3's NVFP4 release" in line and "FP8 or BF16 release" in line


def test_a_mistral_model_without_mla_is_refused(mistral_copy, tmp_path):
    _edit_params(mistral_copy, lambda p: [p.pop(k) for k in ("qk_nope_head_dim", "kv_lora_rank")])
    line = cli_error(["convert", mistral_copy, "--out", tmp_path / "o"], tmp_path / "o")
    assert "params.json" in line and "not an MLA checkpoint" in line


def test_a_large_3_params_json_without_q_lora_is_refused_not_a_crash(mistral_copy, tmp_path):
    # Large 3's names have attention.wq_a / wq_b only; a plain wq is Large 4's (with a `dsa` block).
    _edit_params(mistral_copy, lambda p: p.update(q_lora_rank=None))
    line = cli_error(["convert", mistral_copy, "--out", tmp_path / "o"], tmp_path / "o")
    assert "q_lora_rank is None" in line and "`dsa` block of Mistral-Large-4" in line


def test_a_bf16_block_multiplier_that_is_not_finite_is_refused(mistral_copy, tmp_path):
    name = "layers.1.experts.2.w1.weight_scale"
    shard = json.loads((mistral_copy / INDEX).read_text())["weight_map"][name]
    tensors = load_file(str(mistral_copy / shard))
    tensors[name][0, 0] = float("inf")
    save_file(tensors, str(mistral_copy / shard))
    line = cli_error(["convert", mistral_copy, "--out", tmp_path / "o"], tmp_path / "o")
    assert repr(name) in line and "NaN or Inf" in line


def test_demo_shows_mistral_large_3(tmp_path):
    res = runner.invoke(app, ["demo", "--family", "mistral-large-3", "--out", str(tmp_path / "d"), "--json"])
    assert res.exit_code == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["verify"]["ok"] and summary["verify"]["failed"] == 0
    assert (tmp_path / "d" / "source" / PARAMS).exists() and not (tmp_path / "d" / "source" / "config.json").exists()


def test_native_kernels_read_its_bf16_block_scales_as_eager_does(family_checkpoints, tmp_path):
    """The native path widens the BF16 weight_scale without torch (conversion.scales); the output is
    the eager one's, byte for byte (the tests' default kernels are eager)."""
    from mla_convert.settings import RunSettings
    from support.checkpoints import conversion_hashes

    src = family_checkpoints.source("mistral-large-3")
    with safe_open(str(src / "consolidated-00001-of-00004.safetensors"), "pt") as f:
        scale_dtypes = {f.get_slice(n).get_dtype() for n in f.keys() if n.endswith(".weight_scale")}  # noqa: SIM118 (safe_open is not iterable)
    assert scale_dtypes == {"BF16"}
    result = convert(src, tmp_path / "native", Options(), RunSettings(kernels="native"))
    assert result.kernels == "native"
    assert conversion_hashes(tmp_path / "native") == conversion_hashes(
        family_checkpoints.converted("mistral-large-3", FP8)
    )
