"""`demo --out` on a directory that is not empty says what will work: --overwrite only
where --overwrite then goes ahead, and never a user's file deleted. Through the real CLI."""

import shutil
from pathlib import Path


def one_error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


def test_a_folder_that_is_not_a_demo_is_not_told_to_pass_overwrite(tmp_path, run_cli):
    """Before: 'directory is not empty; delete it, pick another --out, or pass --overwrite', and
    --overwrite was then refused ('... this directory is not one')."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.txt").write_text("mine")
    r = run_cli("demo", "--out", mine, "--quiet")
    assert r.returncode == 2
    line = one_error_line(r.stderr)
    assert "--overwrite" not in line, line
    assert "not an earlier demo" in line and "pick another --out" in line
    r = run_cli("demo", "--out", mine, "--quiet", "--overwrite")  # refused as well, and says so
    assert r.returncode == 2 and "replaces only an earlier demo" in one_error_line(r.stderr)
    assert sorted(p.name for p in mine.iterdir()) == ["thesis.txt"]
    assert (mine / "thesis.txt").read_text() == "mine"


def test_what_the_refusal_of_an_earlier_demo_suggests_works(tmp_path, run_cli):
    root = tmp_path / "demo"
    assert run_cli("demo", "--out", root, "--quiet").returncode == 0
    r = run_cli("demo", "--out", root, "--quiet")
    assert r.returncode == 2
    assert "holds an earlier demo; pass --overwrite to replace it" in one_error_line(r.stderr)

    notes = root / "source" / "notes.md"  # a file of the user's inside the demo
    notes.write_text("mine")
    r = run_cli("demo", "--out", root, "--quiet")
    assert r.returncode == 2
    line = one_error_line(r.stderr)
    assert "source/notes.md" in line and "move it out of --out first, then pass --overwrite" in line
    assert notes.read_text() == "mine"
    kept = shutil.move(notes, tmp_path / "notes.md")  # as the line says
    r = run_cli("demo", "--out", root, "--quiet", "--overwrite")
    assert r.returncode == 0, r.stderr
    assert Path(kept).read_text() == "mine"
    assert sorted(p.name for p in root.iterdir()) == [".mla-convert-demo.json", "converted-channel-fp8", "source"]


def test_an_interrupted_demos_line_says_what_will_work(tmp_path, run_cli):
    """Interrupted before its source was complete (no marker yet), --overwrite is refused, so the
    line says to remove the directory (before: 'run it again with --overwrite' in every case);
    with the marker written, --overwrite works and the line says so."""
    from mla_convert.cli.demo_cmd import _interrupted

    root = tmp_path / "demo"
    (root / "source").mkdir(parents=True)
    (root / "source" / "config.json").write_text("{}")  # what the demo had begun to write
    line = _interrupted(root)
    assert "--overwrite" not in line and f"remove {root}" in line, line
    r = run_cli("demo", "--out", root, "--quiet", "--overwrite")
    assert r.returncode == 2 and "replaces only an earlier demo" in one_error_line(r.stderr)

    shutil.rmtree(root)  # what the line says
    assert run_cli("demo", "--out", root, "--quiet").returncode == 0
    assert "with --overwrite" in _interrupted(root)  # a complete source: --overwrite replaces it
    assert run_cli("demo", "--out", root, "--quiet", "--overwrite").returncode == 0
