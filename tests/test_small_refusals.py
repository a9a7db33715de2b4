"""Small refusals, through the real CLI: a refused demo leaves nothing
behind; `--kernels native` where the native kernels cannot run is refused (exit 2), while `auto`
falls back to eager; a mistyped option suggests the close match only; `card` on a missing
directory says there is no such directory."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mla_convert.cli.app import app

runner = CliRunner()


def _one_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


# ---- a refused demo leaves nothing ----------------------------------------------------------------


def test_a_demo_refused_for_its_options_writes_nothing(tmp_path, run_cli):
    """`demo --format bf16 --target gaudi2` left a 9 MB mla-convert-demo-* folder in the temporary
    directory each time, without saying where; with --out, the tiny source in --out."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    r = run_cli("demo", "--format", "bf16", "--target", "gaudi2", env={"TMPDIR": str(tmp)})
    assert r.returncode == 2 and "--target gaudi2" in _one_line(r.stderr)
    assert sorted(p.name for p in tmp.iterdir()) == []
    r = run_cli("demo", "--out", tmp_path / "d", "--format", "bf16", "--target", "gaudi2")
    assert r.returncode == 2 and not (tmp_path / "d").exists()


def _failing_compiler(tmp_path: Path) -> dict:
    """An environment whose C compiler (CC) fails every build, with a kernel cache of its own (no
    library built earlier), the native kernels asked for by MLA_CONVERT_KERNELS unset."""
    cc = tmp_path / "broken-cc"
    cc.write_text("#!/bin/sh\necho 'broken-cc: cannot compile' >&2\nexit 1\n")
    cc.chmod(cc.stat().st_mode | stat.S_IXUSR)
    return {"CC": str(cc), "MLA_CONVERT_CACHE": str(tmp_path / "cache"), "TMPDIR": str(tmp_path / "tmp")}


def test_a_demo_refused_after_its_source_was_written_removes_its_temporary_directory(tmp_path, run_cli):
    env = _failing_compiler(tmp_path) | {"MLA_CONVERT_KERNELS": "native"}
    (tmp_path / "tmp").mkdir()
    r = run_cli("demo", env=env)
    assert r.returncode == 2, r.stderr
    assert "native" in _one_line(r.stderr)
    assert sorted(p.name for p in (tmp_path / "tmp").iterdir()) == []


# ---- --kernels native is a request ----------------------------------------------------------------


def test_kernels_native_without_a_working_compiler_is_refused_and_auto_falls_back(tiny_src, tmp_path, run_cli):
    """It ran eager and exited 0: the user asked for the native kernels and did not get them."""
    env = _failing_compiler(tmp_path)
    (tmp_path / "tmp").mkdir()
    out = tmp_path / "out"
    r = run_cli("convert", tiny_src, "--out", out, "--kernels", "native", env=env, unset=("MLA_CONVERT_KERNELS",))
    assert r.returncode == 2, r.stderr
    line = _one_line(r.stderr)
    assert line.startswith("error: --kernels native: ") and "broken-cc" in line and "--kernels auto" in line, line
    assert not out.exists()
    r = run_cli("convert", tiny_src, "--out", out, "--kernels", "native", "--dry-run", env=env,
                unset=("MLA_CONVERT_KERNELS",))  # fmt: skip
    assert r.returncode == 2 and _one_line(r.stderr) == line and not out.exists()
    r = run_cli("convert", tiny_src, "--out", out, "--json", env=env, unset=("MLA_CONVERT_KERNELS",))  # auto
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["kernels"] == "eager" and "broken-cc" in summary["kernels_reason"]


# ---- a mistyped option suggests the close match ---------------------------------------------------


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["convert", "x", "--fromat", "bf16"], "--format"),
        (["demo", "--fromat", "bf16"], "--format"),
        (["convert", "x", "--ou", "y"], "--out"),
        (["verify", "x", "--sourc", "y"], "--source"),
    ],
)
def test_a_mistyped_option_suggests_the_close_match_only(args, said):
    """`--fromat` suggested '--format, --out'."""
    res = runner.invoke(app, args)
    assert res.exit_code == 2
    line = _one_line(res.stderr)
    typed = next(a for a in args if a.startswith("--"))
    assert line == f"error: No such option: {typed} (Possible options: {said}) (see mla-convert {args[0]} --help)"


def test_an_option_nothing_is_close_to_suggests_nothing():
    res = runner.invoke(app, ["convert", "x", "--zzzzzzzz"])
    assert res.exit_code == 2
    assert _one_line(res.stderr) == "error: No such option: --zzzzzzzz (see mla-convert convert --help)"


# ---- card on a missing directory ------------------------------------------------------------------


def test_card_on_a_missing_directory_says_no_such_directory(tmp_path):
    missing = tmp_path / "nope"
    res = runner.invoke(app, ["card", str(missing)])
    assert res.exit_code == 2
    assert _one_line(res.stderr) == f"error: {missing}: no such directory"
    assert not missing.exists()
    (tmp_path / "file").write_text("x")
    res = runner.invoke(app, ["card", str(tmp_path / "file")])
    assert res.exit_code == 2 and _one_line(res.stderr) == f"error: {tmp_path / 'file'}: not a directory"
