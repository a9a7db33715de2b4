"""docs/troubleshooting.md lists the refusals a user meets first, as the code words them: each
message below is produced by the code it names and must match one of the page's rows (its
backticked message, `...` standing for any text, FIELD for a field's name)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mla_convert.cli.app import app
from mla_convert.kernels.modes import request_refused
from mla_runtime import ArtifactError
from mla_runtime.format import read_manifest

DOC = Path(__file__).resolve().parent.parent / "docs" / "troubleshooting.md"
runner = CliRunner()


def _row_patterns() -> list[re.Pattern]:
    """Each backticked message of the table's first column, as a pattern."""
    patterns = []
    for line in DOC.read_text().splitlines():
        if not line.startswith("| ") or line.startswith("| message"):
            continue
        for quoted in re.findall(r"`([^`]+)`", line.split(" | ")[0]):
            parts = re.split(r"\.\.\.|\bFIELD\b|\bSOURCE\b|\bOUT\b|\bN\b", quoted)
            patterns.append(re.compile(".*".join(re.escape(p) for p in parts)))
    return patterns


def _listed(message: str) -> bool:
    return any(p.search(message) for p in _row_patterns())


def _cli_error(*args) -> str:
    res = runner.invoke(app, [str(a) for a in args])
    assert res.exit_code == 2, res.stderr
    return res.stderr.strip()


def test_a_directory_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    assert _listed(_cli_error("convert", tmp_path / "empty", "--out", tmp_path / "out"))


def test_a_source_that_is_neither_a_directory_nor_a_repo(fake_hub, tmp_path):
    assert _listed(_cli_error("convert", "nobody/missing", "--out", tmp_path / "out"))


def test_a_config_field_of_another_type(src_copy, tmp_path, load_json):
    import json

    cfg = load_json(src_copy / "config.json") | {"n_routed_experts": [1, 2]}
    (src_copy / "config.json").write_text(json.dumps(cfg))
    assert _listed(_cli_error("convert", src_copy, "--out", tmp_path / "out"))


def test_native_kernels_asked_for_that_cannot_run():
    assert _listed(str(request_refused(("native",), ["native kernels unavailable (no C compiler found)"])))


def test_a_damaged_mla_manifest(tmp_path):
    (tmp_path / "mla").mkdir()
    (tmp_path / "mla" / "manifest.json").write_bytes(b'{"format": "mla-pre\xffcomputed"}')
    with pytest.raises(ArtifactError) as e:
        read_manifest(tmp_path / "mla")
    assert _listed(str(e.value)), str(e.value)


def test_an_out_that_is_not_empty(tiny_src, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("x")
    assert _listed(_cli_error("convert", tiny_src, "--out", tmp_path / "out"))


def test_a_model_that_is_not_supported(src_copy, tmp_path, load_json):
    import json

    cfg = load_json(src_copy / "config.json") | {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    (src_copy / "config.json").write_text(json.dumps(cfg))
    assert _listed(_cli_error("convert", src_copy, "--out", tmp_path / "out"))


def test_every_row_is_a_pattern_that_matches_something():
    """The patterns themselves: none is empty, so none matches every line."""
    assert all(p.pattern.replace(".*", "") for p in _row_patterns())
