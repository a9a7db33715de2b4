"""Every environment variable mla-convert reads, parsed in one place.

| variable | values | effect |
|---|---|---|
| `MLA_CONVERT_TRACEBACK` | `1`/`true`/`yes`/`on`; unset, empty, `0`/`false`/`no`/`off` | the whole Python traceback (with the chain of causes) instead of a one-line error |
| `MLA_CONVERT_KERNELS` | unset, or one of `auto`, `native`, `compile`, `eager` | what `--kernels auto` means |
| `MLA_CONVERT_PROGRESS_INTERVAL` | seconds, a positive number; default 30 | between progress lines when stderr is not a terminal |
| `MLA_CONVERT_CACHE` | a directory | where the native kernels are built and cached |
| `XDG_CACHE_HOME`, `HOME` | | the native kernels' cache when `MLA_CONVERT_CACHE` is unset: `$XDG_CACHE_HOME/mla-convert/native`, else `~/.cache/mla-convert/native` |
| `TMPDIR` | a directory | where that cache falls back to when it cannot be written: `$TMPDIR/mla-convert-UID/native` (default `/tmp`) |
| `CC` | a C compiler command | the compiler that builds the native kernels (default: `cc`, `gcc` or `clang` on PATH) |

Each function reads its variable when called, not at import, so a caller (or a test's
monkeypatch) that sets one before a run is heard. A value that cannot be parsed is an error that
names the variable and the values it takes.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from mla_convert.constants import KERNEL_MODES
from mla_convert.errors import ConvertError

TRACEBACK = "MLA_CONVERT_TRACEBACK"
KERNELS = "MLA_CONVERT_KERNELS"
PROGRESS_INTERVAL = "MLA_CONVERT_PROGRESS_INTERVAL"
CACHE = "MLA_CONVERT_CACHE"
COMPILER = "CC"

DEFAULT_PROGRESS_INTERVAL = 30.0
_ON, _OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def flag(name: str) -> bool:
    """A yes/no variable: on for 1/true/yes/on, off when unset, empty or 0/false/no/off."""
    value = os.environ.get(name, "").strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise ConvertError(f"{name}={os.environ[name]!r}: expected 1 (on) or 0 (off)")


def traceback() -> bool:
    return flag(TRACEBACK)


def kernels_auto() -> str | None:
    """What `--kernels auto` means when the variable is set (None: the default policy)."""
    value = os.environ.get(KERNELS, "").strip()
    if not value:
        return None
    if value not in KERNEL_MODES:
        raise ConvertError(f"{KERNELS}={value!r}: expected one of {', '.join(KERNEL_MODES)}")
    return value


def progress_interval() -> float:
    value = os.environ.get(PROGRESS_INTERVAL, "").strip()
    if not value:
        return DEFAULT_PROGRESS_INTERVAL
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ConvertError(f"{PROGRESS_INTERVAL}={value!r}: expected a positive number of seconds")
    return seconds


def native_cache_dir() -> Path:
    if os.environ.get(CACHE):
        return Path(os.environ[CACHE])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mla-convert" / "native"


def native_cache_fallback() -> Path:
    """Where the native kernels are cached when native_cache_dir() cannot be written (no writable
    HOME): one directory per user under the temporary directory (`TMPDIR`, else /tmp)."""
    return Path(tempfile.gettempdir()) / f"mla-convert-{os.getuid()}" / "native"


def c_compiler() -> str | None:
    """$CC as given, or None (the caller looks on PATH)."""
    return os.environ.get(COMPILER) or None
