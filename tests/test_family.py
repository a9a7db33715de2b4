"""The MLA family: every member's tiny checkpoint (the structure in the project's reference notes,
shared/reference/model-family.md, dims shrunk) converts in both formats, every output tensor
matches the slow reference, and verify passes with and without --source; bad input is refused in
one line before anything is written."""

import json
import math
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
from mla_convert.errors import SourceError
from mla_convert.settings import Options
from mla_convert.source import members
from mla_convert.verification import verify
from mla_runtime.format import read_manifest, w_uk_t_name, w_uv_name
from support.cli_runner import cli_error

MEMBERS, SUPPORTED_ARCHITECTURES = members.demo_members(), members.architectures()

FP8, BF16 = "channel-fp8", "bf16"
INDEX = "model.safetensors.index.json"
# What DeepSeek's FP8 releases quantize, by a module's last name: written out here, independently
# of mla_convert.source.family, as the oracle for what a BF16 source's channel-FP8 conversion quantizes.
QUANTIZED_LINEARS = {
    "q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "wq_b", "wk",
    "gate_proj", "up_proj", "down_proj",
}  # fmt: skip
runner = CliRunner()
# The members in DeepSeek-V3's layout (config.json, DeepSeek's names) with block-FP8 or BF16 weights:
# the generic tests below. Mistral-Large-3 (its own layout) and the Kimi INT4 members (K2-Thinking,
# K2.5, K2.6) have their own test modules, test_family_mistral.py and test_family_kimi_int4.py.
HF_MEMBERS = [
    m for m in MEMBERS if CheckpointSpec.family(m).layout == "deepseek" and CheckpointSpec.family(m).weights != "int4"
]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: intra-op threads only add sync cost on a loaded 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def module_of(name: str) -> str:
    return name.rsplit(".", 1)[0]


def block_of(cfg: dict) -> tuple[int, int] | None:
    qc = cfg.get("quantization_config")
    return tuple(qc["weight_block_size"]) if qc else None


def expected_output(src: dict, cfg: dict, fmt: str, reference, ignore=()) -> dict[str, torch.Tensor]:
    """Every tensor the conversion must write, from the slow reference: block-FP8 weights dequantized
    (bf16) or requantized per row (channel FP8); a BF16 source's quantized linears per row from
    their exact value; everything else copied."""
    import re

    block, out = block_of(cfg), {}
    for name, t in src.items():
        if name.endswith("_scale_inv"):
            continue
        module = module_of(name)
        ignored = any(re.match(p, module) for p in ignore)
        scale = src.get(name + "_scale_inv")
        if scale is not None:
            x = reference.dequant_block(t, scale, block)
        elif fmt == FP8 and block is None and module.rsplit(".", 1)[-1] in QUANTIZED_LINEARS and t.dim() == 2:
            x = t.float()
        else:
            out[name] = t
            continue
        if fmt == BF16 or ignored:
            out[name] = x.to(torch.bfloat16) if scale is not None else t
        else:
            out[name], out[module + ".weight_scale"] = reference.channel_fp8(x, 448.0)
    return out


def kv_b_value(src: dict, cfg: dict, layer: int, reference) -> torch.Tensor:
    """The exact value of a layer's source kv_b_proj (what the artifacts split, rounded to bf16)."""
    name = f"model.layers.{layer}.self_attn.kv_b_proj.weight"
    scale = src.get(name + "_scale_inv")
    return reference.dequant_block(src[name], scale, block_of(cfg)) if scale is not None else src[name].float()


def ok(report) -> bool:
    failures = [f.line() for f in report.failures()]
    assert not failures, "\n".join(failures[:10])
    return report.ok


# --- each member's tiny checkpoint has its member's structure ----------------------------------------


def test_every_member_has_a_tiny_checkpoint():
    assert set(MEMBERS) == {
        "deepseek-v3", "deepseek-v3.1", "deepseek-v3.2", "kimi-k2", "glm-5", "deepseek-v2-lite", "moonlight",
        "glm-5.2", "mistral-large-3", "mistral-large-3-bf16", "kimi-k2-thinking", "kimi-k2.5", "kimi-k2.6",
        "mistral-large-4", "mistral-large-4-fp8",
    }  # fmt: skip
    assert set(HF_MEMBERS) == {
        "deepseek-v3", "deepseek-v3.1", "deepseek-v3.2", "kimi-k2", "glm-5", "deepseek-v2-lite", "moonlight", "glm-5.2",
    }  # fmt: skip
    # Kimi-K2.5 / K2.6 declare their wrapper; the text model inside is a DeepseekV3
    archs = {CheckpointSpec.family(m).architecture for m in MEMBERS} | {
        members.wrapper_of(["KimiK25ForConditionalGeneration"]).architecture
    }
    assert archs == set(SUPPORTED_ARCHITECTURES)
    with pytest.raises(ValueError, match="deepseek-v4"):
        CheckpointSpec.family("deepseek-v4")


def _headers(root: Path) -> dict[str, tuple[str, list[int]]]:
    """name -> (safetensors dtype, shape) of every tensor of a checkpoint, from the headers."""
    out = {}
    for file in sorted(set(json.loads((root / INDEX).read_text())["weight_map"].values())):
        raw = (root / file).read_bytes()
        header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
        out |= {n: (v["dtype"], v["shape"]) for n, v in header.items() if n != "__metadata__"}
    return out


def test_deepseek_v3_1_scales_are_powers_of_two_except_o_proj(family_checkpoints, load_all, load_json):
    src = family_checkpoints.source("deepseek-v3.1")
    assert load_json(src / "config.json")["quantization_config"]["scale_fmt"] == "ue8m0"
    t = load_all(src)
    for name, s in t.items():
        if name.endswith("_scale_inv"):
            pow2 = torch.equal(torch.log2(s), torch.log2(s).round())
            assert pow2 != name.endswith("o_proj.weight_scale_inv"), name


def test_deepseek_v3_2_has_the_indexer_and_f32_norms(family_checkpoints, load_json):
    src = family_checkpoints.source("deepseek-v3.2")
    cfg = load_json(src / "config.json")
    assert cfg["architectures"] == ["DeepseekV32ForCausalLM"] and cfg["model_type"] == "deepseek_v32"
    h = _headers(src)
    x = "model.layers.3.self_attn.indexer."  # the MTP layer has one too
    assert h[x + "wq_b.weight"] == ("F8_E4M3", [512, 192]) and h[x + "wq_b.weight_scale_inv"] == ("F32", [4, 2])
    assert h[x + "wk.weight"] == ("F8_E4M3", [128, 256]) and h[x + "wk.weight_scale_inv"] == ("F32", [1, 2])
    assert h[x + "weights_proj.weight"] == ("BF16", [4, 256])
    assert h[x + "k_norm.weight"] == h[x + "k_norm.bias"] == ("F32", [128])
    norms = [n for n in h if n.endswith("norm.weight")]
    assert len(norms) > 10 and all(h[n][0] == "F32" for n in norms)


def test_kimi_k2_has_inv_freq_no_mtp_and_its_shard_names(family_checkpoints, load_json):
    src = family_checkpoints.source("kimi-k2")
    cfg = load_json(src / "config.json")
    assert cfg["model_type"] == "kimi_k2" and cfg["num_nextn_predict_layers"] == 0
    assert cfg["n_routed_experts"] == 12 and cfg["first_k_dense_replace"] == 1
    h = _headers(src)
    assert all(h[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] == ("BF16", [56]) for i in range(3))
    assert not any(n.startswith("model.layers.3.") for n in h)
    assert sorted(p.name for p in src.glob("*.safetensors")) == [f"model-{i}-of-4.safetensors" for i in range(1, 5)]
    assert (src / "tokenization_kimi.py").exists()


def test_glm_5_dims_bf16_modules_and_mtp_without_its_own_head(family_checkpoints, load_json):
    src = family_checkpoints.source("glm-5")
    cfg = load_json(src / "config.json")
    assert (cfg["qk_nope_head_dim"], cfg["v_head_dim"], cfg["q_lora_rank"]) == (192, 256, 2048)
    assert "auto_map" not in cfg and cfg["model_type"] == "glm_moe_dsa"
    h = _headers(src)
    not_converted = cfg["quantization_config"]["modules_to_not_convert"]
    assert not_converted and all(m.split(".")[4] == "shared_experts" for m in not_converted)
    for m in not_converted:
        assert h[m + ".weight"][0] == "BF16" and m + ".weight_scale_inv" not in h
    assert h["model.layers.1.mlp.experts.0.up_proj.weight"][0] == "F8_E4M3"
    mtp = {n for n in h if n.startswith("model.layers.3.")}
    assert {"model.layers.3.eh_proj.weight", "model.layers.3.shared_head.norm.weight"} <= mtp
    assert "model.layers.3.embed_tokens.weight" not in mtp and "model.layers.3.shared_head.head.weight" not in mtp
    assert h["model.layers.0.self_attn.kv_b_proj.weight"] == ("F8_E4M3", [4 * (192 + 256), 512])
    assert h["model.layers.0.self_attn.indexer.k_norm.bias"] == ("BF16", [128])


@pytest.mark.parametrize("member", ["deepseek-v2-lite", "moonlight"])
def test_bf16_members_have_q_proj_and_no_quantization(family_checkpoints, load_json, member):
    src = family_checkpoints.source(member)
    cfg = load_json(src / "config.json")
    assert "quantization_config" not in cfg and cfg["q_lora_rank"] is None and cfg["num_attention_heads"] == 16
    assert cfg["architectures"] == [
        "DeepseekV2ForCausalLM" if member == "deepseek-v2-lite" else "DeepseekV3ForCausalLM"
    ]
    h = _headers(src)
    assert {d for d, _ in h.values()} <= {"BF16", "F32"}
    assert h["model.layers.0.self_attn.q_proj.weight"] == ("BF16", [16 * 192, 256])
    assert not any("q_a_proj" in n or "_scale_inv" in n or n.startswith("model.layers.3.") for n in h)


# --- every member converts in both formats, bit-exact to the reference ------------------------------


@pytest.mark.parametrize("member", HF_MEMBERS)
@pytest.mark.parametrize("fmt", [FP8, BF16])
def test_member_converts_to_the_reference(family_checkpoints, load_all, load_json, reference, member, fmt):
    src_dir = family_checkpoints.source(member)
    out_dir = family_checkpoints.converted(member, fmt)
    src, cfg = load_all(src_dir), load_json(src_dir / "config.json")
    want, got = expected_output(src, cfg, fmt, reference), load_all(out_dir)
    assert set(got) == set(want)
    for name, t in want.items():
        assert reference.same_bits(got[name], t), name
    if fmt == FP8:  # and within the e4m3 bound of the exact source value (the bit-exact check's yardstick)
        for name, q in got.items():
            if q.dtype == torch.float8_e4m3fn:
                s = got[module_of(name) + ".weight_scale"]
                scale = src.get(name + "_scale_inv")
                x = reference.dequant_block(src[name], scale, block_of(cfg)) if scale is not None else src[name].float()
                assert ((q.float() * s - x).abs() <= reference.e4m3_error_bound(x, s)).all(), name


@pytest.mark.parametrize("member", HF_MEMBERS)
@pytest.mark.parametrize("fmt", [FP8, BF16])
def test_member_artifacts_are_bit_exact_splits_of_the_source_kv_b_proj(
    family_checkpoints, load_all, load_json, reference, member, fmt
):
    src_dir = family_checkpoints.source(member)
    out_dir = family_checkpoints.converted(member, fmt)
    src, cfg = load_all(src_dir), load_json(src_dir / "config.json")
    n, p, v, l = (cfg[k] for k in ("num_attention_heads", "qk_nope_head_dim", "v_head_dim", "kv_lora_rank"))
    layers = cfg["num_hidden_layers"] + (cfg.get("num_nextn_predict_layers") or 0)
    manifest = read_manifest(out_dir / "mla")
    assert manifest.layer_ids() == list(range(layers))
    for i in range(layers):
        uk_t, uv = reference.seed_split(kv_b_value(src, cfg, i, reference).to(torch.bfloat16), n, p, v, l)
        with safe_open(str(out_dir / "mla" / manifest.entry(i).file), "pt") as f:
            assert reference.same_bits(f.get_tensor(w_uk_t_name(i)), uk_t), i
            assert reference.same_bits(f.get_tensor(w_uv_name(i)), uv), i
        assert uk_t.shape == (n, p, l) and uv.shape == (n, l, v)


def test_glm_artifacts_have_glm_dims(family_checkpoints):
    manifest = read_manifest(family_checkpoints.converted("glm-5", BF16) / "mla")
    assert manifest.dims.w_uk_t_shape() == (4, 192, 512) and manifest.dims.w_uv_shape() == (4, 512, 256)


@pytest.mark.parametrize("member", HF_MEMBERS)
@pytest.mark.parametrize("fmt", [FP8, BF16])
def test_member_output_config_and_ignore_list(family_checkpoints, load_all, load_json, member, fmt):
    """architectures, model_type and auto_map kept; the source's FP8 quantization_config gone; the
    channel-FP8 ignore list names exactly the linears written unquantized."""
    src_cfg = load_json(family_checkpoints.source(member) / "config.json")
    out_dir = family_checkpoints.converted(member, fmt)
    cfg = load_json(out_dir / "config.json")
    assert {k: v for k, v in cfg.items() if k != "quantization_config"} == {
        k: v for k, v in src_cfg.items() if k != "quantization_config"
    }
    if fmt == BF16:
        assert "quantization_config" not in cfg
        return
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and "fp8_dtype_flavor" not in qc
    tensors = load_all(out_dir)
    linears = {module_of(n) for n, t in tensors.items() if n.endswith(".weight") and t.dim() == 2}
    linears -= {m for m in linears if m.endswith("embed_tokens")}
    quantized = {m for m in linears if tensors[m + ".weight"].dtype == torch.float8_e4m3fn}
    assert quantized and all(m + ".weight_scale" in tensors for m in quantized)
    assert set(qc["ignore"]) == linears - quantized
    if member == "glm-5":
        assert set(src_cfg["quantization_config"]["modules_to_not_convert"]) <= set(qc["ignore"])
    if member == "deepseek-v3.2":
        assert "model.layers.0.self_attn.indexer.weights_proj" in qc["ignore"]
        assert "model.layers.0.self_attn.indexer.wk" in quantized


@pytest.mark.parametrize("member", MEMBERS)  # every member, Mistral-Large-3 and the Kimi-K2s included
@pytest.mark.parametrize("fmt", [FP8, BF16])
@pytest.mark.parametrize("with_source", [False, True], ids=["no-source", "source"])
def test_member_verifies(family_checkpoints, member, fmt, with_source):
    src = family_checkpoints.source(member) if with_source else None
    report = verify(family_checkpoints.converted(member, fmt), src)
    assert ok(report)
    if with_source:  # every tensor compared
        assert report.groups["source"].checked >= report.tensors


# --- verify knows the family, and nothing more ---------------------------------------------------------


def _copy(path: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(path, tmp_path / path.name))


def _add_tensor(out: Path, name: str, tensor: torch.Tensor) -> None:
    """Add a tensor to the first shard of a conversion and its index, hashes updated: only the
    structure check can object."""
    import hashlib

    index = json.loads((out / INDEX).read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    tensors = load_file(str(out / shard)) | {name: tensor}
    save_file(tensors, str(out / shard))
    index["weight_map"][name] = shard
    index["metadata"]["total_size"] += tensor.numel() * tensor.element_size()
    (out / INDEX).write_text(json.dumps(index))
    man = json.loads((out / "mla-convert-manifest.json").read_text())
    for rel in (shard, INDEX):
        data = (out / rel).read_bytes()
        man["files"][rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (out / "mla-convert-manifest.json").write_text(json.dumps(man))


def _structure_failures(report) -> list:
    return list(report.groups["structure"].failures)


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.0.self_attn.rotary_emb.cos_cached",  # not a known buffer
        "model.layers.9.self_attn.rotary_emb.inv_freq",  # a buffer of a layer the config lacks
        "model.layers.3.embed_tokens.weight",  # GLM's MTP layer has none
    ],
)
def test_a_tensor_the_family_does_not_explain_fails(family_checkpoints, tmp_path, name):
    out = _copy(family_checkpoints.converted("glm-5", BF16), tmp_path)
    _add_tensor(out, name, torch.ones(32, dtype=torch.bfloat16))
    report = verify(out)
    assert not report.ok
    assert [f.tensor for f in _structure_failures(report) if f.check == "unexpected-tensor"] == [name]


def test_an_inv_freq_buffer_is_accepted_for_any_member(family_checkpoints, tmp_path):
    out = _copy(family_checkpoints.converted("deepseek-v3.2", FP8), tmp_path)
    _add_tensor(out, "model.layers.3.self_attn.rotary_emb.inv_freq", torch.ones(32, dtype=torch.bfloat16))
    assert ok(verify(out))


def test_kimi_without_source_checks_its_inv_freq_values(family_checkpoints, tmp_path):
    out = _copy(family_checkpoints.converted("kimi-k2", BF16), tmp_path)
    _add_tensor(out, "model.layers.0.self_attn.rotary_emb.inv_freq", torch.full((56,), math.nan).bfloat16())
    report = verify(out)
    assert any(f.check == "nan-inf" for f in report.groups["values"].failures)


# --- sources: block sizes, E8M0 scales, mixed, BF16 with --ignore, a bf16 output again -----------


@pytest.mark.parametrize("block", [(64, 64), (32, 128), (256, 128)])
def test_any_weight_block_size(tmp_path, load_all, reference, block):
    src = write_checkpoint(tmp_path / "src", CheckpointSpec(block=block, num_hidden_layers=2))
    assert json.loads((src / "config.json").read_text())["quantization_config"]["weight_block_size"] == list(block)
    convert(src, tmp_path / "out", Options())
    t, cfg = load_all(src), json.loads((src / "config.json").read_text())
    want, got = expected_output(t, cfg, FP8, reference), load_all(tmp_path / "out")
    assert set(got) == set(want) and all(reference.same_bits(got[n], w) for n, w in want.items())
    assert ok(verify(tmp_path / "out", src))


@pytest.fixture(scope="module")
def e8m0_src(tmp_path_factory) -> Path:
    """V3.1's layout with float8_e8m0fnu scale tensors."""
    return write_checkpoint(
        tmp_path_factory.mktemp("e8m0") / "src", CheckpointSpec.family("deepseek-v3.1", scale_dtype="e8m0")
    )


@pytest.mark.parametrize("fmt", [FP8, BF16])
def test_e8m0_scales_decode_to_powers_of_two(e8m0_src, tmp_path, load_all, reference, fmt):
    src = load_all(e8m0_src)
    scales = [t for n, t in src.items() if n.endswith("_scale_inv")]
    assert scales and all(s.dtype == torch.float8_e8m0fnu for s in scales)
    convert(e8m0_src, tmp_path / "out", Options(format=fmt))
    cfg = json.loads((e8m0_src / "config.json").read_text())
    want, got = expected_output(src, cfg, fmt, reference), load_all(tmp_path / "out")
    assert set(got) == set(want) and all(reference.same_bits(got[n], w) for n, w in want.items())
    for with_source in (None, e8m0_src):
        assert ok(verify(tmp_path / "out", with_source))


def test_mixed_source_with_a_bf16_kv_b_proj(tmp_path, load_all, load_json, reference):
    """Some linears FP8, some BF16 (kv_b_proj among them): the BF16 ones are copied and ignored, and
    the artifacts are bit-exact splits of the BF16 kv_b_proj."""
    spec = CheckpointSpec(not_converted=(r"\.kv_b_proj$", r"\.experts\.1\."))
    src = write_checkpoint(tmp_path / "src", spec)
    for fmt in (FP8, BF16):
        out = tmp_path / fmt
        convert(src, out, Options(format=fmt))
        t, cfg = load_all(src), load_json(src / "config.json")
        want, got = expected_output(t, cfg, fmt, reference), load_all(out)
        assert set(got) == set(want) and all(reference.same_bits(got[n], w) for n, w in want.items())
        uk_t, _ = reference.seed_split(t["model.layers.0.self_attn.kv_b_proj.weight"], 4, 128, 128, 512)
        with safe_open(str(out / "mla" / "layer-000.safetensors"), "pt") as f:
            assert reference.same_bits(f.get_tensor(w_uk_t_name(0)), uk_t)
        if fmt == FP8:
            ignore = load_json(out / "config.json")["quantization_config"]["ignore"]
            assert "model.layers.2.self_attn.kv_b_proj" in ignore and "model.layers.1.mlp.experts.1.up_proj" in ignore
        assert ok(verify(out)) and ok(verify(out, src))


def test_bf16_source_with_ignore(family_checkpoints, tmp_path, load_all, load_json, reference):
    src = family_checkpoints.source("deepseek-v2-lite")
    experts = r"model\.layers\.\d+\.mlp\.experts\."
    convert(src, tmp_path / "out", Options(ignore=(experts,)))
    t, cfg = load_all(src), load_json(src / "config.json")
    want, got = expected_output(t, cfg, FP8, reference, ignore=(experts,)), load_all(tmp_path / "out")
    assert set(got) == set(want) and all(reference.same_bits(got[n], w) for n, w in want.items())
    assert got["model.layers.1.mlp.experts.0.up_proj.weight"].dtype == torch.bfloat16
    assert got["model.layers.1.mlp.shared_experts.up_proj.weight"].dtype == torch.float8_e4m3fn
    assert f"re:{experts}" in load_json(tmp_path / "out" / "config.json")["quantization_config"]["ignore"]
    assert ok(verify(tmp_path / "out")) and ok(verify(tmp_path / "out", src))


def test_a_bf16_output_converts_again_to_channel_fp8(family_checkpoints, tmp_path, load_all, tree_hashes):
    """A bf16 conversion is a BF16 source: its own mla/ and conversion manifest stay behind."""
    bf16 = family_checkpoints.converted("deepseek-v3", BF16)
    convert(bf16, tmp_path / "again", Options())
    assert ok(verify(tmp_path / "again", bf16))
    direct = family_checkpoints.converted("deepseek-v3", FP8)
    again, first = load_all(tmp_path / "again"), load_all(direct)
    # Requantizing bf16(x) is not requantizing x, but the artifacts of both are the same splits.
    assert set(again) == set(first)
    hashes, first_hashes = tree_hashes(tmp_path / "again"), tree_hashes(direct)
    assert all(hashes[r] == first_hashes[r] for r in first_hashes if r.startswith("mla/layer-"))


# --- bad input: one line, exit 2, nothing written ----------------------------------------------------


def _edit_config(root: Path, **changes) -> None:
    cfg = json.loads((root / "config.json").read_text())
    for k, v in changes.items():
        if v is None and k == "quantization_config":
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (root / "config.json").write_text(json.dumps(cfg))


def _rewrite_shard_of(root: Path, name: str, change) -> None:
    """Rewrite the shard holding `name` with change(tensors) applied (and the index kept in step)."""
    index = json.loads((root / INDEX).read_text())
    shard = index["weight_map"][name]
    tensors = load_file(str(root / shard))
    change(tensors)
    save_file(tensors, str(root / shard))
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if f != shard} | {n: shard for n in tensors}
    (root / INDEX).write_text(json.dumps(index))


def test_config_dims_against_the_tensors_name_the_field_tensor_and_numbers(src_copy, tmp_path):
    _edit_config(src_copy, qk_nope_head_dim=64)
    line = cli_error(["convert", src_copy, "--out", tmp_path / "o"], tmp_path / "o")
    assert "config.json: qk_nope_head_dim is 64" in line
    assert "'model.layers.0.self_attn.kv_b_proj.weight' [1024, 512] has 1024 rows" in line
    assert "num_attention_heads x (qk_nope_head_dim + v_head_dim) = 4 x (64 + 128) = 768" in line
    assert "fits qk_nope_head_dim 128" in line


def test_a_field_no_single_change_explains_is_named_with_its_formula(src_copy, tmp_path):
    _edit_config(src_copy, num_attention_heads=3, v_head_dim=96)
    line = cli_error(["convert", src_copy, "--out", tmp_path / "o"], tmp_path / "o")
    assert "'model.layers.0.self_attn.kv_b_proj.weight' [1024, 512] has 1024 rows" in line
    assert "num_attention_heads x (qk_nope_head_dim + v_head_dim) = 3 x (128 + 96) = 672" in line


def test_q_lora_rank_null_on_a_q_lora_checkpoint(src_copy, tmp_path):
    _edit_config(src_copy, q_lora_rank=None)
    line = cli_error(["convert", src_copy, "--out", tmp_path / "o"], tmp_path / "o")
    assert "'model.layers.0.self_attn.q_proj.weight'" in line and "q_lora_rank null" in line


def test_unsupported_architecture_names_the_supported_list(src_copy, tmp_path):
    _edit_config(src_copy, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe")
    line = cli_error(["convert", src_copy, "--out", tmp_path / "o"], tmp_path / "o")
    assert "Qwen3MoeForCausalLM" in line and all(a in line for a in SUPPORTED_ARCHITECTURES)


def test_indexer_member_without_its_dims(family_checkpoints, tmp_path):
    src = _copy(family_checkpoints.source("deepseek-v3.2"), tmp_path)
    cfg = json.loads((src / "config.json").read_text())
    del cfg["index_head_dim"]
    (src / "config.json").write_text(json.dumps(cfg))
    line = cli_error(["convert", src, "--out", tmp_path / "o"], tmp_path / "o")
    assert "index_head_dim" in line


def test_e8m0_nan_code_is_refused(e8m0_src, tmp_path):
    src = _copy(e8m0_src, tmp_path)
    name = "model.layers.1.mlp.experts.2.up_proj.weight_scale_inv"

    def poison(tensors):
        codes = tensors[name].view(torch.uint8).clone()
        codes[0, 0] = 0xFF
        tensors[name] = codes.view(torch.float8_e8m0fnu)

    _rewrite_shard_of(src, name, poison)
    line = cli_error(["convert", src, "--out", tmp_path / "o"], tmp_path / "o")
    assert repr(name) in line and "0xFF" in line


def test_unknown_scale_dtype_is_refused(src_copy, tmp_path):
    name = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    _rewrite_shard_of(src_copy, name, lambda t: t.update({name: t[name].half()}))
    line = cli_error(["convert", src_copy, "--out", tmp_path / "o"], tmp_path / "o")
    assert repr(name) in line and "F16" in line and "F8_E8M0" in line


def test_fp8_linear_without_its_scale_is_refused(src_copy, tmp_path):
    name = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    _rewrite_shard_of(src_copy, name, lambda t: t.pop(name))
    line = cli_error(["convert", src_copy, "--out", tmp_path / "o"], tmp_path / "o")
    assert (
        "'model.layers.0.self_attn.o_proj.weight'" in line
        and "no model.layers.0.self_attn.o_proj.weight_scale_inv" in line
    )


def test_block_size_that_does_not_fit_the_grid_is_refused(src_copy, tmp_path):
    cfg = json.loads((src_copy / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = [64, 128]
    (src_copy / "config.json").write_text(json.dumps(cfg))
    line = cli_error(["convert", src_copy, "--out", tmp_path / "o"], tmp_path / "o")
    assert "64x128 blocks (weight_block_size)" in line


def test_scales_in_a_source_without_quantization_config(src_copy, tmp_path):
    _edit_config(src_copy, quantization_config=None)
    line = cli_error(["convert", src_copy, "--out", tmp_path / "o"], tmp_path / "o")
    assert "no quantization_config" in line and "_scale_inv" in line


def test_source_errors_are_typed(src_copy):
    from mla_convert.source.checkpoint import open_source

    _edit_config(src_copy, qk_nope_head_dim=64)
    with pytest.raises(SourceError, match="qk_nope_head_dim"):
        open_source(src_copy)


# --- the commands ------------------------------------------------------------------------------------


def test_convert_and_the_deepseek_r1_preset_take_any_member(family_checkpoints, tmp_path):
    for cmd, member in (("convert", "deepseek-v2-lite"), ("deepseek-r1", "glm-5")):
        out = tmp_path / cmd
        res = runner.invoke(app, [cmd, str(family_checkpoints.source(member)), "--out", str(out), "--json"])
        assert res.exit_code == 0, res.stderr
        summary = json.loads(res.stdout)
        assert summary["status"] == "complete" and summary["mla_layers"] == len(read_manifest(out / "mla").layers)
        assert (summary["bf16_linears_quantized"] > 0) == (member == "deepseek-v2-lite")


def test_convert_needs_a_source_and_help_lists_the_architectures():
    res = runner.invoke(app, ["convert", "--out", "x"])
    assert res.exit_code == 2 and "source" in res.stderr.lower()
    for cmd in ("convert", "deepseek-r1"):
        text = runner.invoke(app, [cmd, "--help"], terminal_width=200).stdout
        assert all(a in text for a in SUPPORTED_ARCHITECTURES), text
        assert "kimi_k2" in text and "modules_to_not_convert" in text
    assert "deepseek-ai/DeepSeek-R1" in runner.invoke(app, ["deepseek-r1", "--help"], terminal_width=200).stdout


@pytest.mark.parametrize("member", ["glm-5", "deepseek-v2-lite"])
def test_demo_shows_a_member(tmp_path, member):
    res = runner.invoke(app, ["demo", "--family", member, "--out", str(tmp_path / "d"), "--json"])
    assert res.exit_code == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["verify"]["ok"] and summary["verify"]["failed"] == 0
    cfg = json.loads((tmp_path / "d" / "source" / "config.json").read_text())
    assert cfg["architectures"] == [CheckpointSpec.family(member).architecture]


def test_demo_unknown_member(tmp_path):
    line = cli_error(["demo", "--family", "llama", "--out", tmp_path / "d"], tmp_path / "d")
    assert "--family 'llama'" in line and "glm-5" in line


def test_indexer_layers_and_mlp_types_follow_the_config(family_checkpoints, load_json):
    """An index_topk_pattern 'S' layer (or one index_topk_freq skips) shares another layer's top-k and
    holds no indexer, as vLLM and transformers build it; MTP layers always hold one. GLM's
    mlp_layer_types, where given, says which layers are MoE."""
    from mla_convert.source.family import ModelLayout, implied_tensors

    cfg = load_json(family_checkpoints.source("glm-5") / "config.json")
    assert ModelLayout.of(cfg).indexer_layers == {0, 1, 2, 3}
    assert ModelLayout.of(cfg | {"index_topk_pattern": "FSF"}).indexer_layers == {0, 2, 3}
    assert ModelLayout.of(cfg | {"index_topk_freq": 2, "index_skip_topk_offset": 1}).indexer_layers == {0, 2, 3}
    names = implied_tensors(cfg | {"index_topk_pattern": "FSF", "mlp_layer_types": ["sparse", "dense", "dense"]})
    assert "model.layers.1.self_attn.indexer.wk.weight" not in names
    assert "model.layers.3.self_attn.indexer.wk.weight" in names
    assert "model.layers.0.mlp.experts.0.up_proj.weight" in names and "model.layers.1.mlp.up_proj.weight" in names
    assert ModelLayout.of(load_json(family_checkpoints.source("kimi-k2") / "config.json")).indexer_layers == set()


# --- GLM-5.2 / 5.3: IndexShare ------------------------------------------------------------------------


def test_glm_5_2_has_indexshare_and_its_modules_to_not_convert(family_checkpoints, load_json):
    """Only the layers indexer_types calls "full" (0-2 here; 0-2, 6, 10, ... at full size) and the
    MTP layer store self_attn.indexer.*; modules_to_not_convert names self_attn.indexers_proj, which
    names no tensor, and omits the BF16 indexer.weights_proj."""
    src = family_checkpoints.source("glm-5.2")
    cfg = load_json(src / "config.json")
    assert cfg["indexer_types"] == ["full", "full", "full", "shared", "shared"]
    assert (cfg["index_topk_freq"], cfg["index_skip_topk_offset"]) == (4, 3)
    h = _headers(src)
    with_indexer = {int(n.split(".")[2]) for n in h if ".self_attn.indexer." in n}
    assert with_indexer == {0, 1, 2, 5}  # 5: the MTP layer
    not_converted = cfg["quantization_config"]["modules_to_not_convert"]
    assert "model.layers.0.self_attn.indexers_proj" in not_converted
    assert not any(n.startswith("model.layers.0.self_attn.indexers_proj") for n in h)
    assert not any("weights_proj" in m for m in not_converted)
    assert h["model.layers.0.self_attn.indexer.weights_proj.weight"][0] == "BF16"


def test_indexer_types_is_read_where_present_and_the_placement_derived_where_absent(family_checkpoints, tmp_path):
    src = _copy(family_checkpoints.source("glm-5.2"), tmp_path)
    _edit_config(src, index_topk_freq=1)  # derived, this would put an indexer on every layer
    convert(src, tmp_path / "a", Options())
    assert ok(verify(tmp_path / "a")) and ok(verify(tmp_path / "a", src))
    cfg = json.loads((src / "config.json").read_text())
    del cfg["indexer_types"]
    cfg["index_topk_freq"] = 4
    (src / "config.json").write_text(json.dumps(cfg))
    convert(src, tmp_path / "b", Options(format=BF16))
    assert ok(verify(tmp_path / "b")) and ok(verify(tmp_path / "b", src))


@pytest.mark.parametrize(
    "layer,kind,says",
    [(3, "full", "layer 3 has no self_attn.indexer.*, but indexer_types gives it 'full'"),
     (1, "shared", "layer 1 holds self_attn.indexer.*, but indexer_types gives it 'shared'")],
)  # fmt: skip
def test_indexer_types_that_disagree_with_the_tensors_are_refused_naming_the_layer(
    family_checkpoints, tmp_path, layer, kind, says
):
    src = _copy(family_checkpoints.source("glm-5.2"), tmp_path)
    types = json.loads((src / "config.json").read_text())["indexer_types"]
    types[layer] = kind
    _edit_config(src, indexer_types=types)
    line = cli_error(["convert", src, "--out", tmp_path / "o"], tmp_path / "o")
    assert says in line


def test_a_derived_placement_that_disagrees_with_the_tensors_is_refused(family_checkpoints, tmp_path):
    src = _copy(family_checkpoints.source("glm-5.2"), tmp_path)
    cfg = json.loads((src / "config.json").read_text())
    del cfg["indexer_types"]
    cfg["index_topk_freq"] = 1
    (src / "config.json").write_text(json.dumps(cfg))
    line = cli_error(["convert", src, "--out", tmp_path / "o"], tmp_path / "o")
    assert (
        "layer 3 has no self_attn.indexer.*, but index_topk_freq / index_skip_topk_offset gives it an indexer" in line
    )


def test_indexer_types_of_the_wrong_length_is_refused(family_checkpoints, tmp_path):
    src = _copy(family_checkpoints.source("glm-5.2"), tmp_path)
    _edit_config(src, indexer_types=["full", "shared"])
    line = cli_error(["convert", src, "--out", tmp_path / "o"], tmp_path / "o")
    assert "indexer_types must list 'full' or 'shared' for each of the 5 decoder layers" in line


def test_demo_shows_glm_5_2(tmp_path):
    res = runner.invoke(app, ["demo", "--family", "glm-5.2", "--out", str(tmp_path / "d"), "--json"])
    assert res.exit_code == 0, res.stderr
    assert json.loads(res.stdout)["verify"]["ok"]
