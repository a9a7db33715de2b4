"""mla_convert.output.manifest: the conversion manifest's bytes (the same for the same content,
its file list sorted), written whole, and read back: strictly for --resume (None when there is
none, an error when it is damaged), leniently for what --out holds (None for either)."""

from __future__ import annotations

import json

import pytest

from mla_convert import __version__
from mla_convert.constants import MANIFEST_NAME
from mla_convert.output.manifest import manifest_bytes, read_manifest, readable_manifest, write_manifest

OPTIONS = {"format": "channel-fp8", "target": "gaudi3", "ignore": [r"re:.*\.experts\."]}
FILES = {
    "model-00002-of-00002.safetensors": {"size": 20, "sha256": "b" * 64},
    "config.json": {"size": 3, "sha256": "c" * 64},
    "mla/layer-001.safetensors": {"size": 10, "sha256": "a" * 64},
}


def test_the_manifest_holds_the_tool_its_version_and_what_was_given():
    doc = json.loads(manifest_bytes("complete", OPTIONS, "f" * 64, FILES))
    assert doc == {
        "tool": "mla-convert", "version": __version__, "status": "complete", "options": OPTIONS,
        "source_fingerprint": "f" * 64, "files": FILES,
    }  # fmt: skip


def test_the_same_content_gives_the_same_bytes_whatever_the_order_given():
    reordered_files = dict(reversed(FILES.items()))
    reordered_options = dict(reversed(OPTIONS.items()))
    a = manifest_bytes("complete", OPTIONS, "f" * 64, FILES)
    b = manifest_bytes("complete", reordered_options, "f" * 64, reordered_files)
    assert a == b and a.endswith(b"}\n")
    text = a.decode()
    positions = [text.index(json.dumps(rel)) for rel in FILES]
    assert [rel for _, rel in sorted(zip(positions, FILES, strict=True))] == sorted(FILES)


def test_a_different_status_or_file_changes_the_bytes():
    base = manifest_bytes("complete", OPTIONS, "f" * 64, FILES)
    assert manifest_bytes("incomplete", OPTIONS, "f" * 64, FILES) != base
    changed = FILES | {"config.json": {"size": 3, "sha256": "d" * 64}}
    assert manifest_bytes("complete", OPTIONS, "f" * 64, changed) != base


def test_written_then_read_back_and_rewritten_whole(tmp_path):
    write_manifest(tmp_path, "incomplete", OPTIONS, "f" * 64, {})
    assert read_manifest(tmp_path)["status"] == "incomplete" and read_manifest(tmp_path)["files"] == {}
    write_manifest(tmp_path, "complete", OPTIONS, "f" * 64, FILES)
    assert (tmp_path / MANIFEST_NAME).read_bytes() == manifest_bytes("complete", OPTIONS, "f" * 64, FILES)
    want = json.loads(manifest_bytes("complete", OPTIONS, "f" * 64, FILES))
    assert read_manifest(tmp_path) == readable_manifest(tmp_path) == want
    assert sorted(p.name for p in tmp_path.iterdir()) == [MANIFEST_NAME]  # no temporary file left


def test_read_manifest_none_without_one(tmp_path):
    assert read_manifest(tmp_path) is None and readable_manifest(tmp_path) is None
    assert read_manifest(tmp_path / "no-such-dir") is None


@pytest.mark.parametrize("content", [b"{", b"", b"\xff\xfe\x00"])
def test_read_manifest_raises_for_a_damaged_one(tmp_path, content):
    (tmp_path / MANIFEST_NAME).write_bytes(content)
    with pytest.raises(ValueError):
        read_manifest(tmp_path)
    assert readable_manifest(tmp_path) is None


def test_read_manifest_raises_for_one_that_cannot_be_read(tmp_path):
    (tmp_path / MANIFEST_NAME).mkdir()
    with pytest.raises(OSError):
        read_manifest(tmp_path)
    assert readable_manifest(tmp_path) is None


@pytest.mark.parametrize("content", ["[]", '"complete"', "3", "null"])
def test_readable_manifest_none_for_json_that_is_not_an_object(tmp_path, content):
    (tmp_path / MANIFEST_NAME).write_text(content)
    assert readable_manifest(tmp_path) is None


def test_readable_manifest_of_a_conversion(converted):
    manifest = readable_manifest(converted["bf16"])
    assert manifest["tool"] == "mla-convert" and manifest["status"] == "complete"
    assert manifest == read_manifest(converted["bf16"])
