"""The real CLI in this process, held at one named crash point until the test lets it go, so that a
second process can meet the first one mid-run (two runs on one --out):

    python -m support.pause_cli POINT GATE ARGS...   # runs `mla-convert ARGS...`

At POINT it creates GATE + ".reached" and waits until GATE exists. It sets the documented seam
`mla_convert.process.interrupts.CRASH_POINTS.hook`; the product never reads the point from its environment.
`processes.start_cli(..., pause_at=(POINT, GATE))` runs it.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from mla_convert.cli import main
from mla_convert.process.interrupts import CRASH_POINTS


def _hold_at(point: str, gate: Path):
    def hook(name: str) -> None:
        if name == point:
            Path(f"{gate}.reached").touch()
            while not gate.exists():
                time.sleep(0.01)

    return hook


if __name__ == "__main__":
    CRASH_POINTS.hook = _hold_at(sys.argv[1], Path(sys.argv[2]))
    sys.argv = ["mla-convert", *sys.argv[3:]]
    main()
