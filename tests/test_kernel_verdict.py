"""The native kernels' check, remembered per machine (kernels.verdict): a conversion after a passed
check runs them without importing torch; a change to anything the outcome depends on checks again,
and a check that fails is forgotten."""

import json
import re
import shutil

import pytest
import torch

from mla_convert.kernels import fastest as kernels_mod
from mla_convert.kernels import modes, native, verdict
from mla_convert.kernels.fastest import select_kernels
from mla_convert.kernels.transforms import block_fp8_to_channel_fp8

BLOCK, OPS = (128, 128), ("fp8",)
TORCH_IMPORTED = re.compile(r"\|\s+torch$", re.MULTILINE)  # PYTHONPROFILEIMPORTTIME's line for torch


@pytest.fixture
def cache(monkeypatch, tmp_path):
    """A private native cache holding the library already built for this host (no rebuild), no
    verdicts, and nothing of either remembered in this process."""
    built = native.build()
    private = tmp_path / "native-cache"
    private.mkdir()
    shutil.copy2(built, private / built.name)
    monkeypatch.setenv("MLA_CONVERT_CACHE", str(private))
    native.reset()
    verdict.forget()
    kernels_mod.forget()
    yield private
    native.reset()  # the next test loads the library of the default cache again
    verdict.forget()
    kernels_mod.forget()


def _records(cache) -> list:
    return sorted((cache / "verdicts").glob("*.json")) if (cache / "verdicts").exists() else []


def test_a_passed_check_is_remembered_for_its_parameters_and_a_failed_one_forgotten(cache, monkeypatch):
    assert modes.cached_native(BLOCK, 448.0, True, OPS) is None
    assert select_kernels(BLOCK, 448.0, "cpu", ("native", "eager"), OPS).name == "native"
    found = modes.cached_native(BLOCK, 448.0, True, OPS)
    assert found is not None and f"torch {torch.__version__}" in found.reason
    assert len(_records(cache)) == 1
    # another FP8 range, zero rule or set of ops was not checked
    assert modes.cached_native(BLOCK, 240.0, True, OPS) is None
    assert modes.cached_native(BLOCK, 448.0, False, OPS) is None
    assert modes.cached_native(BLOCK, 448.0, True, ("fp8", "quant")) is None

    real = block_fp8_to_channel_fp8.to_channel_fp8

    def off_by_one_bit(w, s, block, fp8_max, *signed_zero):
        q, sc = real(w, s, block, fp8_max, *signed_zero)
        q.view(torch.uint8)[0, 0] ^= 1
        return q, sc

    monkeypatch.setattr(block_fp8_to_channel_fp8, "to_channel_fp8", off_by_one_bit)
    kernels_mod.forget()
    k = select_kernels(BLOCK, 448.0, "cpu", ("native", "eager"), OPS)
    assert k.name == "eager" and "differed from eager" in k.reason
    assert modes.cached_native(BLOCK, 448.0, True, OPS) is None and _records(cache) == []


def test_the_record_is_keyed_by_torchs_version_and_the_librarys_bytes(cache, monkeypatch):
    assert select_kernels(BLOCK, 448.0, "cpu", ("native", "eager"), OPS).name == "native"
    assert modes.cached_native(BLOCK, 448.0, True, OPS) is not None
    with monkeypatch.context() as m:
        m.setattr(verdict, "torch_version_file", lambda: b"__version__ = '0.0.0'\n")
        assert modes.cached_native(BLOCK, 448.0, True, OPS) is None
    assert modes.cached_native(BLOCK, 448.0, True, OPS) is not None

    lib = native.library_path()
    other = lib.with_name("fp8_kernels-other.so")
    other.write_bytes(lib.read_bytes() + b"\0")  # another build: one byte more
    verdict.forget()
    with monkeypatch.context() as m:
        m.setattr(native, "library_path", lambda: other)
        assert modes.cached_native(BLOCK, 448.0, True, OPS) is None
    verdict.forget()
    assert modes.cached_native(BLOCK, 448.0, True, OPS) is not None


def test_a_damaged_record_means_checking_again(cache):
    assert select_kernels(BLOCK, 448.0, "cpu", ("native", "eager"), OPS).name == "native"
    (record,) = _records(cache)
    body = json.loads(record.read_text())
    for damaged in ("{", "[]", json.dumps({**body, "passed": False}), json.dumps({**body, "key": "0" * 32})):
        record.write_text(damaged)
        assert modes.cached_native(BLOCK, 448.0, True, OPS) is None, damaged


@pytest.mark.slow
def test_a_conversion_after_a_passed_check_imports_no_torch_and_writes_the_same_bytes(
    cache, tiny_src, tmp_path, run_cli, tree_hashes
):
    """The first conversion checks the native kernels with torch; the second, in a fresh process,
    finds the record, never imports torch, and writes the same files."""
    env = {"MLA_CONVERT_CACHE": str(cache), "PYTHONPROFILEIMPORTTIME": "1"}
    runs = []
    for name in ("first", "second"):
        out = tmp_path / name
        proc = run_cli("convert", tiny_src, "--out", out, "--kernels", "native", "--json", env=env,
                       unset=("MLA_CONVERT_KERNELS",))  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
        runs.append((json.loads(proc.stdout), bool(TORCH_IMPORTED.search(proc.stderr)), out))
    (first, first_torch, first_out), (second, second_torch, second_out) = runs
    assert first["kernels"] == second["kernels"] == "native"
    assert first_torch and not second_torch
    assert "on this machine" in second["kernels_reason"] and "on this machine" not in first["kernels_reason"]
    assert len(_records(cache)) == 1

    def data_files(root):
        return {k: v for k, v in tree_hashes(root).items() if k.endswith(".safetensors")}

    assert data_files(first_out) and data_files(first_out) == data_files(second_out)
