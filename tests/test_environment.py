"""Failures of the environment: no network, a read-only or unwritable --out, a disk too
small or filled up mid-write, an --out of someone else's files. Each is one `error:` line with exit
code 2 (never the internal-error code 70), nothing that looks complete is left behind, and no
file of the user's is deleted. Tested for real where the machine allows (closed ports, mounts,
another user), with a stated fallback where it does not."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mla_convert.cli.app import app
from mla_convert.output import out_dir as out_dir_mod
from support.checkpoints import SHARD1, SHARD2
from support.processes import small_filesystem

MANIFEST = "mla-convert-manifest.json"
REPO = "deepseek-ai/Tiny-R1"
runner = CliRunner()


def one_error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


def assert_nothing_complete(out: Path) -> None:
    """No finished-looking output: no complete manifest, no half-written (.partial) file."""
    if out.exists():
        m = out / MANIFEST
        assert not m.exists() or json.loads(m.read_text())["status"] != "complete"
        assert not list(out.rglob("*.partial"))


# ---- no network -------------------------------------------------------------------------------


@pytest.fixture
def closed_port() -> int:
    """A local TCP port nothing listens on: connecting is refused at once, as with no network."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


HF_ENV_UNSET = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")


def unreachable_hub_env(port: int, hf_home: Path) -> dict:
    return {
        "HF_ENDPOINT": f"http://127.0.0.1:{port}",
        "HF_HOME": str(hf_home),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_XET": "1",
        "NO_PROXY": "127.0.0.1",
        "no_proxy": "127.0.0.1",
    }


@pytest.mark.parametrize(
    "args",
    [
        ["deepseek-r1", "--dry-run"],  # the default SOURCE, deepseek-ai/DeepSeek-R1
        ["deepseek-r1", "--stream"],
        ["deepseek-r1"],
        ["convert", "org/some-model", "--dry-run"],
    ],
    ids=["default-dry-run", "default-stream", "default", "convert-dry-run"],
)
def test_hub_on_a_closed_port_is_one_line(args, closed_port, tmp_path, run_cli):
    out = tmp_path / "out"
    r = run_cli(*args, "--out", out, env=unreachable_hub_env(closed_port, tmp_path / "hf"), unset=HF_ENV_UNSET)
    assert r.returncode == 2, r.stderr
    line = one_error_line(r.stderr)
    assert f"cannot reach the Hub at http://127.0.0.1:{closed_port}" in line and "Connection refused" in line
    assert not out.exists()


@pytest.fixture
def hub(fake_hub, tiny_src):
    fake_hub.add_repo(REPO, tiny_src)
    return fake_hub


@pytest.mark.slow
def test_stream_losing_the_network_mid_download_is_one_line(hub, tmp_path):
    """The server goes away while a shard is being downloaded: one line, exit 2, an output that
    says it is incomplete (a later --resume finishes it)."""
    out = tmp_path / "out"
    hub.stall(REPO, SHARD2)
    p = subprocess.Popen(
        [sys.executable, "-m", "mla_convert", "deepseek-r1", REPO, "--out", str(out), "--stream", "--quiet"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    t0 = time.monotonic()
    while not any(r.filename == SHARD2 and not r.range and r.method == "GET" for r in list(hub.requests)):
        assert p.poll() is None and time.monotonic() - t0 < 60, p.stderr.read() if p.poll() is not None else ""
        time.sleep(0.01)
    hub.stop()
    _, err = p.communicate(timeout=120)
    assert p.returncode == 2, err
    line = one_error_line(err)
    assert REPO in line and "unexpected" not in line
    assert_nothing_complete(out)


# ---- an --out that cannot be written ----------------------------------------------------------


@contextlib.contextmanager
def read_only_mount(base: Path):
    """`base`/ro: a read-only bind mount of an empty directory (root only)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a read-only filesystem needs root; test_unwritable_out covers a non-root user")
    src, ro = base / "rw", base / "ro"
    (src / "empty").mkdir(parents=True)
    ro.mkdir()
    if subprocess.run(["mount", "--bind", str(src), str(ro)], capture_output=True).returncode != 0:
        pytest.skip("this machine does not allow mounts (no CAP_SYS_ADMIN)")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], check=True, capture_output=True)
        yield ro
    finally:
        subprocess.run(["umount", str(ro)], check=True)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["new", "empty"])
def test_read_only_out_is_one_line(tiny_src, tmp_path, run_cli, where):
    with read_only_mount(tmp_path) as ro:
        out = ro / where
        r = run_cli("convert", tiny_src, "--out", out)
        assert r.returncode == 2, r.stderr
        line = one_error_line(r.stderr)
        assert "read-only filesystem" in line and str(out) in line
        assert sorted(p.name for p in ro.iterdir()) == ["empty"] and not any((ro / "empty").iterdir())
        r = run_cli("demo", "--out", ro / "demo")
        assert r.returncode == 2 and "read-only filesystem" in one_error_line(r.stderr)


def without_root_override():
    """In the child, before exec: give up root's power to write past permissions (CAP_DAC_OVERRIDE,
    CAP_DAC_READ_SEARCH), so that a directory's mode binds it as it binds any user."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP: gone from the program exec'd next
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


@pytest.mark.slow
def test_unwritable_out_is_one_line(tiny_src, tmp_path, run_cli):
    """A directory the process may not write into: its mode alone for a user; as root, the child
    first gives up the capabilities that let root write anywhere."""
    locked = tmp_path / "locked"
    (locked / "empty").mkdir(parents=True)
    locked.chmod(0o555)
    (locked / "empty").chmod(0o555)
    drop = without_root_override if os.geteuid() == 0 else None
    for out in (locked / "new", locked / "empty"):
        r = run_cli("convert", tiny_src, "--out", out, preexec_fn=drop)
        assert r.returncode == 2, r.stderr
        line = one_error_line(r.stderr)
        assert "no permission to write" in line and str(out) in line
    assert sorted(p.name for p in locked.iterdir()) == ["empty"] and not any((locked / "empty").iterdir())


# ---- free space -------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_small_filesystem_is_refused_before_the_first_byte(tiny_src, converted, tmp_path, run_cli, tree_hashes):
    """The tiny conversion needs 13.9 MB; the filesystem has 4 MB."""
    with small_filesystem(tmp_path / "small", "4m") as small:
        out = small / "out"
        r = run_cli("convert", tiny_src, "--out", out, "--dry-run", "--json", "--ignore-free-space")
        plan = json.loads(r.stdout)
        assert plan["disk_required"] == plan["bytes_out"] > plan["disk_free"] > 3_000_000
        r = run_cli("convert", tiny_src, "--out", out, "--dry-run", "--ignore-free-space")
        assert r.returncode == 0 and "needed of 4.19 MB free: NOT ENOUGH" in r.stdout
        r = run_cli("convert", tiny_src, "--out", out)
        assert r.returncode == 2
        line = one_error_line(r.stderr)
        assert "not enough free space" in line and "13.88 MB" in line and "4.19 MB free" in line
        assert "--ignore-free-space" in line
        assert not out.exists()  # nothing written, not even the directory
        dry = run_cli("convert", tiny_src, "--out", out, "--dry-run")  # refused as the real run is
        assert dry.returncode == 2 and dry.stderr == r.stderr

        # Told to go on anyway, the disk fills up mid-write: one line, nothing complete-looking,
        r = run_cli("convert", tiny_src, "--out", out, "--ignore-free-space")
        assert r.returncode == 2
        line = one_error_line(r.stderr)  # and what to do next
        assert "No space left on device; free some space on that filesystem, then finish it with" in line
        assert line.endswith("--resume (or start over with another --out)")
        assert_nothing_complete(out)
        # and once there is room, --resume finishes it with the bytes of an uninterrupted run.
        subprocess.run(["mount", "-o", "remount,size=20m", str(small)], check=True)
        r = run_cli("convert", tiny_src, "--out", out, "--resume", "--quiet")
        assert r.returncode == 0, r.stderr
        assert tree_hashes(out) == tree_hashes(converted["channel-fp8"])


@pytest.fixture
def free_space(monkeypatch):
    """Fake what the filesystems report free: set `.bytes`."""

    class Free:
        bytes = 10**15

    monkeypatch.setattr(out_dir_mod, "disk_free", lambda path: Free.bytes)
    return Free


def test_free_space_faked(tiny_src, tmp_path, free_space):
    """Any user: the check against a filesystem that reports too little."""
    out = tmp_path / "out"
    free_space.bytes = 5_000_000
    r = runner.invoke(app, ["convert", str(tiny_src), "--out", str(out)])
    assert r.exit_code == 2
    assert "not enough free space" in one_error_line(r.stderr) and "5.00 MB free" in r.stderr
    assert not out.exists()
    r = runner.invoke(app, ["convert", str(tiny_src), "--out", str(out), "--dry-run", "--json"])
    assert r.exit_code == 2 and "not enough free space" in one_error_line(r.stderr)  # as the real run
    r = runner.invoke(app, ["convert", str(tiny_src), "--out", str(out), "--dry-run", "--json", "--ignore-free-space"])
    assert r.exit_code == 0 and json.loads(r.stdout)["disk_free"] == 5_000_000
    r = runner.invoke(app, ["convert", str(tiny_src), "--out", str(out), "--ignore-free-space", "--quiet"])
    assert r.exit_code == 0, r.stderr  # the filesystem misreported: the override converts


def test_stream_counts_the_shards_in_flight(hub, tmp_path, free_space):
    out = tmp_path / "out"
    r = runner.invoke(app, ["convert", REPO, "--out", str(out), "--stream", "--dry-run", "--json"])
    plan = json.loads(r.stdout)
    assert plan["disk_required"] == plan["disk_required_stream"] > plan["bytes_out"]
    free_space.bytes = (plan["bytes_out"] + plan["disk_required_stream"]) // 2  # enough for the output alone
    r = runner.invoke(app, ["convert", REPO, "--out", str(out), "--stream"])
    assert r.exit_code == 2 and "not enough free space" in one_error_line(r.stderr)
    assert not out.exists() and shard_bytes_sent(hub) < 100_000  # shard headers only


def test_the_default_source_prints_the_plan_and_refuses_a_small_disk_before_downloading(
    fake_hub, tiny_src, tmp_path, free_space
):
    """`mla-convert deepseek-r1 --out DIR` with its default SOURCE (here a tiny stand-in served as
    deepseek-ai/DeepSeek-R1 by the fake Hub)."""
    fake_hub.add_repo("deepseek-ai/DeepSeek-R1", tiny_src)
    out = tmp_path / "out"
    free_space.bytes = 1_000_000
    r = runner.invoke(app, ["deepseek-r1", "--out", str(out)])
    assert r.exit_code == 2 and "not enough free space" in one_error_line(r.stderr)
    assert not out.exists() and shard_bytes_sent(fake_hub) < 100_000  # shard headers only
    free_space.bytes = 10**12
    r = runner.invoke(app, ["deepseek-r1", "--out", str(out)])
    assert r.exit_code == 0, r.stderr
    plan_line = r.stderr.splitlines()[0]
    assert plan_line.startswith("deepseek-ai/DeepSeek-R1@") and " 4 shards, " in plan_line
    assert "needed in" in plan_line and "1000.000 GB free" in plan_line


def shard_bytes_sent(hub) -> int:
    """What the fake Hub sent of shard files (their headers are a few KB; the tiny shards 2.4 MB)."""
    return sum(r.bytes_sent for r in list(hub.requests) if (r.filename or "").endswith(".safetensors"))


# ---- --overwrite ------------------------------------------------------------------------------


def test_overwrite_replaces_an_earlier_output(tiny_src, converted, tmp_path, tree_hashes):
    out = tmp_path / "out"
    shutil.copytree(converted["bf16"], out)
    r = runner.invoke(app, ["convert", str(tiny_src), "--out", str(out), "--overwrite", "--quiet"])
    assert r.exit_code == 0, r.stderr
    assert tree_hashes(out) == tree_hashes(converted["channel-fp8"])  # no bf16 file left over


def test_overwrite_refuses_an_earlier_output_holding_a_file_of_the_users(tiny_src, converted, tmp_path, tree_hashes):
    out = tmp_path / "out"
    shutil.copytree(converted["bf16"], out)
    (out / "keep").mkdir()
    (out / "keep" / "thesis.txt").write_text("four years of work")
    before = tree_hashes(out)
    r = runner.invoke(app, ["convert", str(tiny_src), "--out", str(out), "--overwrite", "--quiet"])
    assert r.exit_code == 2
    line = one_error_line(r.stderr)
    assert "keep/thesis.txt" in line and "mla-convert did not write" in line
    assert tree_hashes(out) == before  # nothing deleted


@pytest.mark.slow
def test_overwrite_replaces_an_interrupted_output(tiny_src, converted, tmp_path, run_cli, tree_hashes):
    """Killed while its second shard is written: the first is not yet in the journal (its commit, in
    the background, may or may not have renamed it), and still the tool's."""
    out = tmp_path / "out"
    r = run_cli("convert", tiny_src, "--out", out, "--quiet", crash_at=f"shard-write:{SHARD2}")
    assert r.returncode == -9 and ((out / SHARD1).exists() or (out / f".{SHARD1}.partial").exists())
    r = run_cli("convert", tiny_src, "--out", out, "--quiet", "--overwrite")
    assert r.returncode == 0, r.stderr
    assert tree_hashes(out) == tree_hashes(converted["channel-fp8"])


@pytest.mark.slow
def test_demo_overwrite_replaces_only_an_earlier_demo(tmp_path):
    root = tmp_path / "demo"
    assert runner.invoke(app, ["demo", "--out", str(root), "--quiet"]).exit_code == 0
    r = runner.invoke(app, ["demo", "--out", str(root), "--quiet", "--overwrite", "--format", "bf16"])
    assert r.exit_code == 0, r.stderr
    assert sorted(p.name for p in root.iterdir()) == [".mla-convert-demo.json", "converted-bf16", "source"]
    (root / "source" / "notes.md").write_text("mine")
    r = runner.invoke(app, ["demo", "--out", str(root), "--quiet", "--overwrite"])
    assert r.exit_code == 2 and "source/notes.md" in one_error_line(r.stderr)
    assert (root / "source" / "notes.md").read_text() == "mine"
    other = tmp_path / "other"
    other.mkdir()
    (other / "a.txt").write_text("mine")
    r = runner.invoke(app, ["demo", "--out", str(other), "--quiet", "--overwrite"])
    assert r.exit_code == 2 and "not one" in one_error_line(r.stderr)
    assert (other / "a.txt").read_text() == "mine"


def test_overwrite_refuses_a_file_it_wrote_that_has_changed_since(tiny_src, converted, tmp_path, tree_hashes):
    """An edited README.md of an earlier output: before, --overwrite replaced it silently,
    although the manifest records its sha256. Now refused, naming it, as a foreign file is."""
    out = tmp_path / "out"
    shutil.copytree(converted["bf16"], out)
    readme = out / "README.md"
    readme.write_text(readme.read_text() + "\nMy notes on this model.\n")
    before = tree_hashes(out)
    for extra in ([], ["--dry-run"]):
        r = runner.invoke(app, ["convert", str(tiny_src), "--out", str(out), "--overwrite", "--quiet", *extra])
        assert r.exit_code == 2
        line = one_error_line(r.stderr)
        assert "--overwrite would replace README.md, which mla-convert wrote but which has changed since" in line
    assert tree_hashes(out) == before


def test_overwrite_takes_a_file_touched_but_unchanged(tiny_src, converted, tmp_path, tree_hashes):
    """Modified after the manifest, same bytes: re-hashed, found unchanged, replaced."""
    out = tmp_path / "out"
    shutil.copytree(converted["bf16"], out)
    later = (out / "mla-convert-manifest.json").stat().st_mtime + 10
    os.utime(out / "README.md", (later, later))
    r = runner.invoke(app, ["convert", str(tiny_src), "--out", str(out), "--overwrite", "--quiet"])
    assert r.exit_code == 0, r.stderr
    assert tree_hashes(out) == tree_hashes(converted["channel-fp8"])
