"""One run per --out: an advisory lock held for the whole run, naming its holder; a
second convert, verify or dry run on the same directory refused in one line naming that PID; a
stale lock, left by a killed run, taken over and said so. Two real processes on one --out."""

import json
import os

import pytest

from mla_convert.errors import OutputError
from mla_convert.output.lock import OutLock, check_unlocked
from support.checkpoints import SHARD2
from support.processes import start_cli, wait_until

LOCK = ".mla-convert.lock"


def test_a_held_lock_refuses_a_second_holder_and_is_removed_by_the_first(tmp_path):
    first = OutLock(tmp_path, "convert")
    assert first.acquire() is None
    holder = json.loads((tmp_path / LOCK).read_text())
    assert holder["pid"] == os.getpid() and holder["command"] == "convert" and holder["since"]
    with pytest.raises(OutputError, match=rf"in use by mla-convert convert \(PID {os.getpid()}, since "):
        OutLock(tmp_path, "verify").acquire()  # flock: a second open file description conflicts
    with pytest.raises(OutputError, match="in use by"):
        check_unlocked(tmp_path)
    first.release()
    assert not (tmp_path / LOCK).exists()
    check_unlocked(tmp_path)  # free again


@pytest.mark.slow
def test_a_second_run_on_the_same_out_is_refused_naming_the_first(tiny_src, converted, tmp_path, run_cli, tree_hashes):
    """Before: a second --overwrite run 3 s into a first made the first fail ('cannot finish
    writing'), and a second --resume ran to the end beside it."""
    out, gate = tmp_path / "out", tmp_path / "gate"
    first = start_cli("convert", tiny_src, "--out", out, "--quiet", pause_at=(f"shard-write:{SHARD2}", gate))
    wait_until(lambda: os.path.exists(f"{gate}.reached") or first.poll() is not None, what="the first run")
    assert first.poll() is None, first.communicate()
    assert json.loads((out / LOCK).read_text())["pid"] == first.pid
    refusal = f"error: {out}: in use by mla-convert convert (PID {first.pid}, since "
    for args in (["--overwrite"], ["--resume"], ["--dry-run"], ["--overwrite", "--dry-run"]):
        r = run_cli("convert", tiny_src, "--out", out, "--quiet", *args)
        assert r.returncode == 2, (args, r.stderr)
        assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith(refusal), (args, r.stderr)
    r = run_cli("verify", out)
    assert r.returncode == 2 and r.stderr.startswith(refusal), r.stderr
    gate.touch()
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    assert not (out / LOCK).exists()  # its holder removed it
    assert tree_hashes(out) == tree_hashes(converted["channel-fp8"])


@pytest.mark.slow
def test_a_stale_lock_is_taken_over_and_said_so(tiny_src, converted, tmp_path, run_cli, tree_hashes):
    out = tmp_path / "out"
    r = run_cli("convert", tiny_src, "--out", out, "--quiet", crash_at=f"shard-write:{SHARD2}")
    assert r.returncode == -9
    dead = json.loads((out / LOCK).read_text())["pid"]
    r = run_cli("convert", tiny_src, "--out", out, "--resume", "--json")
    assert r.returncode == 0, r.stderr
    took_over = [ln for ln in r.stderr.splitlines() if "took over the lock" in ln]
    assert len(took_over) == 1 and f"mla-convert convert (PID {dead}, " in took_over[0], r.stderr
    assert took_over[0].endswith("which is no longer running")
    assert not (out / LOCK).exists()
    assert tree_hashes(out) == tree_hashes(converted["channel-fp8"])


def test_the_api_takes_the_lock_as_the_commands_do(converted, tmp_path):
    """mla_convert.verify / card / upload on a directory another process holds are refused naming
    its PID (before, only the verify command took the lock); once it lets go they run, and leave
    no lock file behind."""
    import shutil
    import subprocess
    import sys

    import mla_convert

    out = tmp_path / "out"
    shutil.copytree(converted["channel-fp8"], out)
    hold = (
        "import sys; from pathlib import Path; from mla_convert.output.lock import OutLock\n"
        "lock = OutLock(Path(sys.argv[1]), 'convert'); lock.acquire(); print('held', flush=True); sys.stdin.read()"
    )
    holder = subprocess.Popen([sys.executable, "-c", hold, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        refusal = rf"in use by mla-convert convert \(PID {holder.pid}, since "
        with pytest.raises(OutputError, match=refusal):
            mla_convert.verify(out)
        with pytest.raises(OutputError, match=refusal):
            mla_convert.card(out, base_model="acme/base")
        with pytest.raises(OutputError, match=refusal):
            mla_convert.upload(out, "acme/model", dry_run=True)
    finally:
        holder.communicate(input="", timeout=60)
    assert mla_convert.verify(out).ok
    assert mla_convert.card(out, base_model="acme/base").base_model == "acme/base"
    assert mla_convert.upload(out, "acme/model", dry_run=True).files
    assert not (out / LOCK).exists()
