"""Importing torch, as a process that needs it does: once, with the cyclic GC paused.

torch's import creates a great many long-lived objects, and the GC would walk them again and again
on the way, a large part of a command's start-up. A Ctrl-C raised inside it can be swallowed by its
C code (torch._C imports numpy and goes on without it when that fails), leaving a command that runs
on: it is held back until the import is done, and raised then. A conversion whose native kernels
this machine has checked never calls this (conversion.compute); everything else that needs torch
calls it first.
"""

from __future__ import annotations

import gc
import sys

from mla_convert.process import interrupts, threads


def import_torch():
    """torch, imported now if it is not yet (then its objects are kept out of later collections)."""
    if "torch" in sys.modules:
        return sys.modules["torch"]
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with interrupts.deferred():
            import torch
    finally:
        if was_enabled:
            gc.enable()
    gc.freeze()
    threads.apply_to_torch()
    return torch
