"""SOURCE, as the user types it: a mistyped relative path spelt OWNER/NAME is not
taken for a Hub repo alone; the refusal says that there is no such directory and why the Hub could
not give it either. A Hub id the Hub does not have says both too; one the Hub cannot be asked about
(offline) keeps the Hub's own reason."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from mla_convert.cli.app import app

runner = CliRunner()
UNSET = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


def test_a_mistyped_relative_path_says_no_such_directory_and_why_the_hub_could_not_give_it(tmp_path):
    """`convert data/DeepSeek-R1` where ./data exists but holds no DeepSeek-R1, the Hub unreachable:
    it said only `cannot reach the Hub at ...`, as if the user had meant a repo."""
    (tmp_path / "data").mkdir()
    port = _closed_port()
    env = {k: v for k, v in os.environ.items() if k not in UNSET} | {
        "HF_ENDPOINT": f"http://127.0.0.1:{port}", "HF_HOME": str(tmp_path / "hf"), "NO_PROXY": "127.0.0.1",
        "no_proxy": "127.0.0.1", "HF_HUB_DISABLE_TELEMETRY": "1",
    }  # fmt: skip
    for args in (["convert", "data/DeepSeek-R1"], ["convert", "data/DeepSeek-R1", "--dry-run"]):
        r = subprocess.run(
            [sys.executable, "-m", "mla_convert", *args, "--out", "out"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert r.returncode == 2, r.stderr
        line = _one_line(r.stderr)
        assert line.startswith(f"error: data/DeepSeek-R1: no such directory ({tmp_path / 'data' / 'DeepSeek-R1'})")
        assert f"cannot reach the Hub at http://127.0.0.1:{port}" in line, line
        assert not (tmp_path / "out").exists()


def test_a_repo_the_hub_does_not_have_says_there_is_no_such_directory_either(fake_hub, tmp_path):
    for args in (["convert", "nobody/missing"], ["convert", "nobody/missing", "--dry-run"]):
        res = runner.invoke(app, [*args, "--out", str(tmp_path / "out")])
        assert res.exit_code == 2, res.stderr
        line = _one_line(res.stderr)
        assert line.startswith("error: nobody/missing: no such directory (") and "repository not found" in line, line
    res = runner.invoke(app, ["verify", str(tmp_path / "nothing"), "--source", "nobody/missing"])
    assert res.exit_code == 2 and "no such directory" in res.stderr


def test_a_hub_id_with_no_local_look_alike_keeps_the_hubs_reason(fake_hub, tmp_path, monkeypatch):
    """Offline and not cached, a repo id whose first part is no directory here: the Hub's line as it was."""
    monkeypatch.chdir(tmp_path)
    fake_hub.set_offline()
    res = runner.invoke(app, ["convert", "org/some-model", "--out", str(tmp_path / "out")])
    line = _one_line(res.stderr)
    assert line.startswith("error: org/some-model: not in the local Hugging Face cache"), line
    assert Path("org").exists() is False
