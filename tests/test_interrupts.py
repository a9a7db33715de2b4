"""Ctrl-C: no kernel or I/O thread outlives the memory it works on however the caller
unwinds, and an interrupted command ends with one line and exit code 130, never by a signal.
Tested with real SIGINTs at random moments of real conversions."""

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from mla_convert.kernels import native
from mla_convert.process import interrupts
from support.processes import as_from_a_terminal

MANIFEST = "mla-convert-manifest.json"
INTERRUPTED = "error: interrupted; the output directory is incomplete (finish it with --resume)"

# ---- _rows_parallel: returns or raises only once every range is done ----------------------------


class Signalled(Exception):
    pass


@pytest.fixture
def sigint_raises():
    """SIGINT raises Signalled in this test (rather than a KeyboardInterrupt pytest would act on)."""

    def handler(signum, frame):
        raise Signalled

    previous = signal.signal(signal.SIGINT, handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture
def two_ranges(monkeypatch):
    """_rows_parallel splits into two ranges on any host."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)


def test_a_sigint_waits_for_every_range_of_a_kernel(sigint_raises, two_ranges):
    done = []

    def kernel(a, b):
        time.sleep(0.4)  # releases the GIL, as the C kernels do
        done.append((a, b))

    timer = threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    t0 = time.monotonic()
    with pytest.raises(Signalled):  # still raised, once the kernel is done
        native._rows_parallel(kernel, 256)
    timer.join()
    assert sorted(done) == [(0, 128), (128, 256)]
    assert time.monotonic() - t0 >= 0.4


def test_a_failing_range_waits_for_the_others(two_ranges):
    done = []

    def kernel(a, b):
        if a == 0:
            raise ValueError("range 0 fails at once")
        time.sleep(0.3)
        done.append(b)

    with pytest.raises(ValueError, match="range 0"):
        native._rows_parallel(kernel, 256)
    assert done == [256]


def test_deferred_holds_a_sigint_until_the_block_is_done(sigint_raises):
    events = []
    with pytest.raises(Signalled), interrupts.deferred():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # the handler would run here, between two bytecodes
        events.append("block done")
    assert events == ["block done"]


def test_deferred_leaves_an_ignored_sigint_ignored():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with interrupts.deferred():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


# ---- the real CLI under SIGINT ------------------------------------------------------------------


def start(*args, env=None, group=False) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "mla_convert", *map(str, args)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})},
        preexec_fn=as_from_a_terminal, start_new_session=group,
    )  # fmt: skip


def wait_until_writing(out: Path, p: subprocess.Popen, timeout: float = 120) -> None:
    """Until the conversion has written its first file (its manifest), or ended."""
    t0 = time.monotonic()
    while not (out / MANIFEST).exists() and p.poll() is None:
        assert time.monotonic() - t0 < timeout
        time.sleep(0.005)


@pytest.mark.slow
def test_sigint_storm_never_kills_a_conversion_and_resume_finishes_it(big_tensors, tmp_path, tree_hashes, run_cli):
    """Before the fix, 3 of 24 such runs ended in a segfault (exit -11) and others in a SIGINT
    death (-2) while the interpreter shut down."""
    src, reference = big_tensors
    env = {"MLA_CONVERT_KERNELS": "native"}
    p = start("convert", src, "--out", tmp_path / "timed", "--quiet", env=env)
    wait_until_writing(tmp_path / "timed", p)
    t0 = time.monotonic()
    assert p.wait(timeout=120) == 0
    writing = time.monotonic() - t0  # signals land in this span of the next runs, at random
    rng = random.Random(17)
    runs = []
    for i in range(12):
        out = tmp_path / f"out{i}"
        p = start("convert", src, "--out", out, "--quiet", env=env)
        wait_until_writing(out, p)
        time.sleep(rng.uniform(0, 0.8 * writing))
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)
        runs.append((out, p.returncode, err))
    for _, rc, err in runs:
        assert rc in (0, 130), (rc, err)  # -11 segfault, -6 abort, -2 killed by SIGINT
        assert err.splitlines() == ([INTERRUPTED] if rc == 130 else []), err
    interrupted = [out for out, rc, _ in runs if rc == 130]
    assert len(interrupted) >= 6  # most signals hit a conversion at work, not a finished one
    for out in interrupted:
        assert not list(out.rglob("*.partial"))  # its half-written file went with it
        assert '"status": "incomplete"' in (out / MANIFEST).read_text()
    r = run_cli("convert", src, "--out", interrupted[0], "--resume", "--quiet")
    assert r.returncode == 0, r.stderr
    assert tree_hashes(interrupted[0]) == tree_hashes(reference)


@pytest.mark.slow
def test_ctrl_c_to_the_process_group_stops_the_workers(big_tensors, tmp_path):
    """A terminal's Ctrl-C reaches every process of the job: the workers leave it to the parent,
    which stops them and removes what they were writing."""
    src, _ = big_tensors
    for i, delay in enumerate((0.3, 1.0)):
        out = tmp_path / f"out{i}"
        p = start("convert", src, "--out", out, "--quiet", "--workers", "2", group=True)
        wait_until_writing(out, p)
        time.sleep(delay)
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGINT)
        _, err = p.communicate(timeout=120)
        assert p.returncode in (0, 130), (p.returncode, err)
        assert err.splitlines() == ([INTERRUPTED] if p.returncode == 130 else []), err
        assert not workers_left(p.pid)
        assert not list(out.rglob("*.partial"))


def workers_left(group: int) -> list[str]:
    """The worker processes (multiprocessing's spawned children) still alive in a process group."""
    left = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[2]) == group:
                cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                if "spawn_main" in cmdline:
                    left.append(cmdline)
        except (OSError, IndexError, ValueError):
            continue
    return left


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_verify_stops_within_a_second_and_says_it_changed_nothing(big_tensors, tree_hashes, workers):
    src, converted = big_tensors
    before = tree_hashes(converted)
    p = start("verify", converted, "--source", src, "--workers", workers, env={"MLA_CONVERT_PROGRESS_INTERVAL": "0.01"})
    first = p.stderr.readline()  # a progress line: verify is reading and checking
    assert first.startswith("verifying: "), first
    t0 = time.monotonic()
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    took = time.monotonic() - t0
    assert p.returncode == 130, (p.returncode, err)
    assert err.splitlines()[-1] == "error: verify interrupted; nothing was changed", err
    assert all(line.startswith("verifying: ") for line in err.splitlines()[:-1]), err
    assert took < 1.0, took
    assert tree_hashes(converted) == before


@pytest.mark.slow
def test_ctrl_c_during_a_stalled_stream_download_stops_at_once(fake_hub, tiny_src, tmp_path):
    """A --stream download that hangs (a stalled connection) does not hold up the exit: the
    command says it was interrupted and ends, leaving the staging directory to a --resume."""
    from support.checkpoints import SHARD2

    repo = "deepseek-ai/Tiny-R1"
    fake_hub.add_repo(repo, tiny_src)
    fake_hub.stall(repo, SHARD2)
    out = tmp_path / "out"
    p = start("deepseek-r1", repo, "--out", out, "--stream", "--quiet")
    t0 = time.monotonic()
    while not any(r.filename == SHARD2 and r.method == "GET" and not r.range for r in list(fake_hub.requests)):
        assert p.poll() is None and time.monotonic() - t0 < 60
        time.sleep(0.01)
    t0 = time.monotonic()
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130 and err.splitlines() == [INTERRUPTED], (p.returncode, err)
    assert time.monotonic() - t0 < 3
    assert '"status": "incomplete"' in (out / MANIFEST).read_text()
