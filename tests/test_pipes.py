"""Losing stdout or stderr never stops a conversion or changes an exit code: real pipes
whose reader exits (`| head -1`) and a full stdout (`> /dev/full`)."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from support.processes import MANIFEST, start_cli

ENV = {"MLA_CONVERT_PROGRESS_INTERVAL": "0.001"}  # a progress line for nearly every tensor


def head_1(p: subprocess.Popen) -> str:
    """Read one line of the child's stdout, then go away as `head -1` does."""
    line = p.stdout.readline()
    p.stdout.close()
    return line


@pytest.mark.slow
def test_a_reader_of_stderr_that_goes_away_does_not_stop_the_conversion(tiny_src, converted, tmp_path, tree_hashes):
    """`convert SRC --out OUT 2>&1 | head -1`; before: exit 1, no message, the output incomplete."""
    out = tmp_path / "out"
    p = start_cli("convert", tiny_src, "--out", out, env=ENV, stderr=subprocess.STDOUT)
    assert head_1(p).startswith("converting: ")
    assert p.wait(timeout=300) == 0
    assert json.loads((out / MANIFEST).read_text())["status"] == "complete"
    assert tree_hashes(out) == tree_hashes(converted["channel-fp8"])


@pytest.mark.slow
def test_a_reader_of_the_json_summary_that_goes_away_leaves_exit_code_0(tiny_src, tmp_path):
    out = tmp_path / "out"
    p = start_cli("convert", tiny_src, "--out", out, "--json", env=ENV)
    assert head_1(p) == "{\n"
    _, err = p.communicate(timeout=300)
    assert p.returncode == 0 and "Traceback" not in err, err


@pytest.mark.parametrize("damaged", [False, True], ids=["passes", "fails"])
def test_verify_into_head_exits_with_its_verdict(converted, tmp_path, damaged):
    """`verify DIR | head -1`; before: exit 1 ('a check failed') although every check passed."""
    out = converted["bf16"]
    if damaged:
        out = shutil.copytree(out, tmp_path / "out")
        side = out / "generation_config.json"
        side.write_text(side.read_text() + " ")
    p = start_cli("verify", out)
    assert head_1(p).strip()
    _, err = p.communicate(timeout=300)
    assert p.returncode == (1 if damaged else 0), err
    assert "Traceback" not in err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("command", ["convert", "verify"])
def test_a_full_stdout_is_one_line_and_exit_code_2(tiny_src, converted, tmp_path, command):
    """`... > /dev/full`; before: a rich traceback (OSError: [Errno 28]) after the command had done its work."""
    out = tmp_path / "out"
    args = ["convert", tiny_src, "--out", out] if command == "convert" else ["verify", converted["channel-fp8"]]
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "mla_convert", *map(str, args)], stdout=full,
                           stderr=subprocess.PIPE, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines() == [
        "error: cannot write to stdout: No space left on device; the command itself succeeded, but its output is lost"
    ], r.stderr
    if command == "convert":  # the conversion itself is done, and says so
        assert json.loads((out / MANIFEST).read_text())["status"] == "complete"
