"""A worker process ends with the process that started it, however that one ends (kill -9 included).

A worker left behind by a parent that was killed holds hundreds of MB, may still write into --out,
and keeps multiprocessing's resource tracker alive under PID 1. Two independent ways, both set
first thing in the worker (`die_with_parent`):

- Linux's parent-death signal (prctl PR_SET_PDEATHSIG): the kernel sends the worker SIGKILL when
  the thread that forked it ends. Workers are forked by the parent's main thread (a pool's
  submit), so that is the parent's own end. A parent that died before the call is caught by
  comparing getppid() with the PID that started the worker.
- A pipe: multiprocessing gives every spawned child the read end of a pipe whose write end only its
  parent holds (`multiprocessing.parent_process().sentinel`). A thread watches it; end of file means
  the parent is gone. This also works where prctl does not (not Linux, a seccomp filter).

Either way the worker kills itself with SIGKILL: a worker's work is its parent's to clean up (a
resume redoes it), and nothing the worker could still do is worth a traceback nobody reads.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading

PR_SET_PDEATHSIG = 1  # linux/prctl.h
WATCH_THREAD_NAME = "mla-convert-parent-watch"


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def set_death_signal() -> bool:
    """Ask the kernel to SIGKILL this process when its parent ends; False where prctl is missing."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def watch_parent() -> bool:
    """Start a daemon thread that kills this process once its multiprocessing parent is gone;
    False where this process has no such parent (not started by multiprocessing)."""
    parent = multiprocessing.parent_process()
    sentinel = getattr(parent, "sentinel", None)
    if sentinel is None:
        return False

    def watch() -> None:
        try:
            multiprocessing.connection.wait([sentinel])
        except OSError:  # the sentinel closed under us: the parent is going away too
            pass
        _die()

    threading.Thread(target=watch, name=WATCH_THREAD_NAME, daemon=True).start()
    return True


def die_with_parent(parent_pid: int) -> None:
    """The first thing a worker does: both guards above. If the parent is already gone (it died
    between starting this process and now), end at once."""
    set_death_signal()
    if os.getppid() != parent_pid:
        _die()
    watch_parent()
