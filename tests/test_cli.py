"""The CLI through Typer's test runner: exit codes, one-line errors, nothing written on refusal."""

import json

import pytest
from typer.testing import CliRunner

from mla_convert.cli import app

runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def one_line_error(result) -> str:
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    return lines[0]


def test_help_lists_commands_and_options():
    r = run("--help")
    assert r.exit_code == 0 and "deepseek-r1" in r.stdout and "demo" in r.stdout
    r = run("deepseek-r1", "--help")
    for opt in ("--out", "--format", "--target", "--workers", "--dry-run", "--json", "--quiet", "--ignore"):
        assert opt in r.stdout


def test_convert_json_summary(tiny_src, tmp_path, load_json):
    out = tmp_path / "out"
    r = run("deepseek-r1", tiny_src, "--out", out, "--format", "bf16", "--json")
    assert r.exit_code == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["status"] == "complete" and summary["format"] == "bf16"
    assert summary["mla_layers"] == 4 and summary["shards"] == 4
    assert summary["fp8_weights_converted"] == 104
    assert load_json(out / "mla-convert-manifest.json")["status"] == "complete"


def test_dry_run_writes_nothing(tiny_src, tmp_path):
    out = tmp_path / "out"
    r = run("deepseek-r1", tiny_src, "--out", out, "--dry-run", "--json")
    assert r.exit_code == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["dry_run"] is True and plan["disk_needed"] > plan["bytes_out_model"] > 0
    assert not out.exists()


def test_non_empty_out_is_refused_and_left_alone(tiny_src, tmp_path):
    """A directory of the user's files is never an --out, with or without --overwrite."""
    out = tmp_path / "out"
    (out / "keep").mkdir(parents=True)
    (out / "keep" / "thesis.txt").write_text("mine")
    r = run("deepseek-r1", tiny_src, "--out", out, "--quiet")
    assert r.exit_code == 2
    assert "not empty" in one_line_error(r) and "keep/thesis.txt" in r.stderr
    r = run("deepseek-r1", tiny_src, "--out", out, "--quiet", "--overwrite")
    assert r.exit_code == 2
    line = one_line_error(r)
    assert "--overwrite replaces only an earlier mla-convert output" in line and "keep/thesis.txt" in line
    assert [str(p.relative_to(out)) for p in out.rglob("*")] == ["keep", "keep/thesis.txt"]
    assert (out / "keep" / "thesis.txt").read_text() == "mine"


@pytest.mark.parametrize("where", ["same", "inside"])
def test_out_overlapping_source_is_refused(src_copy, where):
    out = src_copy if where == "same" else src_copy / "converted"
    r = run("deepseek-r1", src_copy, "--out", out, "--quiet")
    assert r.exit_code != 0 and "source" in one_line_error(r)
    assert not (src_copy / "converted").exists()


def test_non_deepseek_source_gives_one_line_error(src_copy, tmp_path, load_json):
    cfg = load_json(src_copy / "config.json")
    cfg["architectures"], cfg["model_type"] = ["LlamaForCausalLM"], "llama"
    (src_copy / "config.json").write_text(json.dumps(cfg))
    r = run("deepseek-r1", src_copy, "--out", tmp_path / "out", "--quiet")
    assert r.exit_code == 2
    line = one_line_error(r)
    assert "LlamaForCausalLM" in line and "config.json" in line
    assert not (tmp_path / "out").exists()


def test_non_fp8_source_gives_one_line_error(src_copy, tmp_path, load_json):
    cfg = load_json(src_copy / "config.json")
    del cfg["quantization_config"]
    (src_copy / "config.json").write_text(json.dumps(cfg))
    r = run("deepseek-r1", src_copy, "--out", tmp_path / "out", "--quiet")
    assert r.exit_code == 2 and "quantization_config" in one_line_error(r)
    assert not (tmp_path / "out").exists()


def test_bad_option_values(tiny_src, tmp_path):
    r = run("deepseek-r1", tiny_src, "--out", tmp_path / "o", "--format", "int4")
    assert r.exit_code == 2 and "--format" in one_line_error(r)
    r = run("deepseek-r1", tiny_src, "--out", tmp_path / "o", "--ignore", "([")
    assert r.exit_code == 2 and "--ignore" in one_line_error(r)
    for flag in ("--kernels", "--write-io"):  # checked once, up front: also with --dry-run
        r = run("deepseek-r1", tiny_src, "--out", tmp_path / "o", flag, "fast", "--dry-run")
        assert r.exit_code == 2 and f"{flag}: " in one_line_error(r) and "'fast'" in r.stderr
    assert not (tmp_path / "o").exists()


def test_missing_source_directory(tmp_path):
    r = run("deepseek-r1", tmp_path / "nope", "--out", tmp_path / "o")
    assert r.exit_code == 2 and "nope" in one_line_error(r)


def test_demo_runs_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r = run("demo", "--out", tmp_path / "demo", "--json")
    assert r.exit_code == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["status"] == "complete" and summary["mla_layers"] == 4
    assert (tmp_path / "demo" / "source" / "config.json").exists()
    assert (tmp_path / "demo" / "converted-channel-fp8" / "mla" / "manifest.json").exists()


def test_commands_leave_the_cyclic_gc_on(tiny_src, tmp_path):
    """Start-up pauses the GC while torch imports; the commands must not leave it off."""
    import gc

    out = str(tmp_path / "o")
    for args in (["deepseek-r1", str(tiny_src), "--out", out, "--quiet"], ["verify", out, "--quiet"]):
        assert CliRunner().invoke(app, args).exit_code == 0
        assert gc.isenabled()
