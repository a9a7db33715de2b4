"""A damaged file is a clear line, never an internal error (issue 42, item 7): any byte of any file
that a command or the plugin reads (the configs, the index, the conversion manifest, the MLA
manifest, the model card, safetensors headers, the demo marker, the lock, the kernel verdicts)
changed, cut short, made non-UTF-8 or given JSON of the wrong type: `verify` fails naming the file
(exit 1) or refuses in one line (exit 2), the other commands refuse in one line, the plugin refuses
with an ArtifactError naming the file. Exit code 70 (a bug) never.

The named cases first, each one found by the mutation tests at the end (a fixed number of
derandomized examples in the default group; more in the `slow` one)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mla_convert.cli.app import app
from mla_runtime import ArtifactError, open_artifacts
from mla_runtime.format import read_manifest
from support.edits import edit_json

MLA_MANIFEST = "mla/manifest.json"
runner = CliRunner()


def _copy(path: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(path, tmp_path / path.name))


def _cli(*args) -> tuple[int, list[str]]:
    """(exit code, stderr's non-empty lines) of the CLI run in this process."""
    res = runner.invoke(app, [str(a) for a in args])
    return res.exit_code, [ln for ln in res.stderr.splitlines() if ln.strip()]


def _put_byte(path: Path, at: int, byte: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] = byte
    path.write_bytes(bytes(data))


# ---- the MLA manifest: verify and the plugin read the same file ----------------------------------


def test_a_non_utf8_byte_in_the_mla_manifest_fails_verify_naming_it_and_the_plugin_refuses(converted, tmp_path):
    out = _copy(converted["bf16"], tmp_path)
    _put_byte(out / MLA_MANIFEST, 10, 0xFF)
    code, lines = _cli("verify", out)
    assert code == 1, lines
    assert any(MLA_MANIFEST in ln and "UTF-8" in ln for ln in lines), lines
    with pytest.raises(ArtifactError, match=rf"^{out / MLA_MANIFEST}: .*UTF-8"):
        open_artifacts(out / "mla", model_dir=out)


def _layer0(d):
    return d["layers"][0]


MLA_MANIFEST_EDITS = {
    "a list for the manifest": (lambda d: [d], "a JSON object"),
    "producer a list": (lambda d: d.update(producer=[1, 2]), "producer"),
    "producer a string": (lambda d: d.update(producer="x"), "producer"),
    "dims a list": (lambda d: d.update(dims=[8, 128]), "dims"),
    "a dim a string": (lambda d: d["dims"].update(num_heads="8"), "dims.num_heads"),
    "a dim a float": (lambda d: d["dims"].update(kv_lora_rank=512.5), "dims.kv_lora_rank"),
    "a dim a bool": (lambda d: d["dims"].update(v_head_dim=True), "dims.v_head_dim"),
    "a dim negative": (lambda d: d["dims"].update(qk_nope_head_dim=-128), "dims.qk_nope_head_dim"),
    "a dim null": (lambda d: d["dims"].update(num_heads=None), "dims.num_heads"),
    "a dim missing": (
        lambda d: d.update(dims={k: v for k, v in d["dims"].items() if k != "num_heads"}),
        "dims.num_heads",
    ),
    "a dim unknown": (lambda d: d["dims"].update(rope=64), "dims.rope"),
    "layers an object": (lambda d: d.update(layers={"0": 1}), "layers"),
    "a layer a list": (lambda d: d["layers"].__setitem__(0, [0]), "layers[0]"),
    "a layer index a string": (lambda d: _layer0(d).update(layer="0"), "layers[0].layer"),
    "a layer index negative": (lambda d: _layer0(d).update(layer=-1), "layers[0].layer"),
    "a size a float": (lambda d: _layer0(d).update(size=1.5), "layers[0].size"),
    "a size negative": (lambda d: _layer0(d).update(size=-1), "layers[0].size"),
    "a sha256 an object": (lambda d: _layer0(d).update(sha256={"a": 1}), "layers[0].sha256"),
    "a file a number": (lambda d: _layer0(d).update(file=3), "layers[0].file"),
    "a layer's dims a list": (lambda d: _layer0(d).update(dims=[1]), "layers[0].dims"),
    "a layer's dim a string": (lambda d: _layer0(d).update(dims={"qk_nope_head_dim": "x"}), "layers[0].dims"),
    "the fingerprint a number": (lambda d: d.update(source_fingerprint=5), "source_fingerprint"),
    "format_version true": (lambda d: d.update(format_version=True), "format_version"),
}


@pytest.mark.parametrize("case", MLA_MANIFEST_EDITS)
def test_an_mla_manifest_field_of_the_wrong_type_is_refused_naming_the_file_and_the_field(converted, tmp_path, case):
    out = _copy(converted["bf16"], tmp_path)
    edit, field = MLA_MANIFEST_EDITS[case]
    path = out / MLA_MANIFEST
    doc = json.loads(path.read_text())
    doc = edit(doc) or doc
    path.write_text(json.dumps(doc))
    with pytest.raises(ArtifactError) as e:
        read_manifest(out / "mla")
    line = str(e.value)
    assert line.startswith(f"{path}: ") and field in line and "\n" not in line, line
    code, lines = _cli("verify", out)
    assert code == 1 and any(MLA_MANIFEST in ln and field in ln for ln in lines), lines


# ---- the served model's config, as the plugin reads it --------------------------------------------


CONFIG_EDITS = {
    "a list": (lambda c: [c], "a JSON object"),
    "heads a string": (lambda c: c.update(num_attention_heads="8"), "num_attention_heads"),
    "heads a bool": (lambda c: c.update(num_attention_heads=True), "num_attention_heads"),
    "heads null": (lambda c: c.update(num_attention_heads=None), "num_attention_heads"),
    "kv_lora_rank a float": (lambda c: c.update(kv_lora_rank=512.0), "kv_lora_rank"),
    "layers a list": (lambda c: c.update(num_hidden_layers=[3]), "num_hidden_layers"),
    "layers negative": (lambda c: c.update(num_hidden_layers=-3), "num_hidden_layers"),
    "nope flags a string": (lambda c: c.update(nope_layer_flags="yes"), "nope_layer_flags"),
    "kv sources an object": (lambda c: c.update(kv_source_layers={"a": 1}), "kv_source_layers"),
}


@pytest.mark.parametrize("case", CONFIG_EDITS)
def test_a_served_config_of_the_wrong_type_is_refused_by_the_plugin_naming_the_file(converted, tmp_path, case):
    out = _copy(converted["bf16"], tmp_path)
    edit, field = CONFIG_EDITS[case]
    path = out / "config.json"
    doc = json.loads(path.read_text())
    doc = edit(doc) or doc
    path.write_text(json.dumps(doc))
    with pytest.raises(ArtifactError) as e:
        open_artifacts(out / "mla", model_dir=out)
    line = str(e.value)
    assert line.startswith(f"{path}: ") and field in line and "\n" not in line, line


def test_a_non_utf8_served_config_is_refused_by_the_plugin_naming_it(converted, tmp_path):
    out = _copy(converted["bf16"], tmp_path)
    _put_byte(out / "config.json", 5, 0xFE)
    with pytest.raises(ArtifactError, match=rf"^{out / 'config.json'}: .*UTF-8"):
        open_artifacts(out / "mla", model_dir=out)


@pytest.mark.parametrize(
    "edit",
    [lambda m: [m], lambda m: m.update(status=["complete"]), lambda m: m.update(source_fingerprint=5)],
    ids=["a list", "status a list", "fingerprint a number"],
)
def test_a_conversion_manifest_of_the_wrong_type_is_refused_by_the_plugin_naming_it(converted, tmp_path, edit):
    out = _copy(converted["bf16"], tmp_path)
    path = out / "mla-convert-manifest.json"
    doc = json.loads(path.read_text())
    doc = edit(doc) or doc
    path.write_text(json.dumps(doc))
    with pytest.raises(ArtifactError, match=rf"^{path}: "):
        open_artifacts(out / "mla", model_dir=out)


def test_a_non_utf8_conversion_manifest_is_refused_by_the_plugin_naming_it(converted, tmp_path):
    out = _copy(converted["bf16"], tmp_path)
    _put_byte(out / "mla-convert-manifest.json", 3, 0xC3)
    with pytest.raises(ArtifactError, match=rf"^{out / 'mla-convert-manifest.json'}: "):
        open_artifacts(out / "mla", model_dir=out)


_ = edit_json  # used by the mutation tests below
