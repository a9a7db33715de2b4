"""Every environment variable mla_runtime reads, parsed in one place. Standard library only.

| variable | values | effect |
|---|---|---|
| `MLA_RUNTIME_DIR` | a directory | take the artifacts from there (a Hub id is read from its cached snapshot's `mla/` otherwise) |
| `MLA_RUNTIME_DISABLE` | `1`/`true`/`yes`/`on`; default off | do nothing: vLLM computes W_UK_T / W_UV itself |
| `MLA_RUNTIME_FALLBACK` | the same; default off | on a mismatch, warn and let vLLM recompute instead of failing |
| `MLA_RUNTIME_VERIFY` | `size` (default) or `sha256` | how each layer file is checked before use |
| `MLA_RUNTIME_CHECK` | `0`/`false`/`no`/`off` to turn off; default on | the per-layer spot check against the served kv_b_proj |

Read when called, not at import. A yes/no value that is neither is an ArtifactError naming the
variable: a server started with a typo should say so, not guess.
"""

from __future__ import annotations

import os
from pathlib import Path

from .format import ArtifactError

DIR = "MLA_RUNTIME_DIR"
DISABLE = "MLA_RUNTIME_DISABLE"
FALLBACK = "MLA_RUNTIME_FALLBACK"
VERIFY = "MLA_RUNTIME_VERIFY"
CHECK = "MLA_RUNTIME_CHECK"
ALL = (DIR, DISABLE, FALLBACK, VERIFY, CHECK)  # every variable the plugin reads

VERIFY_MODES = ("size", "sha256")
_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _flag(name: str, default: bool) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise ArtifactError(f"{name}={os.environ[name]!r}: expected 1 (on) or 0 (off)")


def disabled() -> bool:
    return _flag(DISABLE, False)


def fallback() -> bool:
    return _flag(FALLBACK, False)


def spot_check() -> bool:
    return _flag(CHECK, True)


def artifacts_dir() -> Path | None:
    value = os.environ.get(DIR, "").strip()
    return Path(value) if value else None


def verify_mode() -> str:
    value = os.environ.get(VERIFY, "").strip() or "size"
    if value not in VERIFY_MODES:
        raise ArtifactError(f"{VERIFY}={value!r}: expected one of {', '.join(VERIFY_MODES)}")
    return value
