"""`mla-convert verify`: prove a converted directory is complete, intact and numerically right.

Modules: `api` (the entry point, `verify()`), `structure` (the header pass), `stream` (each file
read once: hashes and value checks), `bounds` (the error bounds and their derivation), `report`
(tallies and the report dict), `order` (which files go first).

This `__init__` imports no torch: the CLI reads the first files ahead while torch imports.
"""

from __future__ import annotations


def __getattr__(name: str):
    if name == "verify":
        from mla_convert.verification.api import verify

        return verify
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
