"""Crash safety, resume, determinism and hostile input."""

import json
import resource
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from mla_convert.cli.app import app
from mla_convert.errors import SourceError
from mla_convert.io.headers import read_header
from mla_convert.source.checkpoint import open_source
from support.checkpoints import SHARD1, SHARD2, load_json

MANIFEST = "mla-convert-manifest.json"


def assert_not_complete(out: Path, killed: bool = False) -> None:
    """Nothing left that a later run or verify would take as a finished conversion. A clean error
    also removes its partial file; after SIGKILL one may remain, hidden and never renamed."""
    if out.exists():
        m = out / MANIFEST
        assert not m.exists() or load_json(m)["status"] != "complete"
        if not killed:
            assert not list(out.rglob("*.partial"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "point",
    [f"shard-write:{SHARD2}", f"after-job:{SHARD1}", f"after-job:{SHARD2}", "index", "mla-manifest", "final-manifest"],
)
def test_sigkill_then_resume_is_byte_identical(tiny_src, converted, tmp_path, point, run_cli, tree_hashes):
    out = tmp_path / "out"
    r = run_cli("deepseek-r1", tiny_src, "--out", out, "--quiet", crash_at=point)
    assert r.returncode == -9, r.stderr
    assert_not_complete(out, killed=True)
    again = run_cli("deepseek-r1", tiny_src, "--out", out, "--quiet")
    assert again.returncode != 0 and "--resume" in again.stderr
    r = run_cli("deepseek-r1", tiny_src, "--out", out, "--resume", "--json")
    assert r.returncode == 0, r.stderr
    if point.startswith("after-job") or point in ("index", "mla-manifest", "final-manifest"):
        assert json.loads(r.stdout)["resumed_jobs"] >= 1  # finished shards were kept, not redone
    assert tree_hashes(out) == tree_hashes(converted["channel-fp8"])


@pytest.mark.slow
def test_resume_redoes_a_damaged_finished_shard(tiny_src, converted, tmp_path, run_cli, tree_hashes):
    out = tmp_path / "out"
    assert run_cli("deepseek-r1", tiny_src, "--out", out, "--quiet").returncode == 0
    data = bytearray((out / SHARD1).read_bytes())
    data[-100] ^= 0xFF
    (out / SHARD1).write_bytes(bytes(data))
    r = run_cli("deepseek-r1", tiny_src, "--out", out, "--resume", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["resumed_jobs"] == 3
    assert tree_hashes(out) == tree_hashes(converted["channel-fp8"])


@pytest.mark.slow
def test_resume_refuses_other_options_or_source(src_copy, tmp_path, run_cli):
    out = tmp_path / "out"
    r = run_cli("deepseek-r1", src_copy, "--out", out, "--quiet", crash_at=f"after-job:{SHARD1}")
    assert r.returncode == -9
    r = run_cli("deepseek-r1", src_copy, "--out", out, "--resume", "--format", "bf16", "--quiet")
    assert r.returncode != 0 and "format recorded 'channel-fp8', requested 'bf16'" in r.stderr
    cfg = load_json(src_copy / "config.json")
    cfg["rms_norm_eps"] = 1e-5
    (src_copy / "config.json").write_text(json.dumps(cfg))
    r = run_cli("deepseek-r1", src_copy, "--out", out, "--resume", "--quiet")
    assert r.returncode != 0 and "different source" in r.stderr
    assert_not_complete(out, killed=True)


@pytest.mark.slow
def test_determinism_across_runs_is_covered_with_resume(tiny_src, converted, tmp_path, run_cli, tree_hashes):
    """Resume on an already complete directory verifies it and changes nothing."""
    out = tmp_path / "out"
    assert run_cli("deepseek-r1", tiny_src, "--out", out, "--quiet").returncode == 0
    before = tree_hashes(out)
    r = run_cli("deepseek-r1", tiny_src, "--out", out, "--resume", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["resumed_jobs"] == 4
    assert tree_hashes(out) == before == tree_hashes(converted["channel-fp8"])


@pytest.mark.slow
def test_file_size_limit_mid_write_is_a_clean_error_and_resumable(tiny_src, converted, tmp_path, run_cli, tree_hashes):
    out = tmp_path / "out"

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (1_500_000, 1_500_000))  # shards are ~2.4 MB

    r = run_cli("deepseek-r1", tiny_src, "--out", out, "--quiet", preexec_fn=limit)
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "write failed" in lines[0] and ".safetensors" in lines[0], r.stderr
    assert "raise the file size limit (ulimit -f), then finish it with the same command and --resume" in lines[0]
    assert_not_complete(out)
    r = run_cli("deepseek-r1", tiny_src, "--out", out, "--resume", "--quiet")
    assert r.returncode == 0, r.stderr
    assert tree_hashes(out) == tree_hashes(converted["channel-fp8"])


# ---- bad input: one line, exit != 0, the culprit named, nothing claiming completeness ----------

runner = CliRunner()


def convert_fails(src: Path, out: Path, *expect: str) -> str:
    r = runner.invoke(app, ["deepseek-r1", str(src), "--out", str(out), "--quiet"])
    assert r.exit_code not in (0, 70), (r.exit_code, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for e in expect:
        assert e in lines[0], lines[0]
    assert_not_complete(out)
    return lines[0]


def edit_json(path: Path, fn) -> None:
    d = json.loads(path.read_text())
    fn(d)
    path.write_text(json.dumps(d))


def rewrite_shard(path: Path, fn) -> None:
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def shard_of(src: Path, name: str) -> Path:
    return src / load_json(src / "model.safetensors.index.json")["weight_map"][name]


KV_A = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"


def test_missing_config(src_copy, tmp_path):
    (src_copy / "config.json").unlink()
    convert_fails(src_copy, tmp_path / "o", f"{src_copy}: not a checkpoint directory: no config.json")


def test_unparsable_config(src_copy, tmp_path):
    (src_copy / "config.json").write_text("{not json")
    convert_fails(src_copy, tmp_path / "o", "config.json", "not valid JSON")


@pytest.mark.parametrize(
    "key,value,expect",
    [("quant_method", "bitsandbytes", "quant_method 'bitsandbytes'"), ("fmt", "e5m2", "'e5m2'"),
     ("weight_block_size", [128], "weight_block_size [128]"), ("weight_block_size", [0, 128], "weight_block_size")],
)  # fmt: skip
def test_unsupported_quantization(src_copy, tmp_path, key, value, expect):
    edit_json(src_copy / "config.json", lambda c: c["quantization_config"].__setitem__(key, value))
    convert_fails(src_copy, tmp_path / "o", "config.json", expect)


def test_index_names_missing_shard(src_copy, tmp_path):
    (src_copy / SHARD2).unlink()
    convert_fails(src_copy, tmp_path / "o", SHARD2, "does not exist")


def test_truncated_shard(src_copy, tmp_path):
    p = src_copy / SHARD2
    p.write_bytes(p.read_bytes()[:-1000])
    convert_fails(src_copy, tmp_path / "o", SHARD2, "truncated")


def _with_header(path: Path, edit) -> None:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    new = json.dumps(header).encode()
    new += b" " * (-(len(new)) % 8)
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])


def test_corrupt_header_length(src_copy, tmp_path):
    p = src_copy / SHARD1
    p.write_bytes(struct.pack("<Q", 2**40) + p.read_bytes()[8:])
    convert_fails(src_copy, tmp_path / "o", SHARD1, "header length")


def test_offsets_out_of_range(src_copy, tmp_path):
    name = "model.embed_tokens.weight"
    _with_header(shard_of(src_copy, name), lambda h: h[name].__setitem__("data_offsets", [0, 10**12]))
    convert_fails(src_copy, tmp_path / "o", name)


def test_overlapping_tensors(src_copy, tmp_path):
    path = shard_of(src_copy, KV_A)

    def overlap(h):
        a = h[KV_A + "_scale_inv"]["data_offsets"]
        a[0], a[1] = a[0] - 4, a[1] - 4

    _with_header(path, overlap)
    convert_fails(src_copy, tmp_path / "o", path.name, "overlaps")


def test_weight_without_scale(src_copy, tmp_path):
    rewrite_shard(shard_of(src_copy, KV_A + "_scale_inv"), lambda t: t.pop(KV_A + "_scale_inv"))
    edit_json(src_copy / "model.safetensors.index.json", lambda i: i["weight_map"].pop(KV_A + "_scale_inv"))
    convert_fails(src_copy, tmp_path / "o", KV_A, "no ")


def test_scale_grid_does_not_fit(src_copy, tmp_path):
    rewrite_shard(shard_of(src_copy, KV_A), lambda t: t.__setitem__(KV_A + "_scale_inv", torch.ones(4, 2)))
    convert_fails(src_copy, tmp_path / "o", KV_A + "_scale_inv", "[5, 2]")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_or_inf_in_a_scale(src_copy, tmp_path, bad):
    name = "model.layers.2.mlp.experts.5.up_proj.weight_scale_inv"

    def poison(t):
        t[name] = t[name].clone()
        t[name][0, 1] = bad

    rewrite_shard(shard_of(src_copy, name), poison)
    convert_fails(src_copy, tmp_path / "o", name, "NaN or Inf")
    assert not (tmp_path / "o").exists()  # refused before the first byte was written


def test_non_fp8_dtype_where_fp8_expected(src_copy, tmp_path):
    rewrite_shard(shard_of(src_copy, KV_A), lambda t: t.__setitem__(KV_A, t[KV_A].to(torch.bfloat16)))
    convert_fails(src_copy, tmp_path / "o", KV_A, "BF16", "F8_E4M3")


@pytest.mark.parametrize("entry", ["/etc/passwd", "../outside.safetensors", "link.safetensors"])
def test_index_entry_escaping_the_source(src_copy, tmp_path, entry):
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes((src_copy / SHARD1).read_bytes())
    if entry == "link.safetensors":
        (src_copy / entry).symlink_to(outside)
    edit_json(
        src_copy / "model.safetensors.index.json", lambda i: i["weight_map"].__setitem__("model.norm.weight", entry)
    )
    convert_fails(src_copy, tmp_path / "o", entry)


def test_index_entry_with_a_nul_byte(src_copy, tmp_path):
    """A NUL cannot be in a path: refused like any other bad entry (the fuzzer found it raising)."""
    edit_json(
        src_copy / "model.safetensors.index.json",
        lambda i: i["weight_map"].__setitem__("model.norm.weight", "model\x00.safetensors"),
    )
    convert_fails(src_copy, tmp_path / "o", "model\\x00.safetensors", "relative path inside the checkpoint")


def test_out_containing_the_source(src_copy):
    convert_fails(src_copy, src_copy.parent, "contains the source")


# ---- fuzzing: any malformed header or index ends in SourceError, never a crash or hang --------

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@SETTINGS
@given(st.binary(max_size=64), st.binary(max_size=256))
def test_fuzz_raw_header_bytes(tmp_path, head, rest):
    p = tmp_path / "f.safetensors"
    p.write_bytes(head + rest)
    try:
        read_header(p)
    except SourceError:
        pass


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**64), 2**64) | st.floats() | st.text(max_size=8),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=12,
)
entries = st.fixed_dictionaries(
    {"dtype": st.sampled_from(["F8_E4M3", "F32", "BF16", "X9"]) | json_values,
     "shape": st.lists(st.integers(-2, 6), max_size=3) | json_values,
     "data_offsets": st.lists(st.integers(-4, 300), min_size=0, max_size=3) | json_values}
)  # fmt: skip


@SETTINGS
@given(st.dictionaries(st.text(min_size=1, max_size=6), entries | json_values, max_size=4), st.integers(0, 300))
def test_fuzz_structured_headers(tmp_path, header, data_len):
    raw = json.dumps(header).encode()
    p = tmp_path / "f.safetensors"
    p.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * data_len)
    try:
        h = read_header(p)
    except SourceError:
        return
    covered = sum(t.nbytes for t in h.tensors.values())
    assert covered == data_len  # accepted only if the tensors tile the data exactly


@SETTINGS
@given(json_values | st.fixed_dictionaries({"weight_map": st.dictionaries(st.text(max_size=40), json_values)}))
def test_fuzz_index(tiny_src, tmp_path_factory, index):
    import shutil

    src = Path(shutil.copytree(tiny_src, tmp_path_factory.mktemp("fz") / "src"))
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(SourceError):
        open_source(src)


def test_a_stage_recording_a_field_the_result_lacks_fails_before_anything_is_written(tiny_src, tmp_path):
    """The run's summary is its typed result from the plan on: a misspelt field fails where it is
    recorded (a dict took it, and the run failed only once the output was written)."""
    import contextlib
    import dataclasses

    from mla_convert.conversion import pipeline
    from mla_convert.results import ConversionResult
    from mla_convert.settings import Options, RunSettings

    out = tmp_path / "out"
    run = pipeline._Conversion(str(tiny_src), out, Options(), RunSettings())
    with contextlib.ExitStack() as cleanup:
        run.cleanup = cleanup
        run.open_source(cleanup)
        run.make_plan()
        planned = run.result
        assert isinstance(planned, ConversionResult) and planned.mla_layers == 4
        with pytest.raises(TypeError, match="disk_neded"):
            run.record(disk_neded=1)
        assert run.result is planned
        run.record(disk_required=7)
        assert run.result.disk_required == 7 and dataclasses.replace(run.result, disk_required=None) == planned
    assert not out.exists()
