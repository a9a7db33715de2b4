"""mla_convert.source.checkpoint: a source checkpoint read and checked from its headers alone,
every refusal one line that names the file and the tensor; paths kept inside the checkpoint;
the side files carried over; a fingerprint of the headers, not of the data."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from mla_convert.demo.synthetic import CheckpointSpec
from mla_convert.errors import SourceError
from mla_convert.source.checkpoint import checked_member, open_source
from support.checkpoints import SHARD1, SHARD2
from support.edits import INDEX, drop_tensor, edit_header, edit_json, rewrite_shard, shard_of

KV_A = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"  # 576 x 256: a partial 128-block of rows
SPEC = CheckpointSpec()  # what the tiny checkpoint (the tiny_src fixture) is written from


def refusal(root: Path) -> str:
    """The SourceError open_source raises for `root`, checked to be a single line."""
    with pytest.raises(SourceError) as e:
        open_source(root)
    message = str(e.value)
    assert "\n" not in message and message.strip() == message
    return message


# ---- what is read -------------------------------------------------------------------------------


def test_the_tiny_checkpoint_is_read_as_written(tiny_src, load_json):
    src = open_source(tiny_src)
    index = load_json(tiny_src / INDEX)["weight_map"]
    assert src.weight_map == index
    assert set(src.headers) == set(index.values())
    assert src.block == tuple(SPEC.block)
    fp8 = {name for name, kind, _ in SPEC.tensors() if kind == "fp8"}
    assert set(src.block_fp8) == fp8
    for name, pair in src.block_fp8.items():
        assert pair.scale.name == name + "_scale_inv" and pair.scale_file == index[name + "_scale_inv"]
    assert src.total_bytes() == sum(p.stat().st_size for p in tiny_src.glob("*.safetensors"))
    split = src.block_fp8[SPEC.split_scale_of]  # the weight whose scale the synthetic writer put in the next shard
    assert split.scale_file != src.weight_map[SPEC.split_scale_of]
    assert split.scale.name in src.headers[split.scale_file].tensors


def test_a_single_file_checkpoint_without_an_index(tiny_src, tmp_path, load_all):
    """model.safetensors alone: every tensor is mapped to it."""
    root = Path(shutil.copytree(tiny_src, tmp_path / "src", ignore=shutil.ignore_patterns("*.safetensors*")))
    tensors = load_all(tiny_src)
    save_file(tensors, str(root / "model.safetensors"))
    src = open_source(root)
    assert src.index_bytes == b"" and set(src.weight_map) == set(tensors)
    assert set(src.weight_map.values()) == {"model.safetensors"}
    assert set(src.block_fp8) == set(open_source(tiny_src).block_fp8)


# ---- refusals: one line, the file and the tensor named --------------------------------------------


def test_not_a_directory(tmp_path):
    (tmp_path / "file").write_text("x")
    assert "not a directory" in refusal(tmp_path / "file")
    assert str(tmp_path / "missing") in refusal(tmp_path / "missing")


@pytest.mark.parametrize(("text", "expect"), [("{not json", "not valid JSON"), ("[1, 2]", "must be a JSON object")])
def test_a_config_that_is_not_a_json_object(src_copy, text, expect):
    (src_copy / "config.json").write_text(text)
    message = refusal(src_copy)
    assert str(src_copy / "config.json") in message and expect in message


def test_a_directory_without_a_config_is_not_a_checkpoint_said_once(src_copy, tmp_path):
    """The directory named once (it read `DIR/config.json: config.json not found`), saying what a
    checkpoint directory holds; the same for an empty directory."""
    (src_copy / "config.json").unlink()
    (tmp_path / "empty").mkdir()
    for root in (src_copy, tmp_path / "empty"):
        message = refusal(root)
        assert message == f"{root}: not a checkpoint directory: no config.json (nor a member's own layout, such as " \
            "params.json with consolidated shards)", message  # fmt: skip


def test_no_index_and_no_single_file(src_copy):
    (src_copy / INDEX).unlink()
    assert "not a safetensors checkpoint" in refusal(src_copy)


@pytest.mark.parametrize("index", [{"metadata": {}}, {"weight_map": {}}, {"weight_map": {"a": 3}}])
def test_index_without_a_usable_weight_map(src_copy, index):
    (src_copy / INDEX).write_text(json.dumps(index))
    assert str(src_copy / INDEX) in refusal(src_copy)


def test_index_lists_a_tensor_its_shard_does_not_hold(src_copy):
    shard = shard_of(src_copy, KV_A)
    drop_tensor(src_copy, KV_A, from_index=False)
    message = refusal(src_copy)
    assert str(shard) in message and repr(KV_A) in message and "listed in the index" in message


def test_shard_holds_a_tensor_the_index_does_not_list(src_copy):
    shard = shard_of(src_copy, "model.norm.weight")
    edit_json(src_copy / INDEX, lambda i: i["weight_map"].pop("model.norm.weight"))
    message = refusal(src_copy)
    assert str(shard) in message and "'model.norm.weight'" in message and "not in the index" in message


def test_index_names_a_shard_that_is_not_there(src_copy):
    (src_copy / SHARD2).unlink()
    message = refusal(src_copy)
    assert str(src_copy / SHARD2) in message and "does not exist" in message


@pytest.mark.parametrize("dropped", ["scale", "weight"])
def test_a_block_fp8_weight_and_its_scale_come_in_pairs(src_copy, dropped):
    weight_shard = shard_of(src_copy, KV_A)
    drop_tensor(src_copy, KV_A + "_scale_inv" if dropped == "scale" else KV_A)
    message = refusal(src_copy)
    assert repr(KV_A) in message and "_scale_inv" in message
    if dropped == "scale":
        assert str(weight_shard) in message and "cannot dequantize it" in message
    else:
        assert repr(KV_A + "_scale_inv") in message and "has no weight" in message


def test_scale_grid_that_does_not_fit_the_weight(src_copy):
    rows, cols = SPEC.kv_lora_rank + SPEC.qk_rope_head_dim, SPEC.hidden_size
    grid = [math.ceil(rows / SPEC.block[0]), math.ceil(cols / SPEC.block[1])]
    wrong = (grid[0] - 1, grid[1])
    name = KV_A + "_scale_inv"
    rewrite_shard(shard_of(src_copy, name), lambda t: t.__setitem__(name, torch.ones(wrong)))
    message = refusal(src_copy)
    assert repr(name) in message and str(list(wrong)) in message and f"needs {grid}" in message


def test_scale_of_an_unsupported_dtype(src_copy):
    name = KV_A + "_scale_inv"
    rewrite_shard(shard_of(src_copy, name), lambda t: t.__setitem__(name, t[name].to(torch.bfloat16)))
    message = refusal(src_copy)
    assert repr(name) in message and "BF16" in message


def test_block_scales_in_a_checkpoint_whose_config_says_bf16(src_copy):
    edit_json(src_copy / "config.json", lambda c: c.pop("quantization_config"))
    message = refusal(src_copy)
    assert "_scale_inv" in message and "quantization_config" in message


def test_converted_checkpoint_is_named_as_such(converted):
    """A channel-FP8 output given as a source: refused, with a hint of what it is."""
    message = refusal(converted["channel-fp8"])
    assert "compressed-tensors" in message and "converted checkpoint" in message


# ---- paths stay inside the checkpoint ------------------------------------------------------------


@pytest.mark.parametrize("rel", ["../x.safetensors", "a/../../x.safetensors", "/etc/passwd", "", "a\0b"])
def test_checked_member_refuses_a_path_that_is_not_inside(tmp_path, rel):
    with pytest.raises(SourceError, match="must be a relative path inside the checkpoint"):
        checked_member(tmp_path, rel, "shard")


def test_checked_member_refuses_a_symlink_that_leads_outside(tmp_path):
    root = tmp_path / "src"
    root.mkdir()
    (tmp_path / "secret").write_text("x")
    (root / "link.safetensors").symlink_to(tmp_path / "secret")
    (root / "sub").symlink_to(tmp_path, target_is_directory=True)
    for rel in ("link.safetensors", "sub/secret"):
        with pytest.raises(SourceError, match="leads outside the checkpoint") as e:
            checked_member(root, rel, "shard")
        assert str(tmp_path / "secret") in str(e.value)


def test_checked_member_accepts_files_and_links_inside(tmp_path):
    root = tmp_path / "src"
    (root / "d").mkdir(parents=True)
    (root / "d" / "a.safetensors").write_text("x")
    (root / "b.safetensors").symlink_to(root / "d" / "a.safetensors")
    assert checked_member(root, "d/a.safetensors", "shard") == root / "d" / "a.safetensors"
    assert checked_member(root, "b.safetensors", "shard") == root / "b.safetensors"
    assert checked_member(root, "not-yet-there.safetensors", "shard") == root / "not-yet-there.safetensors"


def test_a_hub_cache_snapshot_may_link_to_its_blobs_only(tmp_path):
    """huggingface_hub's cache: snapshots/<commit>/FILE -> ../../blobs/<hash>."""
    repo = tmp_path / "models--org--name"
    snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    (blobs / "0f0f").write_text("x")
    (snapshot / "model.safetensors").symlink_to(Path("../../blobs/0f0f"))
    (repo / "elsewhere").write_text("x")
    (snapshot / "other.safetensors").symlink_to(Path("../../elsewhere"))
    assert checked_member(snapshot, "model.safetensors", "shard") == snapshot / "model.safetensors"
    with pytest.raises(SourceError, match="leads outside the checkpoint"):
        checked_member(snapshot, "other.safetensors", "shard")


def test_an_index_entry_through_a_symlinked_folder_is_refused(src_copy, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(src_copy / SHARD1, outside / SHARD1)
    (src_copy / "elsewhere").symlink_to(outside, target_is_directory=True)
    moved = {n: f"elsewhere/{SHARD1}" for n, f in open_source(src_copy).weight_map.items() if f == SHARD1}
    edit_json(src_copy / INDEX, lambda i: i["weight_map"].update(moved))
    os.unlink(src_copy / SHARD1)
    message = refusal(src_copy)
    assert "leads outside the checkpoint" in message and str(outside / SHARD1) in message


# ---- side files ------------------------------------------------------------------------------------


def test_side_files_are_everything_else_nested_ones_too(tiny_src):
    src = open_source(tiny_src)
    on_disk = {
        str(p.relative_to(tiny_src))
        for p in tiny_src.rglob("*")
        if p.is_file() and p.suffix != ".safetensors" and p.name not in ("config.json", INDEX)
    }
    assert set(src.side_files) == on_disk
    assert "figures/notes.txt" in src.side_files and "tokenizer.json" in src.side_files


def test_side_files_leave_out_hidden_files_and_stray_safetensors(src_copy):
    (src_copy / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    (src_copy / ".cache").mkdir()
    (src_copy / ".cache" / "state").write_text("x")
    (src_copy / "figures" / ".DS_Store").write_text("x")
    (src_copy / "consolidated.safetensors").write_bytes(b"")
    (src_copy / "docs" / "mla").mkdir(parents=True)
    (src_copy / "docs" / "mla" / "notes.md").write_text("a nested mla/ folder is not the MLA artifacts\n")
    side = set(open_source(src_copy).side_files)
    assert not {".gitattributes", ".cache/state", "figures/.DS_Store", "consolidated.safetensors"} & side
    assert "docs/mla/notes.md" in side


def test_a_converted_source_keeps_neither_its_mla_artifacts_nor_its_manifest(converted):
    """A bf16 output converted again: its mla/ folder and conversion manifest are not side files
    (the new output gets its own)."""
    out = converted["bf16"]
    assert (out / "mla").is_dir() and (out / "mla-convert-manifest.json").is_file()
    side = open_source(out).side_files
    assert side and not [f for f in side if f.startswith("mla/") or f == "mla-convert-manifest.json"]


# ---- the fingerprint -------------------------------------------------------------------------------


def test_fingerprint_changes_with_a_header_but_not_with_the_data(tiny_src, src_copy):
    before = open_source(tiny_src).fingerprint()
    shard = src_copy / SHARD1
    header = open_source(src_copy).headers[SHARD1]
    data = bytearray(shard.read_bytes())
    for i in range(header.data_start, len(data), 4099):  # bytes all over the data section, size unchanged
        data[i] ^= 0x5A
    shard.write_bytes(bytes(data))
    assert open_source(src_copy).fingerprint() == before

    a, b = "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight"
    assert header.tensors[a].shape == header.tensors[b].shape and header.tensors[a].dtype == header.tensors[b].dtype

    def swap(h):
        h[a]["data_offsets"], h[b]["data_offsets"] = h[b]["data_offsets"], h[a]["data_offsets"]

    size = shard.stat().st_size
    edit_header(shard, swap)  # the two norms trade places: same names, dtypes, shapes and file size
    assert shard.stat().st_size == size
    swapped = open_source(src_copy).fingerprint()
    assert swapped != before

    edit_header(shard, lambda h: h["__metadata__"].update(note="edited"))
    assert open_source(src_copy).fingerprint() not in (before, swapped)


def test_fingerprint_changes_with_the_config_and_the_index_not_with_the_place(tiny_src, src_copy):
    before = open_source(tiny_src).fingerprint()
    assert open_source(src_copy).fingerprint() == before  # a copy elsewhere: the same source
    edit_json(src_copy / "config.json", lambda c: c.update(rms_norm_eps=1e-5))
    after_config = open_source(src_copy).fingerprint()
    edit_json(src_copy / INDEX, lambda i: i.update(metadata={"total_size": 1}))
    assert len({before, after_config, open_source(src_copy).fingerprint()}) == 3
