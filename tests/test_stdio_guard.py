"""A stream that was never there (`>&-`, `2>&-`, `<&-`: daemons, cron jobs, some CI runners start
processes so) changes nothing but what is printed: every command exits as with its
streams open and writes the same bytes. Before: exit 120, with a traceback or without a word."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from support.processes import MANIFEST, as_from_a_terminal

CLOSINGS = {"stdout": (1,), "stderr": (2,), "both": (1, 2), "all three": (0, 1, 2)}


def run_closed(*args, closed=(1, 2), env=None) -> int:
    """`python -m mla_convert ARGS` with the descriptors `closed` closed in the child (as the shell's
    `>&-` does); what is left open goes to /dev/null. Returns the exit code."""

    def before_exec() -> None:
        as_from_a_terminal()
        for fd in closed:
            os.close(fd)

    r = subprocess.run(
        [sys.executable, "-m", "mla_convert", *map(str, args)], stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **(env or {})},
        preexec_fn=before_exec, timeout=300,
    )  # fmt: skip
    return r.returncode


@pytest.mark.parametrize("closing", list(CLOSINGS))
def test_convert_with_closed_streams_writes_the_same_bytes(tiny_src, converted, tmp_path, tree_hashes, closing):
    """Before: `2>&-` exit 120, nothing converted; `>&-` converted, then a traceback and exit 120."""
    out = tmp_path / "out"
    env = {"MLA_CONVERT_PROGRESS_INTERVAL": "0.001"}  # progress for nearly every tensor, into the closed stderr
    assert run_closed("convert", tiny_src, "--out", out, closed=CLOSINGS[closing], env=env) == 0
    assert tree_hashes(out) == tree_hashes(converted["channel-fp8"])


def test_convert_with_two_workers_and_closed_streams(tiny_src, converted, tmp_path, tree_hashes):
    out = tmp_path / "out"
    assert run_closed("convert", tiny_src, "--out", out, "-w", "2") == 0
    assert tree_hashes(out) == tree_hashes(converted["channel-fp8"])


def test_a_failing_convert_with_closed_streams_keeps_its_exit_code(tiny_src, tmp_path):
    missing = tmp_path / "no-such-checkpoint"
    assert run_closed("convert", missing, "--out", tmp_path / "out", closed=()) == 2
    assert run_closed("convert", missing, "--out", tmp_path / "out") == 2
    assert not (tmp_path / "out").exists()


def test_a_resumed_convert_with_closed_streams(tiny_src, converted, tmp_path, tree_hashes, run_cli):
    out = tmp_path / "out"
    r = run_cli("convert", tiny_src, "--out", out, crash_at="index")
    assert r.returncode == -9, r.stderr
    assert run_closed("convert", tiny_src, "--out", out, "--resume") == 0
    assert tree_hashes(out) == tree_hashes(converted["channel-fp8"])


def test_deepseek_r1_with_closed_streams(tiny_src, tmp_path, run_cli, tree_hashes):
    open_, closed = tmp_path / "open", tmp_path / "closed"
    assert run_cli("deepseek-r1", tiny_src, "--out", open_, "--format", "bf16").returncode == 0
    assert run_closed("deepseek-r1", tiny_src, "--out", closed, "--format", "bf16") == 0
    assert tree_hashes(closed) == tree_hashes(open_)


@pytest.mark.parametrize("damaged", [False, True], ids=["passes", "fails"])
def test_verify_with_closed_streams_exits_with_its_verdict(converted, tiny_src, tmp_path, damaged):
    """Before: exit 120 either way."""
    out = converted["bf16"]
    if damaged:
        out = shutil.copytree(out, tmp_path / "out")
        side = out / "generation_config.json"
        side.write_text(side.read_text() + " ")
    assert run_closed("verify", out, "--source", tiny_src) == (1 if damaged else 0)


def test_demo_with_closed_streams_writes_the_same_demo(tmp_path, run_cli, tree_hashes):
    def model_files(root: Path) -> dict:  # without the manifests' and the cards' paths, which name the folder
        return {k: v for k, v in tree_hashes(root).items() if not k.endswith((MANIFEST, "README.md"))}

    assert run_cli("demo", "--out", tmp_path / "open", "--quiet").returncode == 0
    assert run_closed("demo", "--out", tmp_path / "closed") == 0
    assert model_files(tmp_path / "closed") == model_files(tmp_path / "open")
    manifest = tmp_path / "closed" / "converted-channel-fp8" / MANIFEST
    assert json.loads(manifest.read_text())["status"] == "complete"


def test_upload_with_closed_streams(fake_hub, monkeypatch, converted, tmp_path):
    token = "hf_fake_write_token"
    fake_hub.add_token(token)
    monkeypatch.setenv("HF_TOKEN", token)
    out = Path(shutil.copytree(converted["channel-fp8"], tmp_path / "out"))
    assert run_closed("upload", out, "org/tiny", "--create") == 0
    manifest = json.loads((out / MANIFEST).read_text())
    tree = {p: h for p, h in fake_hub.tree("org/tiny", "main").items() if p != ".gitattributes"}
    assert {p: h for p, h in tree.items() if p != MANIFEST} == {p: m["sha256"] for p, m in manifest["files"].items()}
