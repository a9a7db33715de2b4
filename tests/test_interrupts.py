"""Ctrl-C (issue 17): no kernel or I/O thread outlives the memory it works on however the caller
unwinds."""

import os
import signal
import threading
import time

import pytest
import torch

from mla_convert import interrupts, native

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
