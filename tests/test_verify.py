"""`mla-convert verify`: the clean tiny conversion passes; each corruption fails the right check and
names the right file or tensor; a directory that is not a conversion cannot be verified (exit 2)."""

import hashlib
import json
import re
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from mla_convert.cli.app import app
from mla_convert.constants import MANIFEST_NAME
from mla_convert.conversion.pipeline import convert
from mla_convert.demo.specs import CheckpointSpec
from mla_convert.demo.synthetic import write_checkpoint
from mla_convert.errors import VerificationError
from mla_convert.kernels.numerics import quantize_channel_fp8
from mla_convert.settings import Options
from mla_convert.verification import verify
from mla_convert.verification.bounds import fp8_allowed_error
from mla_convert.verification.reference_mla import functional_error
from mla_runtime.format import MlaDims, w_uk_t_name, w_uv_name
from support.edits import fix_hash

FP8, BF16 = "channel-fp8", "bf16"
INDEX = "model.safetensors.index.json"
runner = CliRunner()


# --- fixtures and helpers -------------------------------------------------------------------------


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: torch's intra-op threads only add sync cost, and on a loaded 2-core machine
    their spin-waits make each verify run 10-20x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def other(tmp_path_factory) -> dict:
    """Conversions of a different checkpoint (another seed): the source of stale artifacts."""
    base = tmp_path_factory.mktemp("other")
    src = write_checkpoint(base / "src", CheckpointSpec(seed=1))
    for fmt in (FP8, BF16):
        convert(src, base / fmt, Options(format=fmt))
    return {fmt: base / fmt for fmt in (FP8, BF16)}


@pytest.fixture(params=[FP8, BF16])
def out(request, converted, tmp_path) -> Path:
    """A private copy of a clean conversion, in both formats."""
    return Path(shutil.copytree(converted[request.param], tmp_path / "out"))


@pytest.fixture
def torch_readers():
    """verify's readers module; a test may switch to torch's own readers (use(TORCH_BACKEND)), and
    the next test probes afresh."""
    from mla_convert.verification import readers

    yield readers
    readers.reset()


@pytest.fixture
def fp8_out(converted, tmp_path) -> Path:
    return Path(shutil.copytree(converted[FP8], tmp_path / "out"))


def run(path, source=None, *extra) -> tuple[int, dict]:
    args = ["verify", str(path), "--json", *extra] + (["--source", str(source)] if source else [])
    res = runner.invoke(app, args)
    assert res.exit_code in (0, 1), (res.exit_code, res.stdout, res.stderr)
    return res.exit_code, json.loads(res.stdout)


def failures(report: dict, group: str | None = None) -> list[dict]:
    return [f for g, v in report["groups"].items() if group in (None, g) for f in v["failures"]]


def assert_fails(report: dict, group: str, check: str, file=None, tensor=None) -> None:
    """verify failed, and among its failures is (group, check) naming `file` and/or `tensor`."""
    assert report["exit_code"] == 1 and not report["ok"]
    hits = [
        f
        for f in failures(report, group)
        if f["check"] == check and file in (None, f["file"]) and tensor in (None, f["tensor"])
    ]
    assert hits, f"no {group}/{check} failure for {file} {tensor}; got:\n" + "\n".join(
        f["message"] for f in failures(report)
    )


def shard_of(root: Path, tensor: str) -> str:
    return json.loads((root / INDEX).read_text())["weight_map"][tensor]


def data_offset(path: Path, tensor: str) -> tuple[int, int]:
    """Absolute (begin, end) of a tensor's bytes in a safetensors file."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    b, e = json.loads(raw[8 : 8 + n])[tensor]["data_offsets"]
    return 8 + n + b, 8 + n + e


def patch_bytes(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def rewrite(path: Path, change) -> None:
    """Load a safetensors file, let `change(tensors)` edit the dict, write it back."""
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def move_to_end(path: Path, tensor: str) -> None:
    """Rewrite a safetensors file with `tensor`'s bytes last, the others in their order."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header, data = json.loads(raw[8 : 8 + n]), raw[8 + n :]
    names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    names.remove(tensor)
    parts, pos = [], 0
    for name in [*names, tensor]:
        begin, end = header[name]["data_offsets"]
        parts.append(data[begin:end])
        header[name]["data_offsets"] = [pos, pos + end - begin]
        pos += end - begin
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(parts))


def kv_b(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.kv_b_proj.weight"


def mla_rel(layer: int) -> str:
    return f"mla/layer-{layer:03d}.safetensors"


# --- the clean conversion passes ----------------------------------------------------------------


@pytest.mark.parametrize("fmt", [FP8, BF16])
def test_clean_conversion_passes(converted, tiny_src, fmt):
    for source in (None, tiny_src):
        code, report = run(converted[fmt], source)
        assert code == 0 and report["ok"], "\n".join(f["message"] for f in failures(report))
        for g, v in report["groups"].items():
            assert v["checked"] > 0 or (g == "source" and source is None), g
    assert report["groups"]["source"]["checked"] > 100
    on_disk = sum(p.stat().st_size for p in converted[fmt].rglob("*") if p.is_file() and p.name != MANIFEST_NAME)
    assert report["bytes_read"] == on_disk  # every file the manifest lists streamed exactly once
    worst = report["worst_tensors"][0]
    assert worst["op"] == ("fp8" if fmt == FP8 else "bf16") and worst["bound_use"] <= 1 and worst["cosine"] > 0.999


def test_gaudi2_conversion_passes(tiny_src, tmp_path):
    out = tmp_path / "g2"
    convert(tiny_src, out, Options(target="gaudi2"))
    code, report = run(out, tiny_src)
    assert code == 0, "\n".join(f["message"] for f in failures(report))
    assert report["fp8_max"] == 240


def negative_zero_codes(root: Path) -> int:
    """How many float8_e4m3fn codes of the model shards under `root` are 0x80 (-0)."""
    return sum(
        int((t.view(torch.uint8) == 0x80).sum())
        for f in root.glob("*.safetensors")
        for t in load_file(f).values()
        if t.dtype == torch.float8_e4m3fn
    )


@pytest.mark.parametrize("kernels", ["eager", "native"])
def test_gaudi2_output_has_no_negative_zero_code(converted, tiny_src, tmp_path, monkeypatch, kernels):
    """The tiny source's blocks produce -0 (its gaudi3 output holds 0x80 codes); a gaudi2 output,
    which a float8_e4m3fnuz reader would decode 0x80 of as NaN, holds none, whichever kernels ran."""
    monkeypatch.delenv("MLA_CONVERT_KERNELS")
    out = tmp_path / "g2"
    assert convert(tiny_src, out, Options(target="gaudi2"), kernels=kernels).kernels == kernels
    assert negative_zero_codes(converted[FP8]) > 10 and negative_zero_codes(out) == 0
    code, report = run(out, tiny_src)
    assert code == 0 and report["groups"]["values"]["checked"] > 0


@pytest.mark.parametrize("readers", ["native", "torch"])
def test_negative_zero_planted_in_a_gaudi2_output(tiny_src, tmp_path, torch_readers, readers):
    """One +0 code turned into -0: the same value (the source comparison cannot see it), one
    values failure naming the file, the tensor and the count, with either fp8 reader."""
    out = tmp_path / "g2"
    convert(tiny_src, out, Options(target="gaudi2"))
    name = "model.layers.1.self_attn.q_b_proj.weight"
    rel = shard_of(out, name)
    begin, end = data_offset(out / rel, name)
    patch_bytes(out / rel, begin + (out / rel).read_bytes()[begin:end].index(b"\x00"), b"\x80")
    fix_hash(out, rel)
    if readers == "torch":
        torch_readers.use(torch_readers.TORCH_BACKEND)
    _, report = run(out, tiny_src)
    assert report["readers"] == readers
    assert [f["message"] for f in failures(report)] == [
        f"[values/fp8-negative-zero] {rel} {name!r}: expected no -0 code (0x80): this target's readers may take "
        f"0x80 for NaN (float8_e4m3fnuz); found 1 of {end - begin} codes are 0x80"
    ]


@pytest.mark.slow
def test_table_and_parallel_workers(converted, tiny_src):
    res = runner.invoke(app, ["verify", str(converted[FP8]), "--source", str(tiny_src), "--workers", "2"])
    assert res.exit_code == 0, res.stderr
    for word in ("structure", "integrity", "values", "source", "mla", "worst tensors", "PASS"):
        assert word in res.stdout
    assert runner.invoke(app, ["verify", str(converted[BF16]), "--quiet"]).stdout == ""


# --- integrity ----------------------------------------------------------------------------------


def test_byte_flipped_in_shard_data(fp8_out, tiny_src):
    name = "model.layers.1.self_attn.q_b_proj.weight"
    rel = shard_of(fp8_out, name)
    begin, end = data_offset(fp8_out / rel, name)
    pos = (begin + end) // 2
    byte = (fp8_out / rel).read_bytes()[pos]
    patch_bytes(fp8_out / rel, pos, bytes([byte ^ 0x10]))
    _, report = run(fp8_out)
    assert_fails(report, "integrity", "sha256", file=rel)
    _, report = run(fp8_out, tiny_src)  # the source comparison says which tensor
    assert_fails(report, "source", "fp8-bound", file=rel, tensor=name)


def test_shard_truncated(out):
    rel = "model-00003-of-00004.safetensors"
    data = (out / rel).read_bytes()
    (out / rel).write_bytes(data[:-1000])
    _, report = run(out)
    assert_fails(report, "integrity", "size", file=rel)
    assert_fails(report, "structure", "header", file=rel)
    assert "truncated" in next(f["found"] for f in failures(report, "structure") if f["check"] == "header")


def test_a_shard_cut_short_after_its_header_was_read_is_a_failed_read_naming_file_and_tensor(fp8_out, monkeypatch):
    """The data pass reads each tensor by offset, exactly (io.reader): a file that shrank after the
    header pass is one failed read naming the file and the tensor. Before: "short read of NAME",
    which named no file."""
    import os

    from mla_convert.verification import runners

    rel = "model-00003-of-00004.safetensors"
    path, real = fp8_out / rel, runners.run_file_task

    def cut_then_run(task, progress=None):
        if task.rel == rel:
            os.truncate(path, path.stat().st_size - 1000)
        return real(task, progress)

    monkeypatch.setattr(runners, "run_file_task", cut_then_run)
    _, report = run(fp8_out)
    reads = [f for f in failures(report) if f["check"] == "read"]
    ended = rf"{re.escape(str(path))}: tensor '[^']+': file ended after \d+ of \d+ bytes \(truncated\?\)"
    assert len(reads) == 1 and reads[0]["file"] == rel and re.fullmatch(ended, reads[0]["found"]), reads


def test_side_file_missing(out):
    for rel in ("tokenizer.json", "figures/notes.txt"):
        (out / rel).unlink()
    _, report = run(out)
    assert_fails(report, "integrity", "missing-file", file="tokenizer.json")
    assert_fails(report, "integrity", "missing-file", file="figures/notes.txt")
    res = runner.invoke(app, ["verify", str(out), "--quiet"])  # quiet: only the failures, one per line
    assert res.exit_code == 1 and res.stdout == ""
    assert "[integrity/missing-file] tokenizer.json: expected" in res.stderr


def test_side_file_dropped_from_the_manifest_too(out, tiny_src):
    (out / "tokenizer.json").unlink()
    man = json.loads((out / MANIFEST_NAME).read_text())
    del man["files"]["tokenizer.json"]
    (out / MANIFEST_NAME).write_text(json.dumps(man))
    assert run(out)[0] == 0  # nothing without the source says it should be there...
    _, report = run(out, tiny_src)  # ...the source does
    assert_fails(report, "integrity", "side-file", file="tokenizer.json")


def test_unlisted_file(out):
    (out / "notes.txt").write_text("added after the conversion")
    _, report = run(out)
    assert_fails(report, "integrity", "unlisted-file", file="notes.txt")


def test_artifact_hash_differs_from_the_mla_manifest(fp8_out):
    save_file(load_file(fp8_out / mla_rel(1)), fp8_out / mla_rel(1), metadata={"note": "rewritten"})  # same values
    data = (fp8_out / mla_rel(1)).read_bytes()
    man = json.loads((fp8_out / MANIFEST_NAME).read_text())  # only the conversion manifest updated
    man["files"][mla_rel(1)] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (fp8_out / MANIFEST_NAME).write_text(json.dumps(man))
    _, report = run(fp8_out)
    assert_fails(report, "integrity", "mla-manifest", file=mla_rel(1))


def test_incomplete_conversion_fails(fp8_out):
    man = json.loads((fp8_out / MANIFEST_NAME).read_text())
    man["status"] = "incomplete"
    (fp8_out / MANIFEST_NAME).write_text(json.dumps(man))
    _, report = run(fp8_out)
    assert_fails(report, "integrity", "status", file=MANIFEST_NAME)


# --- structure ----------------------------------------------------------------------------------


def test_tensor_dropped_from_index(out):
    name = "model.layers.2.mlp.experts.4.up_proj.weight"
    index = json.loads((out / INDEX).read_text())
    rel = index["weight_map"].pop(name)
    (out / INDEX).write_text(json.dumps(index))
    fix_hash(out, INDEX)
    _, report = run(out)
    assert_fails(report, "structure", "index-vs-header", file=rel, tensor=name)
    assert_fails(report, "structure", "missing-tensor", tensor=name)
    assert not failures(report, "integrity")


def test_tensor_added_to_shard_but_not_index(out):
    rel = "model-00002-of-00004.safetensors"
    extra = "model.layers.1.self_attn.extra.weight"
    rewrite(out / rel, lambda t: t.__setitem__(extra, torch.ones(4, 4, dtype=torch.bfloat16)))
    fix_hash(out, rel)
    _, report = run(out)
    assert_fails(report, "structure", "index-vs-header", file=rel, tensor=extra)
    assert not failures(report, "integrity")


def test_trailing_bytes_after_the_last_tensor(out):
    rel = "model-00004-of-00004.safetensors"
    with open(out / rel, "ab") as f:
        f.write(b"\0" * 64)
    fix_hash(out, rel)
    _, report = run(out)
    assert_fails(report, "structure", "header", file=rel)
    assert "trailing bytes" in next(f["found"] for f in failures(report) if f["check"] == "header")


def test_wrong_total_size(out):
    index = json.loads((out / INDEX).read_text())
    index["metadata"]["total_size"] += 1
    (out / INDEX).write_text(json.dumps(index))
    fix_hash(out, INDEX)
    _, report = run(out)
    assert_fails(report, "structure", "total_size", file=INDEX)


def test_leftover_block_scale(fp8_out):
    rel = "model-00001-of-00004.safetensors"
    name = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    rewrite(fp8_out / rel, lambda t: t.__setitem__(name, torch.ones(2, 4)))
    index = json.loads((fp8_out / INDEX).read_text())
    index["weight_map"][name] = rel
    (fp8_out / INDEX).write_text(json.dumps(index))
    for r in (rel, INDEX):
        fix_hash(fp8_out, r)
    _, report = run(fp8_out)
    assert_fails(report, "structure", "unexpected-tensor", file=rel, tensor=name)


def test_quantization_config_claims_an_unquantized_layer(fp8_out):
    cfg = json.loads((fp8_out / "config.json").read_text())
    cfg["quantization_config"]["ignore"].remove("model.layers.1.mlp.gate")
    (fp8_out / "config.json").write_text(json.dumps(cfg, indent=2))
    fix_hash(fp8_out, "config.json")
    _, report = run(fp8_out)
    assert_fails(report, "structure", "quantization_config", file="config.json", tensor="model.layers.1.mlp.gate")


def test_ignore_pattern_dropped_from_config(tiny_src, tmp_path):
    """Experts left in bf16 by --ignore, then the pattern removed: the config now claims FP8 experts."""
    out = tmp_path / "out"
    convert(tiny_src, out, Options(ignore=(r"model\.layers\.2\.mlp\.experts",)))
    assert run(out)[0] == 0
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["ignore"] = [e for e in cfg["quantization_config"]["ignore"] if not e.startswith("re:")]
    (out / "config.json").write_text(json.dumps(cfg))
    fix_hash(out, "config.json")
    _, report = run(out)
    assert_fails(report, "structure", "quantization_config", tensor="model.layers.2.mlp.experts.0.down_proj")
    assert_fails(report, "structure", "dtype-shape", tensor="model.layers.2.mlp.experts.0.up_proj.weight")


# --- values and numerics ------------------------------------------------------------------------


def test_weight_scale_doubled(fp8_out, tiny_src):
    name = "model.layers.2.mlp.experts.5.gate_proj.weight_scale"
    rel = shard_of(fp8_out, name)
    rewrite(fp8_out / rel, lambda t: t.__setitem__(name, t[name] * 2))
    fix_hash(fp8_out, rel)
    assert run(fp8_out)[0] == 0  # no check without the source can see a consistent rescale...
    _, report = run(fp8_out, tiny_src)  # ...the source comparison does
    assert_fails(report, "source", "fp8-bound", file=rel, tensor=name.replace("_scale", ""))
    assert_fails(report, "source", "fp8-scale", file=rel, tensor=name)
    assert [f["group"] for f in failures(report)] == ["source", "source"]


def test_kv_b_proj_scale_doubled_caught_by_mla_without_source(fp8_out):
    name = kv_b(1) + "_scale"
    rel = shard_of(fp8_out, name)
    rewrite(fp8_out / rel, lambda t: t.__setitem__(name, t[name] * 2))
    fix_hash(fp8_out, rel)
    _, report = run(fp8_out)
    assert_fails(report, "mla", "split-bound", file=mla_rel(1), tensor=w_uk_t_name(1))


def test_nan_written_into_a_weight(out, tiny_src):
    name = "model.layers.0.mlp.down_proj.weight"
    rel = shard_of(out, name)
    begin, _ = data_offset(out / rel, name)
    fp8 = json.loads((out / MANIFEST_NAME).read_text())["options"]["format"] == FP8
    patch_bytes(out / rel, begin + 10, b"\x7f" if fp8 else struct.pack("<H", 0x7FC0))
    fix_hash(out, rel)
    _, report = run(out)
    assert_fails(report, "values", "nan-inf", file=rel, tensor=name)
    _, report = run(out, tiny_src)
    assert_fails(report, "source", "fp8-bound" if fp8 else "bf16-exact", file=rel, tensor=name)


def test_copied_tensor_changed(out, tiny_src):
    name = "model.norm.weight"
    rel = shard_of(out, name)
    rewrite(out / rel, lambda t: t.__setitem__(name, t[name] + 1))
    fix_hash(out, rel)
    assert run(out)[0] == 0
    _, report = run(out, tiny_src)
    assert_fails(report, "source", "copy-exact", file=rel, tensor=name)


def test_fp8_values_beyond_the_target_range(fp8_out):
    """A gaudi3 (max 448) conversion relabelled gaudi2 (max 240)."""
    man = json.loads((fp8_out / MANIFEST_NAME).read_text())
    man["options"]["target"] = "gaudi2"
    (fp8_out / MANIFEST_NAME).write_text(json.dumps(man))
    _, report = run(fp8_out)
    assert_fails(report, "values", "fp8-range", tensor="model.layers.0.self_attn.q_a_proj.weight")
    # The config is the same for both targets: the range check alone tells them apart.
    assert not [f for f in failures(report, "structure") if f["check"] == "quantization_config"]


def test_fp8_dtype_flavor_claiming_fnuz_fails(fp8_out):
    """The weights are float8_e4m3fn: a config claiming float8_e4m3fnuz (exponent bias 8, 0x80 NaN)
    describes bytes that are not there."""
    cfg = json.loads((fp8_out / "config.json").read_text())
    cfg["quantization_config"]["fp8_dtype_flavor"] = "float8_e4m3fnuz"
    (fp8_out / "config.json").write_text(json.dumps(cfg))
    fix_hash(fp8_out, "config.json")
    _, report = run(fp8_out)
    assert_fails(report, "structure", "quantization_config", file="config.json")


def test_fp8_values_short_of_the_target_range(tiny_src, tmp_path):
    """A gaudi2 (max 240) conversion relabelled gaudi3 (max 448): no row reaches 448."""
    out = tmp_path / "g2"
    convert(tiny_src, out, Options(target="gaudi2"))
    man = json.loads((out / MANIFEST_NAME).read_text())
    man["options"]["target"] = "gaudi3"
    (out / MANIFEST_NAME).write_text(json.dumps(man))
    _, report = run(out)
    assert_fails(report, "values", "fp8-row-max", tensor="model.layers.0.self_attn.q_a_proj.weight")


def test_non_positive_scale(fp8_out):
    name = "model.layers.1.self_attn.o_proj.weight_scale"
    rel = shard_of(fp8_out, name)

    def negate_row(t):
        t[name][5] = -t[name][5]

    rewrite(fp8_out / rel, negate_row)
    fix_hash(fp8_out, rel)
    _, report = run(fp8_out)
    assert_fails(report, "values", "fp8-scale", file=rel, tensor=name)


# --- MLA artifacts ------------------------------------------------------------------------------


def test_w_uv_of_two_layers_swapped(out, tiny_src):
    a, b = load_file(out / mla_rel(1)), load_file(out / mla_rel(2))
    a[w_uv_name(1)], b[w_uv_name(2)] = b[w_uv_name(2)], a[w_uv_name(1)]
    for layer, tensors in ((1, a), (2, b)):
        save_file(tensors, out / mla_rel(layer), metadata={"format": "pt"})
        fix_hash(out, mla_rel(layer))
    exact = json.loads((out / MANIFEST_NAME).read_text())["options"]["format"] == BF16
    _, report = run(out)
    for layer in (1, 2):
        assert_fails(
            report, "mla", "split-exact" if exact else "split-bound", file=mla_rel(layer), tensor=w_uv_name(layer)
        )
        assert_fails(report, "mla", "functional", file=mla_rel(layer), tensor=f"layer {layer}")
    assert {f["group"] for f in failures(report)} == {"mla"}
    _, report = run(out, tiny_src)
    assert_fails(report, "mla", "split-exact", file=mla_rel(2), tensor=w_uv_name(2))


@pytest.mark.parametrize("with_source", [False, True])
def test_artifact_damage_is_located_across_head_chunks(out, tiny_src, monkeypatch, with_source):
    """The artifact comparisons run a few heads at a time; a damaged element in a later chunk is
    counted once and reported at its place in the whole tensor."""
    from mla_convert.verification import mla as verify_mla

    monkeypatch.setattr(verify_mla, "HEADS_PER_CHUNK", 1)

    def damage(t):
        w = t[w_uv_name(1)]
        w[3, 5, 7] = w[3, 5, 7] * 4 + 1

    rewrite(out / mla_rel(1), damage)
    fix_hash(out, mla_rel(1))
    _, report = run(out, tiny_src if with_source else None)
    hits = [f for f in failures(report, "mla") if f["check"].startswith("split-") and f["tensor"] == w_uv_name(1)]
    assert len(hits) == 1 and re.search(r": 1 of \d+ elements; first at \[3, 5, 7\]", hits[0]["found"]), hits


def test_w_uk_t_stored_transposed(fp8_out):
    rewrite(
        fp8_out / mla_rel(0), lambda t: t.__setitem__(w_uk_t_name(0), t[w_uk_t_name(0)].transpose(1, 2).contiguous())
    )
    fix_hash(fp8_out, mla_rel(0))
    _, report = run(fp8_out)
    assert_fails(report, "structure", "mla-artifact", file=mla_rel(0), tensor=w_uk_t_name(0))
    assert_fails(report, "mla", "artifact", file=mla_rel(0), tensor=w_uk_t_name(0))


def test_w_uk_t_transposed_data_under_the_right_shape(fp8_out):
    def scramble(t):
        w = t[w_uk_t_name(3)]
        t[w_uk_t_name(3)] = w.transpose(1, 2).contiguous().view(w.shape)

    rewrite(fp8_out / mla_rel(3), scramble)
    fix_hash(fp8_out, mla_rel(3))
    _, report = run(fp8_out)
    assert_fails(report, "mla", "split-bound", file=mla_rel(3), tensor=w_uk_t_name(3))
    assert_fails(report, "mla", "functional", file=mla_rel(3))


@pytest.mark.parametrize("with_source", [False, True])
def test_artifact_from_a_different_checkpoint(out, other, tiny_src, with_source):
    fmt = json.loads((out / MANIFEST_NAME).read_text())["options"]["format"]
    shutil.copy(other[fmt] / mla_rel(2), out / mla_rel(2))
    fix_hash(out, mla_rel(2))
    _, report = run(out, tiny_src if with_source else None)
    check = "split-exact" if with_source or fmt == BF16 else "split-bound"
    assert_fails(report, "mla", check, file=mla_rel(2), tensor=w_uk_t_name(2))
    assert_fails(report, "mla", check, file=mla_rel(2), tensor=w_uv_name(2))
    assert_fails(report, "mla", "functional", file=mla_rel(2))
    assert {f["group"] for f in failures(report)} == {"mla"}


def test_mla_dir_from_another_conversion(fp8_out, other):
    """A whole mla/ directory left from a checkpoint of the same shapes: the source fingerprint
    (headers only) cannot tell them apart, the values do."""
    shutil.rmtree(fp8_out / "mla")
    shutil.copytree(other[FP8] / "mla", fp8_out / "mla")
    for rel in [*(mla_rel(i) for i in range(4)), "mla/manifest.json"]:
        fix_hash(fp8_out, rel)
    _, report = run(fp8_out)
    for layer in range(4):
        assert_fails(report, "mla", "split-bound", file=mla_rel(layer), tensor=w_uk_t_name(layer))


def test_mla_manifest_of_another_source(fp8_out):
    mla = json.loads((fp8_out / "mla/manifest.json").read_text())
    mla["source_fingerprint"] = "0" * 64
    (fp8_out / "mla/manifest.json").write_text(json.dumps(mla))
    fix_hash(fp8_out, "mla/manifest.json")
    _, report = run(fp8_out)
    assert_fails(report, "mla", "fingerprint", file="mla/manifest.json")


def test_source_from_another_checkpoint(converted, other, tiny_src, tmp_path):
    _, report = run(converted[FP8], other[FP8].parent / "src")  # same shapes, other values
    assert_fails(report, "source", "copy-exact", tensor="model.embed_tokens.weight")
    assert_fails(report, "source", "fp8-bound", tensor=kv_b(0))
    src = Path(shutil.copytree(tiny_src, tmp_path / "src"))  # same values, another config: another source
    cfg = json.loads((src / "config.json").read_text())
    cfg["rope_theta"] = 50000
    (src / "config.json").write_text(json.dumps(cfg))
    res = runner.invoke(app, ["verify", str(converted[FP8]), "--source", str(src)])
    assert res.exit_code == 2 and "this is not the source this directory was converted from" in res.stderr
    assert "its config differs in ['rope_theta']" in res.stderr


def test_a_source_that_is_not_this_ones_is_one_line_not_the_outputs_failures(converted, family_checkpoints):
    """Another checkpoint as --source (its fingerprint is not the one recorded) is said in one
    line, first; the comparisons that follow from it are not the output's failures."""
    from mla_convert.source.checkpoint import open_source

    other = family_checkpoints.source("kimi-k2")
    recorded = json.loads((converted[FP8] / MANIFEST_NAME).read_text())["source_fingerprint"]
    given = open_source(other).fingerprint()
    res = runner.invoke(app, ["verify", str(converted[FP8]), "--source", str(other)])
    lines = res.stderr.strip().splitlines()
    assert res.exit_code == 2 and len(lines) == 1, (res.exit_code, res.stdout, res.stderr)
    assert f"this is not the source this directory was converted from: recorded {recorded}, given {given}" in lines[0]
    assert lines[0].startswith(f"error: --source {other}: ")
    assert "[structure/" not in res.stdout and "worst tensors" not in res.stdout
    with pytest.raises(VerificationError, match="not the source this directory was converted from"):
        verify(converted[FP8], other)


# --- cannot run: exit 2 ---------------------------------------------------------------------------


def test_not_a_conversion_exits_2(tiny_src, tmp_path):
    cases = {
        tiny_src: "looks like a block-FP8 source checkpoint",
        tmp_path / "missing": "no such directory",
        tmp_path: "not an mla-convert output",
    }
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / MANIFEST_NAME).write_text("{not json")
    cases[tmp_path / "junk"] = "unreadable conversion manifest"
    for path, reason in cases.items():
        res = runner.invoke(app, ["verify", str(path)])
        assert res.exit_code == 2, (path, res.stdout, res.stderr)
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and reason in lines[0], res.stderr
        with pytest.raises(VerificationError):
            verify(path)


def test_unusable_source_exits_2(converted, tmp_path):
    res = runner.invoke(app, ["verify", str(converted[BF16]), "--source", str(converted[FP8])])
    assert res.exit_code == 2 and res.stderr.strip().startswith("error: --source:"), res.stderr
    assert "compressed-tensors" in res.stderr


# --- the yardsticks themselves ----------------------------------------------------------------


def test_fp8_bound_holds_and_is_tight():
    """The converter's quantizer meets the documented bound on rows spanning e4m3's normal and
    subnormal ranges (and zero rows), and uses most of it: the bound is not loose."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 1024, generator=g) * torch.logspace(-12, 0, 1024)  # down into e4m3 subnormals and below
    x[3] = 0
    for fp8_max in (448.0, 240.0):
        q, s = quantize_channel_fp8(x, fp8_max)
        ratio = ((q.float() * s - x).abs() / fp8_allowed_error(x.abs(), s)).max()
        assert 0.9 < ratio <= 1


def test_functional_reference_agrees_with_the_documented_layout():
    """absorbed(W_UK_T, W_UV) == naive(kv_b_proj) when the artifacts are laid out as vllm-gaudi's
    HPUMLAAttention builds them (transpose, view [L, N, P+V], split, permute), written here anew."""
    dims = MlaDims(num_heads=3, qk_nope_head_dim=8, v_head_dim=6, kv_lora_rank=16)
    w = torch.randn(3 * 14, 16, dtype=torch.float64)
    w_uk, w_uv = w.T.reshape(16, 3, 14).split([8, 6], dim=-1)
    uk_t, uv = w_uk.permute(1, 2, 0).contiguous(), w_uv.transpose(0, 1).contiguous()
    assert functional_error(uk_t, uv, w, dims, rope_dim=4, seed=0) < 1e-5  # float32 rounding only
    assert functional_error(uk_t, uv.flip(0), w, dims, rope_dim=4, seed=0) > 0.1  # heads swapped


def test_demo_verifies_its_output(tmp_path):
    res = runner.invoke(app, ["demo", "--out", str(tmp_path / "demo"), "--json"])
    assert res.exit_code == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["verify"]["ok"] and summary["verify"]["failed"] == 0 and summary["verify"]["checks"] > 1000


def test_report_lists_tolerances_and_counts(converted):
    _, report = run(converted[FP8])
    assert set(report["tolerances"]) == {"channel_fp8", "bf16", "copied", "mla_artifacts", "mla_functional"}
    assert report["groups"]["source"]["skipped"] == "no --source given"
    assert report["mla_layers"] == 4 and report["files"] == len(
        json.loads((converted[FP8] / MANIFEST_NAME).read_text())["files"]
    )
    assert report["readers"] == "native" and "agree with torch on the probes" in report["readers_reason"]


@pytest.mark.parametrize("what", ["byte", "nan", "scale"])
def test_native_and_torch_verify_passes_agree(fp8_out, tiny_src, torch_readers, what):
    """verify --source runs its fp8 checks in C when the native library matches torch; on a
    broken output both passes report the same failures, counts and first locations."""
    kernels = torch_readers
    name = "model.layers.1.self_attn.q_b_proj.weight"
    rel = shard_of(fp8_out, name)
    begin, end = data_offset(fp8_out / rel, name)
    if what == "scale":
        rewrite(fp8_out / rel, lambda t: t.__setitem__(name + "_scale", t[name + "_scale"] * 1.5))
    else:
        pos = (begin + end) // 2 + 3
        byte = (fp8_out / rel).read_bytes()[pos]
        patch_bytes(fp8_out / rel, pos, b"\x7f" if what == "nan" else bytes([byte ^ 0x21]))
    fix_hash(fp8_out, rel)
    assert kernels.reader_backend().name == "native"
    _, native_report = run(fp8_out, tiny_src)
    kernels.use(kernels.TORCH_BACKEND)
    _, torch_report = run(fp8_out, tiny_src)
    assert_fails(native_report, "source", "fp8-bound", file=rel, tensor=name)
    assert failures(native_report) == failures(torch_report)
    assert (native_report["readers"], torch_report["readers"]) == ("native", "torch")
    assert torch_report["readers_reason"] == kernels.TORCH_BACKEND.reason


@pytest.mark.parametrize("pattern", [0x7F80, 0xFF80, 0x7FC1])  # +Inf, -Inf, a NaN
def test_native_and_torch_find_the_same_nonfinite_bf16(converted, tmp_path, torch_readers, pattern):
    """The NaN/Inf check of bf16 tensors counts exponent bits in C when the library matches
    torch; torch's isfinite locates them. Both report the same failure."""
    kernels = torch_readers
    out = Path(shutil.copytree(converted[BF16], tmp_path / "out"))
    name = "model.layers.0.mlp.down_proj.weight"
    rel = shard_of(out, name)
    begin, end = data_offset(out / rel, name)
    patch_bytes(out / rel, begin + 2 * ((end - begin) // 4), struct.pack("<H", pattern))
    fix_hash(out, rel)
    assert kernels.reader_backend().name == "native"
    _, native_report = run(out)
    kernels.use(kernels.TORCH_BACKEND)
    _, torch_report = run(out)
    assert_fails(native_report, "values", "nan-inf", file=rel, tensor=name)
    assert failures(native_report) == failures(torch_report)


def test_files_are_verified_two_at_a_time_with_the_same_report(out, tiny_src, monkeypatch):
    """One process checks two files at once (one's hash overlaps the other's checks); the report,
    failures included, does not depend on it."""
    import threading
    import time

    from mla_convert.verification import runners as verify_mod

    rewrite(out / mla_rel(1), lambda t: t[w_uv_name(1)].mul_(2))
    fix_hash(out, mla_rel(1))
    real, running, peak, lock = verify_mod.run_file_task, [0], [0], threading.Lock()

    def tracked(task, progress=None):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.05)
        try:
            return real(task, progress)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(verify_mod, "run_file_task", tracked)
    reports = {}
    for threads in (1, 2):
        monkeypatch.setattr(verify_mod, "FILE_THREADS", threads)
        peak[0] = 0
        _, report = run(out, tiny_src)
        assert peak[0] == threads
        # Each verify() chooses its readers anew: the first may probe, the next finds the pass remembered.
        reports[threads] = {k: v for k, v in report.items() if k not in ("seconds", "readers_reason")}
    assert reports[1] == reports[2] and reports[1]["exit_code"] == 1


def test_read_buffers_are_reused_in_turn_unless_leased(monkeypatch):
    """verify reads tensors into two buffers used in turn; a buffer leased to a check (a pending
    weight, an MLA artifact) is never written again, and is reused once the lease is released."""
    import io

    from mla_convert.verification.buffers import ReadBuffers

    f = io.BytesIO(bytes(range(256)) * 8)
    bufs = ReadBuffers()

    def read(nbytes: int) -> memoryview:  # the next bytes of f, into the memory taken for them (as the stream does)
        view = bufs.take(nbytes)
        return view[: f.readinto(view)]

    a = read(256)
    bufs.lease(a, "a")  # held for good
    kept = bytes(a)
    b, c = read(256), read(128)
    lease_c = bufs.lease(c, "c")
    d = read(200)
    assert bytes(a) == kept, "a leased buffer was overwritten"
    assert c.obj is not a.obj and d.obj is b.obj, "the slots are used in turn"
    assert bytes(c) == bytes(range(128)) and bytes(d) == bytes(range(128, 256)) + bytes(range(72))
    assert lease_c.owner == "c" and lease_c.live
    lease_c.release()
    e = read(100)
    assert e.obj is c.obj and bytes(e) == bytes(range(72, 172)), "a released buffer is reused"
    assert bytes(d) == bytes(range(128, 256)) + bytes(range(72)), "the other slot was left alone"
    monkeypatch.setattr(ReadBuffers, "REUSE_BYTES", 64)
    big = read(100)  # over REUSE_BYTES: memory of its own; its lease holds no slot
    assert big.obj is not d.obj and big.obj is not e.obj and bytes(big) == bytes(range(172, 256)) + bytes(range(16))
    bufs.lease(big, "big")
    assert read(10).obj is e.obj, "the slots stay free for later tensors"
    assert len(read(1000)) == 2048 - 1050  # the end of the file: fewer bytes


def test_a_weight_waiting_for_its_scale_keeps_its_buffer(fp8_out, tiny_src):
    """A channel-FP8 weight whose scale comes later in its file is compared with the source when
    the scale streams by; the tensors read in between go to other memory than the weight's."""
    name = "model.layers.0.mlp.down_proj.weight"
    rel = shard_of(fp8_out, name)
    move_to_end(fp8_out / rel, name + "_scale")
    fix_hash(fp8_out, rel)
    code, report = run(fp8_out, tiny_src)
    assert code == 0, "\n".join(f["message"] for f in failures(report))
    assert report["groups"]["source"]["checked"] > 0


def test_read_buffers_belong_to_a_thread_and_outlive_a_file():
    import threading

    from mla_convert.verification.buffers import thread_buffers

    mine = thread_buffers()
    other = []
    t = threading.Thread(target=lambda: other.append(thread_buffers()))
    t.start()
    t.join()
    assert thread_buffers() is mine and other[0] is not mine


def test_source_rows_are_exact_through_short_reads(tmp_path, monkeypatch):
    """Source tensors are read by offset; a read that returns fewer bytes than asked (a network
    file system, a signal) is continued, so the rows are still exact."""
    import os

    from mla_convert.io.reader import Reader, Ref
    from mla_convert.verification.rows import RowReader

    t = torch.randn(37, 11)
    path = tmp_path / "source.bin"
    path.write_bytes(b"\0" * 13 + t.numpy().tobytes())
    real, calls = os.preadv, []

    def at_most_7_bytes(fd, buffers, offset):
        calls.append(offset)
        return real(fd, [memoryview(buffers[0])[:7]], offset)

    monkeypatch.setattr(os, "preadv", at_most_7_bytes)
    with Reader() as files:
        reader = RowReader(files)
        ref = Ref(str(path), "w", 13, "F32", (37, 11))
        assert torch.equal(reader.rows(ref), t)
        assert torch.equal(reader.rows(ref, 5, 9), t[5:14])
    assert len(calls) >= (37 + 9) * 11 * 4 // 7


def test_a_truncated_source_file_names_the_file_and_tensor(tmp_path):
    from mla_convert.io.reader import Reader, ReadFailed, Ref
    from mla_convert.verification.rows import RowReader

    path = tmp_path / "source.bin"
    path.write_bytes(b"\0" * 100)
    ended = rf"{re.escape(str(path))}: tensor 'w': file ended after 87 of 120"
    with Reader() as files, pytest.raises(ReadFailed, match=ended):
        RowReader(files).rows(Ref(str(path), "w", 13, "BF16", (6, 10)))
