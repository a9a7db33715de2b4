"""Named points of a conversion where a test may stop the process dead, as a power cut or the OOM
killer would, to prove that what is left can be resumed.

`HOOK` is the documented seam: None in the product (a crash point then does nothing); a test sets
it to a function of the point's name, in the process that runs the conversion
(tests/support/crash_cli.py does so for the real CLI). The points: `shard-write:FILE` (halfway
through writing a shard), `after-job:FILE` (a shard job recorded), `mla-manifest`, `index`, `config`
and `final-manifest` (before each of those files is written, in that order).
"""

from __future__ import annotations

from collections.abc import Callable

HOOK: Callable[[str], None] | None = None


def crash_point(name: str) -> None:
    if HOOK is not None:
        HOOK(name)
