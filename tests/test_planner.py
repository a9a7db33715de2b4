"""mla_convert.plan.planner: from the headers alone, what each output shard holds, made by which
op, which source tensors (a scale in another shard included) each job reads, which files the
conversion writes, the byte counts of the summary, and the linears the config tells vLLM to
leave unquantized."""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path

import pytest
from safetensors import safe_open

from mla_convert.constants import MANIFEST_NAME
from mla_convert.demo.synthetic import CheckpointSpec
from mla_convert.plan.ops import COPY, FP8_SCALE, QUANT_FP8, TO_BF16, TO_FP8
from mla_convert.plan.planner import make_plan
from mla_convert.settings import Options
from mla_convert.source.checkpoint import open_source

SPEC = CheckpointSpec()  # the tiny checkpoint's
CHANNEL_FP8, BF16 = "channel-fp8", "bf16"  # the formats' names (mla_convert.formats)
BYTES_PER_ELEMENT = {"F8_E4M3": 1, "BF16": 2, "F16": 2, "F32": 4}


def kinds(spec: CheckpointSpec) -> dict[str, str]:
    """Tensor name -> the kind the synthetic checkpoint wrote it as (fp8, scale, bf16-linear, ...)."""
    return {name: kind for name, kind, _ in spec.tensors()}


def planned(plan) -> dict:
    """Output tensor name -> (job file, OutTensor)."""
    return {t.name: (job.file, t) for job in plan.shards for t in job.tensors}


def is_ignored(module: str, ignore: list[str]) -> bool:
    """How vLLM reads compressed-tensors' ignore list: 're:' entries match, others name a module."""
    return any(re.match(e[3:], module) if e.startswith("re:") else e == module for e in ignore)


@pytest.fixture(scope="module")
def tiny(tiny_src):
    return open_source(tiny_src)


# ---- which op each tensor gets ------------------------------------------------------------------


def test_channel_fp8_turns_each_block_fp8_weight_into_a_weight_and_its_channel_scale(tiny):
    plan = make_plan(tiny, Options(format=CHANNEL_FP8))
    out = planned(plan)
    written = kinds(SPEC)
    for name, kind in written.items():
        if kind == "scale":
            assert name not in out  # a block scale is consumed with its weight
            continue
        file, t = out[name]
        assert file == tiny.weight_map[name] and t.source == name and t.shape == tiny.info(name).shape
        if kind == "fp8":
            scale_file, scale = out[name.removesuffix(".weight") + ".weight_scale"]
            assert (t.op, t.dtype) == (TO_FP8, "F8_E4M3")
            assert (scale.op, scale.dtype, scale.shape, scale_file) == (FP8_SCALE, "F32", (t.shape[0], 1), file)
        else:
            assert (t.op, t.dtype) == (COPY, tiny.info(name).dtype)
    assert plan.ops() == (TO_FP8,)


def test_bf16_dequantizes_every_block_fp8_weight_and_copies_the_rest(tiny):
    plan = make_plan(tiny, Options(format=BF16))
    out = planned(plan)
    written = kinds(SPEC)
    assert set(out) == {n for n, k in written.items() if k != "scale"}
    for name, (_, t) in out.items():
        want = (TO_BF16, "BF16") if written[name] == "fp8" else (COPY, tiny.info(name).dtype)
        assert (t.op, t.dtype) == want and t.shape == tiny.info(name).shape
    assert plan.ignore == [] and "quantization_config" not in plan.config
    assert plan.ops() == (TO_BF16,)


def test_a_bf16_source_has_its_fp8_linears_quantized_and_the_rest_copied(family_checkpoints):
    """DeepSeek-V2-Lite is BF16: the linears DeepSeek's FP8 releases quantize become channel FP8;
    the router gate, lm_head, embeddings and norms stay as they are."""
    spec = CheckpointSpec.family("deepseek-v2-lite")
    src = open_source(family_checkpoints.source("deepseek-v2-lite"))
    plan = make_plan(src, Options())
    out = planned(plan)
    for name, kind in kinds(spec).items():
        _, t = out[name]
        if kind == "bf16-linear":
            assert (t.op, t.dtype) == (QUANT_FP8, "F8_E4M3")
            assert out[name.removesuffix(".weight") + ".weight_scale"][1].op == FP8_SCALE
        else:
            assert (t.op, t.dtype) == (COPY, src.info(name).dtype)
    assert plan.ops() == (QUANT_FP8,)
    assert make_plan(src, Options(format=BF16)).ops() == ()  # nothing to compute: all copied


def test_modules_an_fp8_source_keeps_in_bf16_are_copied_and_ignored(family_checkpoints):
    """GLM-5 keeps its shared experts in BF16 (modules_to_not_convert): copied, never quantized,
    and named in the output's ignore list."""
    spec = CheckpointSpec.family("glm-5")
    plan = make_plan(open_source(family_checkpoints.source("glm-5")), Options())
    out = planned(plan)
    kept = spec.modules_to_not_convert()
    assert kept
    for module in kept:
        assert (out[module + ".weight"][1].op, out[module + ".weight"][1].dtype) == (COPY, "BF16")
        assert module + ".weight_scale" not in out
        assert module in plan.ignore


# ---- --ignore --------------------------------------------------------------------------------------


def test_ignore_leaves_the_matching_fp8_linears_in_bf16(tiny):
    pattern = r"model\.layers\.2\.mlp\.experts\.[0-3]\."
    plan = make_plan(tiny, Options(ignore=(pattern, "lm_head")))
    out = planned(plan)
    fp8 = [n for n, k in kinds(SPEC).items() if k == "fp8"]
    matched = [n for n in fp8 if re.match(pattern, n)]
    assert len(matched) == 4 * 3  # four experts' gate, up and down projections
    for name in fp8:
        op = out[name][1].op
        has_scale = name.removesuffix(".weight") + ".weight_scale" in out
        assert (op, has_scale) == ((TO_BF16, False) if name in matched else (TO_FP8, True)), name
    assert plan.ops() == (TO_FP8, TO_BF16)
    # the patterns go into the config as they are, first; the modules they match are not listed again
    # (lm_head, BF16 in the source, would be listed by name otherwise)
    assert plan.ignore[:2] == [f"re:{pattern}", "re:lm_head"]
    assert not [m for m in plan.ignore[2:] if re.match(pattern, m) or re.match("lm_head", m)]
    assert "lm_head" not in plan.ignore and out["lm_head.weight"][1].op == COPY
    assert plan.config["quantization_config"]["ignore"] == plan.ignore


def test_ignore_on_a_bf16_source_copies_the_matching_linears(family_checkpoints):
    src = open_source(family_checkpoints.source("deepseek-v2-lite"))
    plan = make_plan(src, Options(ignore=(r".*\.self_attn\.",)))
    for name, (_, t) in planned(plan).items():
        if ".self_attn." in name:
            assert t.op == COPY and t.dtype == src.info(name).dtype, name


def test_ignore_means_nothing_to_a_bf16_conversion(tiny):
    assert make_plan(tiny, Options(format=BF16, ignore=("lm_head",))).ignore == []


def test_the_ignore_list_covers_exactly_the_linears_left_in_16_bits(tiny, family_checkpoints):
    """What vLLM needs: every linear whose output weight is not FP8 is ignored (by name or by an
    're:' pattern), and no linear whose weight is FP8 is."""
    sources = {
        "tiny": (tiny, ()),
        "tiny --ignore": (tiny, (r".*\.shared_experts\.",)),
        "glm-5": (open_source(family_checkpoints.source("glm-5")), ()),
        "deepseek-v2-lite": (open_source(family_checkpoints.source("deepseek-v2-lite")), ()),
    }
    for what, (src, ignore) in sources.items():
        plan = make_plan(src, Options(ignore=ignore))
        weights = [t for job in plan.shards for t in job.tensors if t.name.endswith(".weight") and len(t.shape) == 2]
        for t in weights:
            module = t.name.removesuffix(".weight")
            if module.endswith("embed_tokens"):
                continue  # an embedding, not a linear
            assert is_ignored(module, plan.ignore) == (t.dtype != "F8_E4M3"), (what, module)


# ---- what each job reads -------------------------------------------------------------------------


def test_a_scale_in_another_shard_is_read_by_its_weights_job(tiny, tiny_src):
    plan = make_plan(tiny, Options())
    weight, scale = SPEC.split_scale_of, SPEC.split_scale_of + "_scale_inv"
    (job,) = [j for j in plan.shards if any(t.name == weight for t in j.tensors)]
    inputs = plan.inputs_of(job)
    assert inputs[weight] == job.file and inputs[scale] != job.file
    with safe_open(str(tiny_src / inputs[scale]), "pt") as f:
        assert scale in f.keys()  # noqa: SIM118 (safe_open handles are not iterable)
    other = [j for j in plan.shards if j.file == inputs[scale]]
    assert scale not in plan.inputs_of(other[0])  # read once, by the weight's job


def test_every_source_tensor_is_read_by_exactly_one_job(tiny):
    for fmt in (CHANNEL_FP8, BF16):
        plan = make_plan(tiny, Options(format=fmt))
        reads = [name for job in plan.shards for name in plan.inputs_of(job)]
        assert sorted(reads) == sorted(tiny.weight_map)
        for job in plan.shards:
            for name, file in plan.inputs_of(job).items():
                assert name in tiny.headers[file].tensors
        data = sum(t.nbytes for h in tiny.headers.values() for t in h.tensors.values())
        assert sum(plan.in_bytes(job) for job in plan.shards) == data


def test_planning_reads_no_tensor_data(tiny_src, tmp_path):
    """The headers are enough: once the source is opened, its shards' data may be gone."""
    root = Path(shutil.copytree(tiny_src, tmp_path / "src"))
    src = open_source(root)
    for shard in src.headers:
        (root / shard).unlink()
    plan = make_plan(src, Options())
    assert len(plan.shards) == len(src.headers)


# ---- which files are written ----------------------------------------------------------------------


def test_job_outputs_are_each_shard_and_the_mla_layers_of_its_kv_b_proj(tiny):
    plan = make_plan(tiny, Options())
    outputs = plan.job_outputs()
    assert set(outputs) == set(tiny.headers)
    layers = SPEC.num_hidden_layers + SPEC.num_nextn_predict_layers
    seen = []
    for job, files in outputs.items():
        assert files[0] == job
        for rel in files[1:]:
            layer = int(re.fullmatch(r"mla/layer-(\d+)\.safetensors", rel).group(1))
            assert tiny.weight_map[f"model.layers.{layer}.self_attn.kv_b_proj.weight"] == job
            seen.append(layer)
    assert sorted(seen) == list(range(layers)) == plan.mla_layers


def test_writes_are_the_files_a_conversion_leaves(tiny, converted):
    for fmt, out in converted.items():
        plan = make_plan(tiny, Options(format=fmt))
        on_disk = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
        assert plan.writes() | {MANIFEST_NAME} == on_disk, fmt


# ---- the summary ----------------------------------------------------------------------------------


def test_summary_byte_counts_are_the_planned_tensors_bytes(tiny, tiny_src, converted):
    for fmt in (CHANNEL_FP8, BF16):
        plan = make_plan(tiny, Options(format=fmt))
        summary = plan.summary()
        tensors = [t for job in plan.shards for t in job.tensors]
        assert summary["bytes_out_model"] == sum(math.prod(t.shape) * BYTES_PER_ELEMENT[t.dtype] for t in tensors)
        assert summary["tensors_out"] == len(tensors) and summary["shards"] == len(tiny.headers)
        assert summary["bytes_in"] == sum((tiny_src / f).stat().st_size for f in tiny.headers)
        # what the output's shards and MLA layer files hold past their headers
        out = converted[fmt]
        assert summary["bytes_out_model"] == sum(data_bytes(out / f) for f in tiny.headers)
        assert summary["bytes_out_mla"] == sum(data_bytes(p) for p in (out / "mla").glob("layer-*.safetensors"))
        # all of it, within the headers and the small JSON files (tens of kB here)
        total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
        assert 0.99 * total <= summary["bytes_out"] <= total


def test_summary_counts_what_is_converted(tiny, family_checkpoints):
    written = kinds(SPEC)
    summary = make_plan(tiny, Options()).summary()
    assert summary["fp8_weights_converted"] == sum(k == "fp8" for k in written.values())
    assert summary["tensors_in"] == len(written)
    assert summary["mla_layers"] == SPEC.num_hidden_layers + SPEC.num_nextn_predict_layers
    assert summary["bf16_linears_quantized"] == 0
    lite = CheckpointSpec.family("deepseek-v2-lite")
    summary = make_plan(open_source(family_checkpoints.source("deepseek-v2-lite")), Options()).summary()
    assert summary["bf16_linears_quantized"] == sum(k == "bf16-linear" for _, k, _ in lite.tensors())
    assert summary["fp8_weights_converted"] == 0


def data_bytes(path: Path) -> int:
    """The size of a safetensors file's data section."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
    return path.stat().st_size - 8 - n


# ---- the ignore list's content --------------------------------------------------------------------


def test_ignored_modules_name_the_16_bit_linears_of_the_tiny_checkpoint(tiny):
    """lm_head, the routers' gates and the MTP layer's eh_proj and head: BF16 in DeepSeek's FP8
    release, left so; listed by name, sorted, each once."""
    ignored = make_plan(tiny, Options()).ignored_modules
    mtp = SPEC.num_hidden_layers
    moe = range(SPEC.first_k_dense_replace, SPEC.num_hidden_layers + SPEC.num_nextn_predict_layers)
    want = {"lm_head", f"model.layers.{mtp}.eh_proj", f"model.layers.{mtp}.shared_head.head"}
    want |= {f"model.layers.{i}.mlp.gate" for i in moe}
    assert set(ignored) == want and ignored == sorted(ignored)
