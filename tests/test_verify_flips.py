"""verify catches a single flipped byte in any file of an output: a shard (its header and its data),
an MLA artifact, the MLA manifest, the model card, a side file (tokenizer files,
generation_config.json), the index and the config; at the first byte, the middle and the last. The
conversion manifest is the record the others are checked against, not itself hashed, so it is not
among them. Also: the checks that run on the bytes read (verification.native_pass) import no torch,
and agree with the torch path on what a corruption of each kind of tensor fails."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mla_convert.constants import MANIFEST_NAME
from mla_convert.errors import VerificationError
from mla_convert.verification import readers as readers_mod
from mla_convert.verification import verify
from support.edits import fix_hash, tensor_spans

FP8, BF16 = "channel-fp8", "bf16"
ROOT = Path(__file__).resolve().parent.parent


def _files(root: Path) -> list[str]:
    out = []
    for dirpath, _, names in os.walk(root):
        out += [os.path.relpath(os.path.join(dirpath, n), root) for n in names if not n.startswith(".")]
    return sorted(rel for rel in out if rel != MANIFEST_NAME)


def _exit_code(path: Path, source=None) -> int:
    try:
        return verify(path, source=source).exit_code
    except VerificationError:  # could not run: also a failure to verify
        return 2


@pytest.fixture(autouse=True)
def _native_readers():
    """These tests run the native pass (the default where the library builds), and leave the
    choice as they found it."""
    readers_mod.reset()
    yield
    readers_mod.reset()


@pytest.mark.parametrize("fmt", [FP8, pytest.param(BF16, marks=pytest.mark.slow)])
def test_a_flipped_byte_in_any_file_fails_verify(converted, tmp_path, fmt):
    out = Path(shutil.copytree(converted[fmt], tmp_path / "out"))
    assert _exit_code(out) == 0 and readers_mod.reader_backend().name == "native"
    files = _files(out)
    kinds = {"safetensors", "json", "md"}
    assert {rel.rsplit(".", 1)[-1] for rel in files} >= kinds
    assert {"config.json", "model.safetensors.index.json", "generation_config.json", "README.md"} <= set(files)
    assert any(rel.startswith("mla/layer-") for rel in files) and "mla/manifest.json" in files
    missed = []
    for rel in files:
        path = out / rel
        data = path.read_bytes()
        for at in sorted({0, len(data) // 2, len(data) - 1}):
            flipped = bytearray(data)
            flipped[at] ^= 0x01
            path.write_bytes(flipped)
            try:
                if _exit_code(out) == 0:
                    missed.append((rel, at))
            finally:
                path.write_bytes(data)
    assert not missed, f"flips verify did not catch: {missed}"
    assert _exit_code(out) == 0


def _report_of(path: Path, source, readers) -> tuple[int, set]:
    readers_mod.use(readers) if readers is not None else readers_mod.reset()
    report = verify(path, source=source)
    return report.exit_code, {(g, f.check) for g, grp in report.groups.items() for f in grp.failures}


def test_native_and_torch_paths_catch_the_same_flip_in_each_kind_of_tensor(converted, tiny_src, tmp_path):
    """A byte of one tensor of each dtype and role changed with the hashes made to agree: the
    native pass and torch's readers both fail verify --source, with the same failures."""
    out = Path(shutil.copytree(converted[FP8], tmp_path / "out"))
    seen, cases = set(), []
    for rel in _files(out):
        if not rel.endswith(".safetensors"):
            continue
        for name, (begin, end, dtype) in tensor_spans(out / rel).items():
            kind = (dtype, name.rsplit(".", 1)[-1], rel.startswith("mla/"))
            size = {"F8_E4M3": 1, "BF16": 2, "F16": 2, "F32": 4}.get(dtype)
            if kind not in seen and size:
                seen.add(kind)
                middle = begin + (end - begin) // size // 2 * size
                cases.append((rel, name, middle + size - 1))  # the byte with the element's exponent
    assert len(cases) >= 5
    for rel, name, at in cases:
        path = out / rel
        data = path.read_bytes()
        flipped = bytearray(data)
        flipped[at] ^= 0x40  # an exponent bit: the element off by orders of magnitude
        path.write_bytes(flipped)
        manifest = (out / MANIFEST_NAME).read_text()
        mla_manifest = (out / "mla/manifest.json").read_text()
        fix_hash(out, rel)
        try:
            native = _report_of(out, tiny_src, None)
            torch_path = _report_of(out, tiny_src, readers_mod.TORCH_BACKEND)
        finally:
            path.write_bytes(data)
            (out / MANIFEST_NAME).write_text(manifest)
            (out / "mla/manifest.json").write_text(mla_manifest)
        assert native[0] == 1 and native == torch_path, (rel, name, native, torch_path)


def test_verify_whose_readers_were_checked_imports_no_torch(converted, tiny_src):
    """Once the native readers' probes passed on this machine, verify (with --source too) runs
    without importing torch: every check of a clean output passes natively."""
    assert verify(converted[FP8]).exit_code == 0  # probed here if need be, the pass remembered
    code = (
        "import sys; from mla_convert.verification import verify; "
        f"r = verify({str(converted[FP8])!r}, source={str(tiny_src)!r}); "
        "print(r.exit_code, r.readers, 'torch' in sys.modules)"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["0", "native", "False"]
