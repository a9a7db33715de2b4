"""The native kernels' check, remembered per machine (no torch here).

kernels.fastest checks the native kernels bit-identical to eager torch on the probe set before they
convert anything. That needs torch, whose import costs a CPU-second or two per process. A check
that passed is recorded here under a key of everything its outcome depends on:

- the built library's bytes (its build key already covers source, compiler, flags and CPU);
- torch's version file (`torch/version.py`: version and git commit), found without importing torch;
- the sources of this package: the transforms (kernels.transforms: definitions, probes, native
  entries), the arithmetic they share (numerics), the probe set (probes), the comparison (bits,
  fastest) and the calls into the library (native, modes);
- this CPU, and the check's parameters (block, FP8 range, zero rule, ops).

A later process with the same key uses the native kernels without checking again, so without
torch (kernels.modes.cached_native). Anything that changes a part of the key checks again, with
torch; a check that fails removes the record. Records live beside the built library, in
`verdicts/` of the native cache, one small JSON file each.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import time
from pathlib import Path

from mla_convert.kernels import native, native_build
from mla_convert.process import resources

FORMAT = 1
_SOURCES = ("numerics.py", "probes.py", "bits.py", "fastest.py", "native.py", "modes.py", "verdict.py")
_BASES = "kernels.verdict.bases"  # the run's slot: by library file, the hash of the library, the sources and the CPU


def torch_version_file() -> bytes:
    """torch/version.py of the torch this process would import, read without importing it."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        raise native.NativeUnavailable("torch is not installed")
    try:
        return (Path(next(iter(spec.submodule_search_locations))) / "version.py").read_bytes()
    except OSError as e:
        raise native.NativeUnavailable(f"cannot read torch's version ({e})") from e


def key(block: tuple[int, int], fp8_max: float, signed_zero: bool, ops: tuple[str, ...], extra=()) -> str:
    """The record's key for a check with these parameters (builds or loads the library first);
    `extra`: more source files the check depends on (verify's probes of its readers)."""
    lib = native.library_path()
    bases = resources.current().slot(_BASES, dict)
    if str(lib) not in bases:
        h = hashlib.sha256(f"mla-convert kernel verdict {FORMAT}\0".encode())
        h.update(lib.read_bytes())
        here = Path(__file__).parent
        sources = [here / name for name in _SOURCES] + sorted((here / "transforms").glob("*.py"))
        for path in sources:
            h.update(str(path.relative_to(here)).encode() + b"\0" + path.read_bytes())
        h.update(native_build.cpu_id().encode())
        bases[str(lib)] = h.digest()
    params = (tuple(block), float(fp8_max), bool(signed_zero), tuple(sorted(ops)))
    h = hashlib.sha256(bases[str(lib)])
    h.update(torch_version_file())
    h.update(repr(params).encode())
    for path in extra:
        h.update(Path(path).name.encode() + b"\0" + Path(path).read_bytes())
    return h.hexdigest()[:32]


def _path(k: str) -> Path:
    return native.library_path().parent / "verdicts" / f"{k}.json"


def lookup(k: str) -> str | None:
    """What the record of a passed check says (for the summary), or None where there is none."""
    try:
        record = json.loads(_path(k).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("passed") is not True or record.get("key") != k:
        return None
    ops, torch_version = record.get("ops", []), record.get("torch", "?")
    if not (isinstance(ops, list) and all(isinstance(op, str) for op in ops) and isinstance(torch_version, str)):
        return None  # damaged: the check runs again
    return f"{', '.join(ops)} checked bit-identical to eager (torch {torch_version}) on this machine"


def record(k: str, passed: bool, ops: tuple[str, ...], torch_version: str) -> None:
    """Remember a check's outcome: a pass is written (atomically), a failure removes any record.
    A cache that cannot be written only means the next run checks again."""
    path = _path(k)
    try:
        if not passed:
            path.unlink(missing_ok=True)
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        body = {"key": k, "passed": True, "ops": list(ops), "torch": torch_version, "checked": time.time()}
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(body) + "\n")
        os.replace(tmp, path)
    except OSError:
        pass


def forget() -> None:
    """Forget the hashes of the libraries seen (a test that rebuilds one in place)."""
    resources.current().release(_BASES)
