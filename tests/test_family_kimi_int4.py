"""Kimi-K2-Thinking, K2.5 and K2.6 (shared/reference/model-family.md, "The members of late 2026"):
compressed-tensors pack-quantized INT4 routed experts (symmetric, group 32: weight_packed I32,
weight_scale BF16, weight_shape I32), everything else BF16; K2.5/K2.6 wrap the text model
(KimiK25ForConditionalGeneration, a nested text_config; K2.6 keeps its quantization_config only
there), prefix its tensors with `language_model.` and add a BF16 vision tower and projector.

channel-fp8 copies the INT4 experts bit for bit and quantizes the BF16 linears DeepSeek's FP8
releases quantize, under one compressed-tensors config with the source's INT4 group and a new
channel-FP8 group (validated by compressed-tensors, whose own matching gives each module the
right scheme); bf16 dequantizes the experts as (nibble - 8) x scale in fp32, rounded once; the MLA
artifacts are bit-exact splits of the BF16 kv_b_proj. Bad input is refused before anything is
written."""

from __future__ import annotations

import json
import math
import shutil
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from mla_convert.cli.app import app
from mla_convert.conversion.pipeline import convert
from mla_convert.kernels import numerics
from mla_convert.settings import Options
from mla_convert.verification import verify
from mla_runtime.format import read_manifest, w_uk_t_name, w_uv_name
from support.cli_runner import cli_error
from support.edits import edit_json, rewrite_output_tensor, rewrite_shard, shard_of

FP8, BF16 = "channel-fp8", "bf16"
MEMBERS = ["kimi-k2-thinking", "kimi-k2.5", "kimi-k2.6"]
NESTED = {"kimi-k2-thinking": False, "kimi-k2.5": True, "kimi-k2.6": True}
INT4_PARTS = ("weight_packed", "weight_scale", "weight_shape")
# What DeepSeek's FP8 releases quantize, by a module's last name (attention, shared experts, dense MLP).
QUANTIZED_LINEARS = {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj",
                     "down_proj"}  # fmt: skip
runner = CliRunner()


def prefix(member: str) -> str:
    return "language_model." if NESTED[member] else ""


def module_of(name: str) -> str:
    return name.rsplit(".", 1)[0]


def text_config(cfg: dict, member: str) -> dict:
    return cfg["text_config"] if NESTED[member] else cfg


def ok(report) -> bool:
    failures = [f.line() for f in report.failures()]
    assert not failures, "\n".join(failures[:10])
    return report.ok


def int4_modules(src: dict) -> set[str]:
    return {n[: -len(".weight_packed")] for n in src if n.endswith(".weight_packed")}


def expected_output(src: dict[str, torch.Tensor], fmt: str, reference, pre: str) -> dict[str, torch.Tensor]:
    """From the slow reference: INT4 experts copied (channel-fp8) or dequantized to bf16; a BF16
    linear DeepSeek's FP8 releases quantize to channel FP8 per row (channel-fp8); the rest copied."""
    out, int4 = {}, int4_modules(src)
    for name, t in src.items():
        module = module_of(name)
        if module in int4:
            if fmt == FP8:
                out[name] = t
            elif name.endswith(".weight_packed"):
                k = int(src[module + ".weight_shape"][1])
                out[module + ".weight"] = reference.int4_dequant(t, src[module + ".weight_scale"], k).bfloat16()
            continue
        last = module.rsplit(".", 1)[-1]
        text = name.startswith(pre + "model.layers.")
        if fmt == FP8 and text and last in QUANTIZED_LINEARS and name.endswith(".weight") and t.dim() == 2:
            out[name], out[module + ".weight_scale"] = reference.channel_fp8(t.float(), 448.0)
        else:
            out[name] = t
    return out


# --- the tiny checkpoints have Kimi's layout ---------------------------------------------------------


@pytest.mark.parametrize("member", MEMBERS)
def test_the_tiny_checkpoint_has_kimis_int4_layout(family_checkpoints, load_all, load_json, member):
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    src = family_checkpoints.source(member)
    cfg = load_json(src / "config.json")
    text, pre = text_config(cfg, member), prefix(member)
    assert text["model_type"] == "kimi_k2" and text["num_nextn_predict_layers"] == 0
    if NESTED[member]:
        assert cfg["architectures"] == ["KimiK25ForConditionalGeneration"] and cfg["model_type"] == "kimi_k25"
        assert ("quantization_config" in cfg) == (member == "kimi-k2.5")
        assert ("quantization_config" in text) == (member == "kimi-k2.6")
    else:
        assert cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    qc = cfg.get("quantization_config") or text["quantization_config"]
    (group,) = qc["config_groups"].values()
    assert qc["format"] == "pack-quantized" and group["targets"] == ["Linear"]
    want = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}
    assert {k: group["weights"][k] for k in want} == want
    t = load_all(src)
    int4 = int4_modules(t)
    assert int4 and all(".mlp.experts." in m for m in int4)
    assert all(m.startswith(pre + "model.layers.") for m in int4)
    for m in int4:
        packed, scale, shape = (t[f"{m}.{p}"] for p in INT4_PARTS)
        n, k = shape.tolist()
        assert packed.dtype == torch.int32 and scale.dtype == torch.bfloat16 and shape.dtype == torch.int32
        assert packed.shape == (n, k // 8) and scale.shape == (n, k // 32)
        codes = unpack_from_int32(packed, 4, torch.Size([n, k]))  # compressed-tensors' own reader
        assert codes.min() >= -8 and codes.max() <= 7
    others = {n: x for n, x in t.items() if module_of(n) not in int4}
    assert {x.dtype for x in others.values()} <= {torch.bfloat16, torch.float32}
    assert t[pre + "model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert t[pre + "model.layers.0.self_attn.kv_b_proj.weight"].dtype == torch.bfloat16
    vision = [n for n in t if n.startswith(("vision_tower.", "mm_projector."))]
    assert bool(vision) == NESTED[member]
    shards = sorted(p.name for p in src.glob("*.safetensors"))
    assert shards == [f"model-{i:05d}-of-000004.safetensors" for i in range(1, 5)]


def test_int4_numerics_follow_compressed_tensors_and_the_reference(reference):
    """The unpacking and dequant of kernels.numerics against compressed-tensors' packer and the
    element-by-element reference: every code in every nibble position, negative words, group and
    channel scales; the fp32 product exact, bf16 one rounding of it."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    g = torch.Generator().manual_seed(0)
    line = torch.arange(-8, 8, dtype=torch.int8).repeat(8)  # 128 columns
    codes = torch.stack([torch.roll(line, r) for r in range(8)])  # every value at every column mod 8
    codes = torch.cat([codes, torch.randint(-8, 8, (8, 128), generator=g, dtype=torch.int8)], dim=0)
    packed = pack_to_int32(codes, 4)
    assert (packed < 0).any()  # a word whose top nibble is >= 8 is negative
    assert torch.equal(numerics.unpack_int4(packed, codes.shape[1]), codes.to(torch.int32))
    for groups in (4, 1):  # group 32 and one scale per row (strategy channel)
        scale = (torch.rand(codes.shape[0], groups, generator=g) * 0.1 + 1e-3).bfloat16()
        k = codes.shape[1]
        got = numerics.dequantize_int4(packed, scale, k, k // groups)
        want = reference.int4_dequant(packed, scale, k)
        assert reference.same_bits(got, want)
        assert reference.same_bits(numerics.int4_to_bf16(packed, scale, k, k // groups), want.bfloat16())


# --- both formats, to the reference -------------------------------------------------------------------


@pytest.mark.parametrize("member", MEMBERS)
@pytest.mark.parametrize("fmt", [FP8, BF16])
def test_converts_to_the_reference(family_checkpoints, load_all, reference, member, fmt):
    src, got = load_all(family_checkpoints.source(member)), load_all(family_checkpoints.converted(member, fmt))
    want = expected_output(src, fmt, reference, prefix(member))
    assert set(got) == set(want)
    for name, t in want.items():
        assert reference.same_bits(got[name], t), name
    if fmt == BF16:
        assert not any(n.endswith(INT4_PARTS) for n in got)
        assert {t.dtype for t in got.values()} <= {torch.bfloat16, torch.float32}


@pytest.mark.parametrize("member", MEMBERS)
@pytest.mark.parametrize("fmt", [FP8, BF16])
def test_artifacts_are_bit_exact_splits_of_the_bf16_kv_b_proj(family_checkpoints, load_all, reference, member, fmt):
    src = load_all(family_checkpoints.source(member))
    out = family_checkpoints.converted(member, fmt)
    manifest = read_manifest(out / "mla")
    assert manifest.layer_ids() == [0, 1, 2]
    for i in range(3):
        kv_b = src[f"{prefix(member)}model.layers.{i}.self_attn.kv_b_proj.weight"]
        uk_t, uv = reference.seed_split(kv_b, 2, 128, 128, 512)
        with safe_open(str(out / "mla" / manifest.entry(i).file), "pt") as f:
            assert reference.same_bits(f.get_tensor(w_uk_t_name(i)), uk_t)
            assert reference.same_bits(f.get_tensor(w_uv_name(i)), uv)


@pytest.mark.parametrize("member", MEMBERS)
@pytest.mark.parametrize("fmt", [FP8, BF16])
def test_the_output_config_keeps_the_nesting_and_the_quantization_config_in_its_place(
    family_checkpoints, load_json, member, fmt
):
    src_cfg = load_json(family_checkpoints.source(member) / "config.json")
    cfg = load_json(family_checkpoints.converted(member, fmt) / "config.json")

    def without_qc(c):
        c = dict(c)
        c.pop("quantization_config", None)
        if "text_config" in c:
            c["text_config"] = {k: v for k, v in c["text_config"].items() if k != "quantization_config"}
        return c

    assert without_qc(cfg) == without_qc(src_cfg)
    for where, src_where in [(cfg, src_cfg)] + (
        [(cfg["text_config"], src_cfg["text_config"])] if NESTED[member] else []
    ):
        assert ("quantization_config" in where) == (fmt == FP8 and "quantization_config" in src_where)


@pytest.mark.parametrize("member", MEMBERS)
def test_the_channel_fp8_config_validates_and_gives_each_module_its_scheme(
    family_checkpoints, load_all, load_json, member
):
    """compressed-tensors validates the two-group config, and its own target matching (a name or
    regex target before the class "Linear", ignore first) gives every routed expert the source's INT4
    group, every BF16 linear DeepSeek's FP8 releases quantize the channel-FP8 group, and leaves the
    router, lm_head and the vision part unquantized, as the tensors are."""
    from compressed_tensors import CompressionFormat
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils.match import is_match, match_targets

    src_cfg = load_json(family_checkpoints.source(member) / "config.json")
    out = family_checkpoints.converted(member, FP8)
    cfg = load_json(out / "config.json")
    qc = cfg.get("quantization_config") or cfg["text_config"]["quantization_config"]
    src_qc = src_cfg.get("quantization_config") or src_cfg["text_config"]["quantization_config"]
    parsed = QuantizationConfig.model_validate(qc)
    assert qc["format"] == "mixed-precision" and qc["format"] in [f.value for f in CompressionFormat]
    (src_name, src_group), (int4_name, int4_group) = (
        *src_qc["config_groups"].items(),
        *[(n, g) for n, g in qc["config_groups"].items() if g["weights"]["type"] == "int"],
    )
    assert int4_name == src_name and int4_group["weights"] == src_group["weights"]
    assert int4_group["format"] == "pack-quantized" and "Linear" not in int4_group["targets"]
    targets = [t for g in qc["config_groups"].values() for t in g["targets"]]
    assert len(targets) == len(set(targets))  # no target in two groups (the later would win silently)
    by_target = OrderedDict((t, name) for name, g in parsed.config_groups.items() for t in g.targets)
    t = load_all(out)
    lin = torch.nn.Linear(1, 1)
    modules = {module_of(n) for n, x in t.items() if n.endswith((".weight", ".weight_packed")) and x.dim() == 2}
    modules -= {m for m in modules if m.endswith("embed_tokens")}
    assert modules
    for m in modules:
        if is_match(m, lin, parsed.ignore):
            scheme = "ignored"
        else:
            matched = match_targets(m, lin, list(by_target))
            scheme = parsed.config_groups[by_target[matched[0]]].weights.type if matched else "ignored"
        if m + ".weight_packed" in t:
            assert scheme == "int", m
        elif t[m + ".weight"].dtype == torch.float8_e4m3fn:
            assert scheme == "float", m
        else:
            assert scheme == "ignored", m
    assert any(".experts." in m for m in modules) and any(m.endswith("kv_b_proj") for m in modules)


# --- verify catches what it must ----------------------------------------------------------------------


def _copy(path: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(path, tmp_path / path.name))


def test_verify_source_catches_one_wrong_bf16_element_of_an_expert(family_checkpoints, tmp_path):
    src = family_checkpoints.source("kimi-k2-thinking")
    out = _copy(family_checkpoints.converted("kimi-k2-thinking", BF16), tmp_path)
    name = "model.layers.2.mlp.experts.5.down_proj.weight"
    rewrite_output_tensor(out, name, lambda t: t[name].view(torch.int16)[3, 7].__ixor__(1))
    report = verify(out, src)
    bad = [(f.check, f.tensor) for f in report.groups["source"].failures]
    assert bad == [("int4-bf16-exact", name)]


def test_verify_source_catches_a_changed_int4_code(family_checkpoints, tmp_path):
    src = family_checkpoints.source("kimi-k2.5")
    out = _copy(family_checkpoints.converted("kimi-k2.5", FP8), tmp_path)
    name = "language_model.model.layers.1.mlp.experts.0.up_proj.weight_packed"
    rewrite_output_tensor(out, name, lambda t: t[name][0].__ixor__(0xF))
    report = verify(out, src)
    assert [(f.check, f.tensor) for f in report.groups["source"].failures] == [("copy-exact", name)]


def test_verify_catches_an_int4_group_that_does_not_cover_the_experts(family_checkpoints, tmp_path):
    out = _copy(family_checkpoints.converted("kimi-k2-thinking", FP8), tmp_path)

    def narrow(cfg):
        for g in cfg["quantization_config"]["config_groups"].values():
            if g["weights"]["type"] == "int":
                g["targets"] = [r"re:.*mlp\.experts\.\d+\.(gate|up)_proj$"]  # down_proj left to the FP8 group

    edit_json(out / "config.json", narrow)
    report = verify(out)
    bad = report.groups["structure"].failures
    assert not report.ok and bad  # the down_proj experts: an FP8 weight expected, INT4 tensors found
    assert all(".experts." in f.tensor and ".down_proj" in f.tensor for f in bad), bad[0]


# --- bad input: one line, exit 2, nothing written ----------------------------------------------------


@pytest.fixture
def k2(family_checkpoints, tmp_path) -> Path:
    return _copy(family_checkpoints.source("kimi-k2-thinking"), tmp_path)


EXPERT = "model.layers.1.mlp.experts.4.gate_proj"  # [192, 256]: 8 groups of 32 columns


@pytest.mark.parametrize("fmt", [FP8, BF16])
def test_a_weight_shape_that_disagrees_with_the_packed_weight_is_refused(k2, tmp_path, fmt):
    name = EXPERT + ".weight_shape"
    rewrite_shard(shard_of(k2, name), lambda t: t.__setitem__(name, torch.tensor([192, 288], dtype=torch.int32)))
    line = cli_error(["convert", k2, "--out", tmp_path / "o", "--format", fmt], tmp_path / "o")
    assert f"weight_shape {name!r} is [192, 288]" in line and "[N, K] = [192, 256]" in line


def test_an_int4_scale_whose_shape_does_not_match_its_packed_weight_is_refused(k2, tmp_path):
    name = EXPERT + ".weight_scale"
    rewrite_shard(shard_of(k2, name), lambda t: t.__setitem__(name, t[name][:, :4].contiguous()))
    line = cli_error(["convert", k2, "--out", tmp_path / "o"], tmp_path / "o")
    assert repr(name) in line and "[192, 4]" in line and "[192, 32]" in line
    assert "[N, K / group_size] = [192, 256 / 32] = [192, 8]" in line


def test_a_group_size_that_does_not_divide_k_is_refused(k2, tmp_path):
    edit_json(k2 / "config.json", lambda c: c["quantization_config"]["config_groups"]["group_0"]["weights"]
              .__setitem__("group_size", 40))  # fmt: skip
    line = cli_error(["convert", k2, "--out", tmp_path / "o"], tmp_path / "o")
    assert "group_size 40 does not divide the" in line and "columns of 'model.layers.1.mlp.experts" in line


def _asymmetric(root: Path) -> None:
    """The same checkpoint with an asymmetric INT4 scheme: symmetric false and a weight_zero_point
    (packed along rows, as compressed-tensors packs it) for every INT4 weight."""
    edit_json(root / "config.json",
              lambda c: c["quantization_config"]["config_groups"]["group_0"]["weights"].__setitem__("symmetric", False))  # fmt: skip
    index = json.loads((root / "model.safetensors.index.json").read_text())

    def add_zero_points(tensors):
        for name in [n for n in tensors if n.endswith(".weight_packed")]:
            m, (n, words) = name[: -len(".weight_packed")], tensors[name].shape
            tensors[m + ".weight_zero_point"] = torch.zeros(math.ceil(n / 8), words * 8 // 32, dtype=torch.int32)
            index["weight_map"][m + ".weight_zero_point"] = index["weight_map"][name]

    for shard in sorted(set(index["weight_map"].values())):
        rewrite_shard(root / shard, add_zero_points)
    (root / "model.safetensors.index.json").write_text(json.dumps(index))


def test_an_asymmetric_scheme_is_refused_for_bf16_naming_the_module(k2, tmp_path):
    _asymmetric(k2)
    line = cli_error(["convert", k2, "--out", tmp_path / "o", "--format", "bf16"], tmp_path / "o")
    assert "'model.layers.1.mlp.experts.0.down_proj' is asymmetric INT4" in line and "channel-fp8" in line


def test_an_asymmetric_scheme_converts_to_channel_fp8_its_zero_points_copied(k2, tmp_path, load_all, reference):
    _asymmetric(k2)
    convert(k2, tmp_path / "o", Options())
    src, got = load_all(k2), load_all(tmp_path / "o")
    zero = [n for n in src if n.endswith(".weight_zero_point")]
    assert zero and all(reference.same_bits(got[n], src[n]) for n in zero)
    assert ok(verify(tmp_path / "o")) and ok(verify(tmp_path / "o", k2))


def test_a_nested_config_without_the_mla_dims_is_refused(family_checkpoints, tmp_path):
    src = _copy(family_checkpoints.source("kimi-k2.6"), tmp_path)
    edit_json(src / "config.json", lambda c: c["text_config"].pop("kv_lora_rank"))
    line = cli_error(["convert", src, "--out", tmp_path / "o"], tmp_path / "o")
    assert "config.json: KimiK25ForConditionalGeneration's text_config:" in line and "kv_lora_rank" in line


def test_a_wrapper_without_its_text_config_is_refused(family_checkpoints, tmp_path):
    src = _copy(family_checkpoints.source("kimi-k2.5"), tmp_path)
    edit_json(src / "config.json", lambda c: c.pop("text_config"))
    line = cli_error(["convert", src, "--out", tmp_path / "o"], tmp_path / "o")
    assert "KimiK25ForConditionalGeneration keeps its text model in text_config" in line


def test_ignoring_int4_experts_in_channel_fp8_is_refused(k2, tmp_path):
    line = cli_error(["convert", k2, "--out", tmp_path / "o", "--ignore", r"model\.layers\.1\.mlp\.experts\."],
                     tmp_path / "o")  # fmt: skip
    assert "an INT4 weight" in line and "--format bf16" in line


def test_demo_shows_kimi_k2_6(tmp_path):
    res = runner.invoke(app, ["demo", "--family", "kimi-k2.6", "--out", str(tmp_path / "d"), "--json"])
    assert res.exit_code == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["verify"]["ok"] and summary["verify"]["failed"] == 0
