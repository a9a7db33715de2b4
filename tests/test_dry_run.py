"""--dry-run runs every check the real run runs before its first byte, --out included, and exits as
the real run would: exit 2 with the same line (before, it printed the plan and exit 0)."""

import shutil

import pytest
from typer.testing import CliRunner

from mla_convert.cli.app import app
from mla_convert.output import out_dir as out_dir_mod

runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def earlier_output(tmp_path, converted):
    return shutil.copytree(converted["bf16"], tmp_path / "out")


def users_directory(tmp_path, converted):
    out = tmp_path / "out"
    (out / "keep").mkdir(parents=True)
    (out / "keep" / "thesis.txt").write_text("mine")
    return out


def unfinished(tmp_path, converted):
    out = shutil.copytree(converted["bf16"], tmp_path / "out")
    manifest = out / "mla-convert-manifest.json"
    manifest.write_text(manifest.read_text().replace('"complete"', '"incomplete"'))
    return out


CASES = {
    "earlier-output": (earlier_output, [], "pass --overwrite to replace it"),
    "users-files": (users_directory, [], "directory is not empty (it holds keep/thesis.txt)"),
    "users-files-overwrite": (users_directory, ["--overwrite"], "keep/thesis.txt"),
    "unfinished": (unfinished, [], "pass --resume to finish it"),
    "resume-other-options": (unfinished, ["--resume"], "cannot resume with different options"),
    "same-as-the-source": (None, [], "--out is the source"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_dry_run_refuses_what_the_real_run_refuses_with_the_same_line(
    tiny_src, converted, tmp_path, case, tree_hashes
):
    make, flags, expect = CASES[case]
    out = tiny_src if make is None else make(tmp_path, converted)
    before = tree_hashes(out)
    real = run("convert", tiny_src, "--out", out, "--quiet", *flags)
    dry = run("convert", tiny_src, "--out", out, "--quiet", "--dry-run", *flags)
    assert real.exit_code == dry.exit_code == 2, (real.stderr, dry.stderr)
    assert dry.stderr == real.stderr and len(dry.stderr.splitlines()) == 1 and expect in dry.stderr, dry.stderr
    assert tree_hashes(out) == before


def test_a_dry_run_refuses_a_disk_too_small_unless_told_to_ignore_it(tiny_src, tmp_path, monkeypatch):
    monkeypatch.setattr(out_dir_mod, "disk_free", lambda path: 5_000_000)
    out = tmp_path / "out"
    real = run("convert", tiny_src, "--out", out, "--quiet")
    dry = run("convert", tiny_src, "--out", out, "--quiet", "--dry-run")
    assert real.exit_code == dry.exit_code == 2 and dry.stderr == real.stderr
    assert "not enough free space" in dry.stderr
    shown = run("convert", tiny_src, "--out", out, "--dry-run", "--ignore-free-space")
    assert shown.exit_code == 0 and "NOT ENOUGH" in shown.stdout  # the plan for a disk not ready yet
    assert not out.exists()


def test_a_dry_run_of_a_resume_changes_nothing(tiny_src, converted, tmp_path, tree_hashes):
    """The real run's --resume removes leftover partial files and re-hashes; its dry run does neither."""
    out = unfinished(tmp_path, converted)
    (out / ".model-00001-of-00004.safetensors.partial").write_bytes(b"half")
    before = tree_hashes(out)
    r = run("convert", tiny_src, "--out", out, "--quiet", "--dry-run", "--resume", "--format", "bf16")
    assert r.exit_code == 0, r.stderr
    assert tree_hashes(out) == before


def test_a_dry_run_refuses_an_unusable_device(tiny_src, tmp_path):
    r = run("convert", tiny_src, "--out", tmp_path / "out", "--dry-run", "--device", "nosuchdevice")
    assert r.exit_code == 2 and "--device 'nosuchdevice' is not usable here" in r.stderr
