"""The real CLI in this process, killed with SIGKILL at one named crash point, as a power cut or the
OOM killer would (no cleanup handlers run):

    python -m support.crash_cli POINT ARGS...   # runs `mla-convert ARGS...`, dies at POINT

It sets the documented seam `mla_convert.process.interrupts.CRASH_POINTS.hook`; the product never reads
the point from its environment. `run_cli(..., crash_at=POINT)` runs it (cli_runner.py).
"""

from __future__ import annotations

import os
import signal
import sys

from mla_convert.cli import main
from mla_convert.process.interrupts import CRASH_POINTS


def _kill_at(point: str):
    def hook(name: str) -> None:
        if name == point:
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


if __name__ == "__main__":
    CRASH_POINTS.hook = _kill_at(sys.argv[1])
    sys.argv = ["mla-convert", *sys.argv[2:]]
    main()
