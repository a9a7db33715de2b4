"""The native kernels' cache without a writable HOME (a service account): one well-known
directory per user under the temporary directory, reused by the next run, and no temporary build
directory left behind (before: a new /tmp/mla-convert-native-XXXX per run, never removed)."""

import json
import os
import tempfile
from pathlib import Path

import pytest

from mla_convert import envs
from mla_convert.kernels import native, native_build


@pytest.fixture
def no_home_cache(tmp_path, monkeypatch):
    """HOME under a regular file (no directory can be made there, even as root); TMPDIR private."""
    (tmp_path / "a-file").write_text("")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {"HOME": str(tmp_path / "a-file" / "home"), "TMPDIR": str(tmp), "MLA_CONVERT_KERNELS": "native"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    for k in ("MLA_CONVERT_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(k, raising=False)
    # tempfile caches the directory it first finds; without this, later tests in this process
    # (torch.compile's) would go on using this test's TMPDIR after it is removed
    monkeypatch.setattr(tempfile, "tempdir", None)
    return tmp


def everything_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.slow
def test_without_a_writable_home_the_kernels_are_cached_in_one_well_known_directory(
    no_home_cache, tiny_src, tmp_path, run_cli
):
    uid = os.getuid()
    stamps = []
    for i in range(2):
        r = run_cli("convert", tiny_src, "--out", tmp_path / f"out{i}", "--json")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["kernels"] == "native"
        (lib,) = (no_home_cache / f"mla-convert-{uid}" / "native").glob("fp8_kernels-*.so")
        stamps.append(lib.stat().st_mtime_ns)
        # the build, and the record of its passed check (kernels.verdict), which the second run reuses
        (verdict,) = (no_home_cache / f"mla-convert-{uid}" / "native" / "verdicts").glob("*.json")
        assert everything_under(no_home_cache) == [f"mla-convert-{uid}", f"mla-convert-{uid}/native",
                                                   f"mla-convert-{uid}/native/{lib.name}",
                                                   f"mla-convert-{uid}/native/verdicts",
                                                   f"mla-convert-{uid}/native/verdicts/{verdict.name}"]  # fmt: skip
    assert stamps[0] == stamps[1]  # the second run loaded the first one's build


def test_a_fallback_directory_someone_else_can_write_into_is_not_used(no_home_cache, monkeypatch):
    """A library loaded from a directory another user can write into would run their code."""
    monkeypatch.setattr(native_build, "compiler", lambda: "cc")
    shared = envs.native_cache_fallback().parent
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with pytest.raises(native.NativeUnavailable, match="no writable cache directory") as e:
        native.build()
    assert "is not this user's own directory" in str(e.value)
    assert not list(shared.rglob("*.so"))
