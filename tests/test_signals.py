"""SIGTERM (a job scheduler's stop, `timeout`, `kill`) and SIGHUP (a closed terminal or ssh session)
stop a conversion as Ctrl-C does: the same deferred stop, one line, exit code 128 + the
signal, the .partial files removed, the journal left for --resume, the workers stopped. Real
signals to real conversions, held at a named point mid-run (support/pause_cli.py)."""

import os
import signal
import time

import pytest

from mla_convert.process import interrupts
from support.checkpoints import SHARD1, SHARD2
from support.processes import MANIFEST, group_members, start_cli, wait_until, workers_of

LINE = "error: interrupted by {}; the output directory is incomplete (finish it with --resume)"


class Stopped(Exception):
    pass


@pytest.fixture
def stop_signals_raise():
    """SIGTERM and SIGHUP raise Stopped in this test (their default would end pytest)."""

    def handler(signum, frame):
        raise Stopped(signum)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    yield
    for s, h in previous.items():
        signal.signal(s, h)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_deferred_holds_sigterm_and_sighup_until_the_block_is_done(stop_signals_raise, signum):
    events = []
    with pytest.raises(Stopped) as caught, interrupts.deferred():
        os.kill(os.getpid(), signum)
        time.sleep(0.05)  # the handler would run here, between two bytecodes
        events.append("block done")
    assert events == ["block done"] and caught.value.args == (signum,)


def test_an_interrupt_knows_its_signal_and_its_exit_code():
    for signum, code, said in ((signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "interrupted by SIGTERM"),
                               (signal.SIGHUP, 129, "interrupted by SIGHUP")):  # fmt: skip
        e = interrupts.Interrupted(signum)
        assert isinstance(e, KeyboardInterrupt)
        assert (interrupts.exit_code(e), interrupts.stopped_by(e)) == (code, said)
    assert interrupts.exit_code(KeyboardInterrupt()) == 130


def held_conversion(src, out, gate, point, *flags, group=False):
    p = start_cli("convert", src, "--out", out, "--quiet", *flags, pause_at=(point, gate), group=group)
    wait_until(lambda: os.path.exists(f"{gate}.reached") or p.poll() is not None, what=f"the point {point}")
    assert p.poll() is None, p.communicate()
    return p


@pytest.mark.slow
@pytest.mark.parametrize(
    "signum,workers,to_group",
    [(signal.SIGTERM, 1, False), (signal.SIGHUP, 1, False), (signal.SIGTERM, 2, True), (signal.SIGHUP, 2, False)],
    ids=["term", "hup", "term-group-workers", "hup-workers"],
)
def test_sigterm_and_sighup_stop_a_conversion_as_ctrl_c_does(
    tiny_src, converted, tmp_path, tree_hashes, run_cli, signum, workers, to_group
):
    """Before: SIGTERM killed the process (exit -15, no line, .partial files, a 'leaked semaphore'
    warning), SIGHUP too (-1). `timeout` signals the whole group: so does the group case."""
    out, gate = tmp_path / "out", tmp_path / "gate"
    # -w 1: held halfway through a shard; -w 2: held as the first finished job is recorded, workers busy
    point = f"shard-write:{SHARD2}" if workers == 1 else f"after-job:{SHARD1}"
    p = held_conversion(tiny_src, out, gate, point, "--workers", workers, group=True)
    (os.killpg if to_group else os.kill)(p.pid, signum)
    _, err = p.communicate(timeout=120)
    name = signal.Signals(signum).name
    assert p.returncode == 128 + signum, (p.returncode, err)
    assert err.splitlines() == [LINE.format(name)], err
    assert not list(out.rglob("*.partial"))
    assert '"status": "incomplete"' in (out / MANIFEST).read_text()
    wait_until(lambda: not group_members(p.pid), timeout=10, what="the workers and the resource tracker to end")
    r = run_cli("convert", tiny_src, "--out", out, "--resume", "--quiet")
    assert r.returncode == 0, r.stderr
    assert tree_hashes(out) == tree_hashes(converted["channel-fp8"])


@pytest.mark.slow
def test_a_sighup_ignored_from_the_start_stays_ignored(tiny_src, converted, tmp_path, tree_hashes):
    """nohup: the terminal closes, the conversion goes on."""
    out, gate = tmp_path / "out", tmp_path / "gate"
    p = start_cli(
        "convert", tiny_src, "--out", out, "--quiet", pause_at=(f"shard-write:{SHARD2}", gate),
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN),
    )  # fmt: skip
    wait_until(lambda: os.path.exists(f"{gate}.reached") or p.poll() is not None)
    p.send_signal(signal.SIGHUP)
    time.sleep(0.2)
    gate.touch()
    _, err = p.communicate(timeout=120)
    assert p.returncode == 0 and err == "", err
    assert tree_hashes(out) == tree_hashes(converted["channel-fp8"])


@pytest.mark.slow
def test_sigterm_to_verify_with_workers_is_one_line_and_stops_them(big_tensors):
    src, converted_dir = big_tensors
    p = start_cli("verify", converted_dir, "--source", src, "--workers", 2, group=True,
                  env={"MLA_CONVERT_PROGRESS_INTERVAL": "0.01"})  # fmt: skip
    assert p.stderr.readline().startswith("verifying: ")
    wait_until(lambda: len(workers_of(p.pid)) == 2 or p.poll() is not None, what="the workers")
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 143, (p.returncode, err)
    assert err.splitlines()[-1] == "error: verify interrupted by SIGTERM; nothing was changed", err
    wait_until(lambda: not workers_of(p.pid), timeout=10, what="the workers to end")
