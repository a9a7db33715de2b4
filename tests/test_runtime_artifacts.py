"""mla_runtime.artifacts: TP-sliced loads and refusal of corrupted or mismatched artifacts.

Works on a real converter output: the tiny DeepSeek checkpoint with 8 heads, converted to bf16.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from mla_convert.conversion.pipeline import convert
from mla_convert.demo.specs import CheckpointSpec
from mla_convert.demo.synthetic import write_checkpoint
from mla_convert.settings import Options
from mla_runtime import ArtifactError, open_artifacts
from mla_runtime.artifacts import head_range
from mla_runtime.format import MlaDims, w_uk_t_name, w_uv_name
from mla_runtime.layout import split_kv_b_proj
from support.artifacts import read_artifacts

HEADS = 8
LAYERS = [0, 1, 2, 3]  # 3 decoder layers + the MTP layer


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Path:
    """bf16 conversion of an 8-head tiny checkpoint (read-only; copy before changing)."""
    base = tmp_path_factory.mktemp("rt")
    src = write_checkpoint(base / "src", CheckpointSpec(num_attention_heads=HEADS))
    convert(src, base / "out", Options(format="bf16"))
    return base / "out"


@pytest.fixture
def served_copy(served, tmp_path) -> Path:
    return Path(shutil.copytree(served, tmp_path / "out"))


def test_artifacts_are_the_split_of_the_served_bf16_kv_b_proj(served):
    arts = open_artifacts(served / "mla", model_dir=served)
    index = json.loads((served / "model.safetensors.index.json").read_text())["weight_map"]
    for layer in LAYERS:
        name = f"model.layers.{layer}.self_attn.kv_b_proj.weight"
        with safe_open(str(served / index[name]), "pt") as f:
            kv_b = f.get_tensor(name)
        want_uk_t, want_uv = split_kv_b_proj(kv_b, arts.dims)
        got_uk_t, got_uv = arts.load_layer(layer)
        assert torch.equal(got_uk_t, want_uk_t) and torch.equal(got_uv, want_uv)


@pytest.mark.parametrize("tp_size", [1, 2, 4, 8])
def test_tp_slice_equals_slice_of_full_tensors(served, tp_size):
    arts = open_artifacts(served / "mla", model_dir=served)
    dims = arts.dims
    per = HEADS // tp_size
    for layer in LAYERS:
        full_uk_t, full_uv = read_artifacts(served / "mla", layer)
        assert full_uk_t.shape == (HEADS, dims.qk_nope_head_dim, dims.kv_lora_rank)
        parts_uk, parts_uv = [], []
        for rank in range(tp_size):
            uk_t, uv = arts.load_layer(layer, tp_rank=rank, tp_size=tp_size)
            assert uk_t.shape == (per, dims.qk_nope_head_dim, dims.kv_lora_rank)
            assert uv.shape == (per, dims.kv_lora_rank, dims.v_head_dim)
            assert uk_t.is_contiguous() and uv.is_contiguous()
            assert uk_t.dtype == uv.dtype == torch.bfloat16
            # Only this rank's heads were materialized, not the whole tensor.
            assert uk_t.untyped_storage().nbytes() == uk_t.numel() * 2
            assert torch.equal(uk_t, full_uk_t[rank * per : (rank + 1) * per])
            assert torch.equal(uv, full_uv[rank * per : (rank + 1) * per])
            parts_uk.append(uk_t)
            parts_uv.append(uv)
        assert torch.equal(torch.cat(parts_uk), full_uk_t) and torch.equal(torch.cat(parts_uv), full_uv)


def test_load_casts_to_the_requested_dtype(served):
    arts = open_artifacts(served / "mla")
    uk_t, uv = arts.load_layer(2, tp_rank=3, tp_size=4, dtype=torch.float32)
    full_uk_t, full_uv = read_artifacts(served / "mla", 2)
    assert uk_t.dtype == torch.float32 and torch.equal(uk_t, full_uk_t[6:8].float())
    assert torch.equal(uv, full_uv[6:8].float())


@pytest.mark.parametrize("tp_size", [3, 5, 16])
def test_tp_size_not_dividing_heads_is_a_clear_error(served, tp_size):
    arts = open_artifacts(served / "mla")
    with pytest.raises(ArtifactError) as e:
        arts.load_layer(1, tp_rank=0, tp_size=tp_size)
    msg = str(e.value)
    assert f"tensor-parallel size {tp_size} does not divide the {HEADS} attention heads" in msg
    assert "layer 1" in msg and "layer-001.safetensors" in msg


def test_head_range():
    assert head_range(128, 3, 8) == (48, 64)
    with pytest.raises(ArtifactError, match="rank 8 of size 8"):
        head_range(128, 8, 8)


def test_truncated_layer_file_is_refused_naming_layer(served_copy):
    path = served_copy / "mla" / "layer-002.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(ArtifactError) as e:
        open_artifacts(served_copy / "mla", model_dir=served_copy)
    assert "layer 2" in str(e.value) and "layer-002.safetensors" in str(e.value) and "truncated" in str(e.value)


def _flip_and_open(served_copy, verify):
    """Flip one bit inside layer 1's W_UV data: same size, same header."""
    path = served_copy / "mla" / "layer-001.safetensors"
    data = bytearray(path.read_bytes())
    data[-10] ^= 0x40  # inside W_UV's data: same size, same header
    path.write_bytes(bytes(data))
    return open_artifacts(served_copy / "mla", model_dir=served_copy, verify=verify)


def test_bit_flip_is_found_by_sha256_mode_naming_layer(served_copy):
    assert _flip_and_open(served_copy, "size").load_layer(1)  # the default mode cannot see a flipped bit
    arts = open_artifacts(served_copy / "mla", model_dir=served_copy, verify="sha256")
    arts.load_layer(0)  # other layers are fine
    with pytest.raises(ArtifactError) as e:
        arts.load_layer(1, tp_rank=1, tp_size=2)
    assert "layer 1" in str(e.value) and "layer-001.safetensors" in str(e.value) and "sha256" in str(e.value)


def test_sha256_mode_from_environment(served_copy, monkeypatch):
    monkeypatch.setenv("MLA_RUNTIME_VERIFY", "sha256")
    arts = _flip_and_open(served_copy, None)
    with pytest.raises(ArtifactError, match=r"layer 1 .*sha256"):
        arts.load_layer(1)


def _edit_header_in_place(path: Path, edit) -> None:
    """Rewrite a safetensors header, padded to its old length: the file keeps its size."""
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    edit(header)
    raw = json.dumps(header, separators=(",", ":")).encode()
    assert len(raw) <= n
    path.write_bytes(data[:8] + raw.ljust(n) + data[8 + n :])


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda h, uk, uv: h[uv].update(data_offsets=[5, 0]), "bad data_offsets"),
        (lambda h, uk, uv: h[uv].update(data_offsets=h[uk]["data_offsets"]), "overlaps"),
        (lambda h, uk, uv: h[uk].update(dtype="Q9"), "unsupported dtype"),
    ],
)
def test_corrupt_layer_header_is_refused_naming_layer(served_copy, edit, message):
    path = served_copy / "mla" / "layer-002.safetensors"
    _edit_header_in_place(path, lambda h: edit(h, w_uk_t_name(2), w_uv_name(2)))
    arts = open_artifacts(served_copy / "mla", model_dir=served_copy)  # same size: opens
    with pytest.raises(ArtifactError) as e:
        arts.load_layer(2, tp_rank=1, tp_size=2)
    msg = str(e.value)
    assert msg.startswith(f"layer 2 ({path}): not a readable safetensors file (") and message in msg
    assert msg.count(str(path)) == 1, msg  # the path once, not repeated by the parser's message
    arts.load_layer(1)  # the other layers still load


def test_layer_file_holding_another_layer_is_refused(served_copy):
    mla = served_copy / "mla"
    shutil.copyfile(mla / "layer-002.safetensors", mla / "layer-001.safetensors")  # same size
    arts = open_artifacts(mla, model_dir=served_copy)
    with pytest.raises(ArtifactError) as e:
        arts.load_layer(1)
    assert "layer 1" in str(e.value) and "model.layers.1.self_attn.W_UK_T" in str(e.value)


def test_missing_layer_in_manifest_is_refused_naming_layer(served_copy):
    path = served_copy / "mla" / "manifest.json"
    doc = json.loads(path.read_text())
    doc["layers"] = [e for e in doc["layers"] if e["layer"] != 2]
    path.write_text(json.dumps(doc))
    with pytest.raises(ArtifactError) as e:
        open_artifacts(served_copy / "mla", model_dir=served_copy)
    assert "layer 2" in str(e.value) and "layer-002.safetensors" in str(e.value)
    arts = open_artifacts(served_copy / "mla")  # without the served config: refused at load time
    with pytest.raises(ArtifactError, match=r"layer 2: no MLA artifacts .*layer-002\.safetensors"):
        arts.load_layer(2)


def test_missing_layer_file_is_refused_naming_layer(served_copy):
    (served_copy / "mla" / "layer-000.safetensors").unlink()
    with pytest.raises(ArtifactError, match=r"layer 0 \(.*layer-000\.safetensors\): file is missing"):
        open_artifacts(served_copy / "mla")


def test_artifacts_of_another_checkpoint_are_refused(served_copy):
    path = served_copy / "mla-convert-manifest.json"
    doc = json.loads(path.read_text())
    doc["source_fingerprint"] = "0" * 64
    path.write_text(json.dumps(doc))
    with pytest.raises(ArtifactError, match="another checkpoint"):
        open_artifacts(served_copy / "mla", model_dir=served_copy)
    with pytest.raises(ArtifactError, match="another checkpoint"):
        open_artifacts(served_copy / "mla", expected_fingerprint="1" * 64)


def test_dims_differing_from_served_config_are_refused(served):
    config = json.loads((served / "config.json").read_text())
    config["num_attention_heads"] = 16
    with pytest.raises(ArtifactError, match="num_heads: served 16 vs artifacts 8"):
        open_artifacts(served / "mla", model_config=config)
    config = json.loads((served / "config.json").read_text())
    config["kv_lora_rank"] = 256
    with pytest.raises(ArtifactError, match="kv_lora_rank: served 256 vs artifacts 512"):
        open_artifacts(served / "mla", model_config=config)


def test_served_layer_dims_are_checked_per_rank(served):
    arts = open_artifacts(served / "mla")
    arts.check_served_dims(layer=1, num_heads=2, tp_size=4, qk_nope_head_dim=128, v_head_dim=128, kv_lora_rank=512)
    with pytest.raises(ArtifactError) as e:
        arts.check_served_dims(layer=1, num_heads=4, tp_size=4, qk_nope_head_dim=128, v_head_dim=128,
                               kv_lora_rank=512)  # fmt: skip
    assert "layer 1" in str(e.value) and "layer-001.safetensors" in str(e.value) and "2 per rank" in str(e.value)
    with pytest.raises(ArtifactError, match=r"layer 3 .*v_head_dim=64, the artifacts 128"):
        arts.check_served_dims(layer=3, num_heads=8, tp_size=1, qk_nope_head_dim=128, v_head_dim=64, kv_lora_rank=512)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.update(format_version=2), "format_version 2 is not supported"),
        (lambda d: d.update(dtype="float16"), "dtype 'float16'"),
        (lambda d: d.update(format="other"), "format is 'other'"),
        (lambda d: d["layers"][0].update(file="../x.safetensors"), "must be a plain file name"),
    ],
)
def test_malformed_manifest_is_refused(served_copy, edit, message):
    path = served_copy / "mla" / "manifest.json"
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))
    with pytest.raises(ArtifactError, match=message):
        open_artifacts(served_copy / "mla")


def test_no_artifacts_directory(tmp_path):
    with pytest.raises(ArtifactError, match="no such directory"):
        open_artifacts(tmp_path / "nope")
    (tmp_path / "mla").mkdir()
    with pytest.raises(ArtifactError, match="no MLA manifest"):
        open_artifacts(tmp_path / "mla")


def test_runtime_imports_no_cli_or_converter_packages():
    import subprocess
    import sys

    code = (
        "import sys, mla_runtime, mla_runtime.artifacts, mla_runtime.plugin; "
        "mla_runtime.plugin.register(); "
        "bad = [m for m in ('typer', 'rich', 'mla_convert', 'vllm', 'transformers') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stdout + r.stderr


def test_format_modules_import_without_torch():
    """The format and the safetensors reader are usable (and mla_convert's start-up runs) before torch loads."""
    import subprocess
    import sys

    code = (
        "import sys, mla_runtime.format, mla_runtime.safetensors_file; "
        "from mla_runtime import ArtifactError, MlaDims, MlaManifest, read_manifest; "
        "sys.exit('torch' in sys.modules)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert r.returncode == 0, "importing mla_runtime.format or .safetensors_file imported torch" + r.stderr
    code = "import mla_runtime; from mla_runtime import open_artifacts, split_kv_b_proj, head_range, MlaArtifacts"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr  # the torch names still come from the package


def test_dims_type():
    assert MlaDims(8, 128, 128, 512).w_uk_t_shape(2) == (2, 128, 512)


def _resident_bytes(path: Path) -> int:
    """Bytes of `path` in the page cache (mincore on a fresh mapping of the file; Linux)."""
    import ctypes
    import mmap

    size = path.stat().st_size
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    pages = -(-size // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    anchor = ctypes.c_char.from_buffer(mapping)
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), vec)
    del anchor
    mapping.close()
    assert rc == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec) * mmap.PAGESIZE


def _drop_from_page_cache(path: Path) -> None:
    import os

    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _file_mappings(path: Path) -> list[tuple[int, int]]:
    """Address ranges where this process maps `path` (/proc/self/maps)."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith(" " + str(path)):
            lo, hi = line.split()[0].split("-")
            ranges.append((int(lo, 16), int(hi, 16)))
    return ranges


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc (Linux)")
@pytest.mark.parametrize("tp_size", [2, 8])
def test_a_rank_reads_only_its_heads_from_disk(served_copy, tp_size):
    path = served_copy / "mla" / "layer-001.safetensors"
    arts = open_artifacts(served_copy / "mla")
    arts.check_layer(1)  # the header, read now, so that only the tensor reads are measured below
    _drop_from_page_cache(path)
    if _resident_bytes(path) > 8192:
        pytest.skip("this file system keeps the file cached (posix_fadvise DONTNEED had no effect)")
    slice_bytes = 2 * 2 * (HEADS // tp_size) * 128 * 512  # W_UK_T + W_UV rows of this rank, bf16
    w_uk_t, w_uv = arts.load_layer(1, tp_rank=tp_size - 1, tp_size=tp_size)
    resident = _resident_bytes(path)
    # This rank's rows, the header page, and at most the kernel's read-around of a fault on each side.
    assert slice_bytes <= resident <= slice_bytes + 4 * 64 * 1024 + 8192, (resident, slice_bytes, path.stat().st_size)
    full_uk_t, full_uv = read_artifacts(served_copy / "mla", 1)
    per = HEADS // tp_size
    assert torch.equal(w_uk_t, full_uk_t[-per:]) and torch.equal(w_uv, full_uv[-per:])


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc (Linux)")
def test_cpu_bf16_tensors_are_the_file_pages_copy_on_write(served_copy):
    mla = served_copy / "mla"
    path = mla / "layer-002.safetensors"
    before = path.read_bytes()
    w_uk_t, w_uv = open_artifacts(mla).load_layer(2, tp_rank=1, tp_size=2)
    for t in (w_uk_t, w_uv):  # zero-copy: the tensor's memory is a mapping of the layer file
        assert any(lo <= t.data_ptr() < hi for lo, hi in _file_mappings(path)), t.data_ptr()
    expected = w_uk_t.clone()
    w_uk_t.fill_(3.0)  # a write copies the touched pages: the file and a new load are unchanged
    assert path.read_bytes() == before
    again, _ = open_artifacts(mla).load_layer(2, tp_rank=1, tp_size=2)
    assert torch.equal(again, expected)
    path.unlink()  # replaced or deleted afterwards (mla-convert --overwrite): the mapping keeps the old file
    assert torch.equal(again, expected)


def test_another_dtype_is_one_copy_and_unmappable_files_are_read(served_copy, monkeypatch):
    mla = served_copy / "mla"
    full_uk_t, full_uv = read_artifacts(mla, 0)
    w_uk_t, w_uv = open_artifacts(mla).load_layer(0, dtype=torch.float32)
    assert (
        w_uk_t.dtype == torch.float32 and torch.equal(w_uk_t, full_uk_t.float()) and torch.equal(w_uv, full_uv.float())
    )
    if Path("/proc/self/maps").exists():
        assert not any(lo <= w_uk_t.data_ptr() < hi for lo, hi in _file_mappings(mla / "layer-000.safetensors"))

    import mmap

    def cannot_map(*a, **k):
        raise OSError(19, "No such device")  # ENODEV: the file system does not support mmap

    monkeypatch.setattr(mmap, "mmap", cannot_map)
    w_uk_t, w_uv = open_artifacts(mla).load_layer(0, tp_rank=3, tp_size=4)
    assert torch.equal(w_uk_t, full_uk_t[6:]) and torch.equal(w_uv, full_uv[6:])


def test_a_layer_entry_may_record_its_own_dims_and_a_manifest_without_any_keeps_its_bytes():
    from mla_runtime.format import LayerEntry, MlaDims, MlaManifest

    dims = MlaDims(num_heads=4, qk_nope_head_dim=64, v_head_dim=128, kv_lora_rank=512)
    plain = MlaManifest(dims, (LayerEntry(0, "layer-000.safetensors", 10, "ab"),), "fp")
    assert '"dims": {' in plain.to_json() and plain.to_json().count('"dims"') == 1  # only the model's
    nope = MlaManifest(
        dims,
        (
            LayerEntry(0, "layer-000.safetensors", 10, "ab"),
            LayerEntry(1, "layer-001.safetensors", 12, "cd", {"qk_nope_head_dim": 128}),
        ),
        "fp",
    )
    back = MlaManifest.from_json(nope.to_json())
    assert back == nope and back.dims_of(0) == dims and back.dims_of(1).qk_nope_head_dim == 128
    assert MlaManifest.from_json(plain.to_json()).to_json() == plain.to_json()
