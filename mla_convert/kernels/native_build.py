"""Building the C conversion kernels (fp8_kernels.c) with the host's C compiler, into a cache
keyed by source, compiler, flags and CPU (-march=native code is never served to another CPU); the
cache under HOME, or where that cannot be written one well-known directory that is this user's own.
Standard library only. Loading the built library and calling it: kernels.native."""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

from mla_convert import envs

SOURCE = Path(__file__).with_name("fp8_kernels.c")
# -ffp-contract=off: no fused multiply-add, so every operation rounds as torch's does.
# -fno-trapping-math: lets the compiler vectorize the selects (it changes no result, only FP flags).
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-trapping-math", "-std=c11", "-shared", "-fPIC", "-pthread"]
LIBS = ["-lm"]  # after the source: verify's functional MLA check takes expf


class NativeUnavailable(RuntimeError):
    pass


def cpu_id() -> str:
    """What -march=native depends on: the machine and its CPU model and feature flags."""
    wanted = ("model name", "flags", "Features", "CPU implementer", "CPU part")
    seen: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in wanted and key.strip() not in seen:
                seen[key.strip()] = value.strip()
    except OSError:
        pass
    return platform.machine() + repr(sorted(seen.items()))


def compiler() -> str:
    cc = envs.c_compiler() or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise NativeUnavailable("no C compiler found (set CC, or install gcc)")
    return cc


def build() -> Path:
    """The compiled library for this host, building it if the cache lacks it.

    The cache is envs.native_cache_dir() (under HOME); where that cannot be written (a service
    account without a writable HOME), the one well-known directory envs.native_cache_fallback()
    (this user's, under the temporary directory), so that every run and every worker finds the
    build of the first. The build's temporary file is removed however the build ends."""
    cc = compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise NativeUnavailable(f"C compiler {cc!r} does not run ({e})") from e
    key = hashlib.sha256("\0".join([SOURCE.read_text(), cc, version, *FLAGS, *LIBS, cpu_id()]).encode()).hexdigest()[
        :24
    ]
    name = f"fp8_kernels-{key}.so"
    tried = []
    try:
        preferred = [envs.native_cache_dir()]
    except (RuntimeError, KeyError):  # no HOME and no home directory in the user database
        preferred = []
    for cache in (*preferred, envs.native_cache_fallback()):
        lib = cache / name
        if lib.exists() and _trusted(cache):
            return lib
        try:
            _make_cache(cache)
            fd, tmp = tempfile.mkstemp(prefix=".fp8_kernels-", suffix=".so", dir=cache)
            os.close(fd)
        except OSError as e:  # not writable here: the next candidate
            tried.append(f"{cache}: {e.strerror or e}")
            continue
        return _compile(cc, tmp, lib)
    raise NativeUnavailable(f"no writable cache directory for the kernels ({'; '.join(tried)})")


def _make_cache(cache: Path) -> None:
    """Create the cache directory; the fallback under the shared temporary directory only as this
    user's own (mode 0700, owned by this user, not a symlink), or OSError: a library loaded from
    a directory someone else can write into would run their code."""
    if cache != envs.native_cache_fallback():
        cache.mkdir(parents=True, exist_ok=True)
        return
    cache.parent.mkdir(mode=0o700, exist_ok=True)
    cache.mkdir(mode=0o700, exist_ok=True)
    if not (_trusted(cache.parent) and _trusted(cache)):
        raise PermissionError(f"{cache.parent} is not this user's own directory")


def _trusted(cache: Path) -> bool:
    if cache not in (envs.native_cache_fallback(), envs.native_cache_fallback().parent):
        return True  # the user's own cache (HOME, XDG_CACHE_HOME, MLA_CONVERT_CACHE)
    try:
        st = os.lstat(cache)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022


def _compile(cc: str, tmp: str, lib: Path) -> Path:
    try:
        proc = subprocess.run(
            [cc, *FLAGS, str(SOURCE), *LIBS, "-o", tmp], capture_output=True, text=True, timeout=300, check=False
        )
        if proc.returncode != 0:
            detail = (proc.stderr.strip().splitlines() or ["no output"])[0][:200]
            raise NativeUnavailable(f"{Path(cc).name} failed to build the kernels: {detail}")
        os.replace(tmp, lib)  # atomic: concurrent builders each rename a complete file
    except (OSError, subprocess.SubprocessError) as e:
        raise NativeUnavailable(f"building the kernels failed ({e})") from e
    finally:
        Path(tmp).unlink(missing_ok=True)
    return lib
