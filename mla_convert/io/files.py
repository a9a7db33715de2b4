"""Crash-safe small-file output, without torch: every output file is written under a hidden
temporary name (`partial_name`), fsynced, and renamed when complete, so a file under its final
name is always whole. Shards go the same way through `shard_writer.ShardWriter`."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from mla_convert.constants import PARTIAL_SUFFIX
from mla_convert.errors import OutputError
from mla_runtime.safetensors_file import HASH_CHUNK


@dataclass(frozen=True)
class WrittenFile:
    path: Path
    size: int
    sha256: str


def partial_name(path: Path) -> Path:
    """The hidden name an output file is written under until it is complete."""
    return path.with_name(f".{path.name}{PARTIAL_SUFFIX}")


def is_partial_name(name: str) -> bool:
    return name.startswith(".") and name.endswith(PARTIAL_SUFFIX)


def discard(path: Path) -> None:
    """Remove a file this run gave up on. A read-only filesystem refuses even the removal of a file
    that was never created (EROFS, not ENOENT); that must not hide the error that got us here."""
    try:
        os.unlink(path)
    except OSError:
        pass


def write_bytes_atomic(path: Path, data: bytes) -> WrittenFile:
    """Write a small file (JSON) the same crash-safe way as shards."""
    path = Path(path)
    tmp = partial_name(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:  # Ctrl-C too: no partial file stays behind
        discard(tmp)
        if isinstance(e, OSError):
            raise OutputError(f"{path}: write failed: {e.strerror or e}") from e
        raise
    return WrittenFile(path, len(data), hashlib.sha256(data).hexdigest())


def copy_file_atomic(src: Path, dst: Path) -> WrittenFile:
    """Copy a side file under a temporary name, hashing it on the way; rename when complete."""
    dst = Path(dst)
    tmp = partial_name(dst)
    h = hashlib.sha256()
    size = 0
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        with open(src, "rb") as fi, open(tmp, "wb") as fo:
            while chunk := fi.read(HASH_CHUNK):
                fo.write(chunk)
                h.update(chunk)
                size += len(chunk)
            fo.flush()
            os.fsync(fo.fileno())
        os.replace(tmp, dst)
    except BaseException as e:  # Ctrl-C too: no partial file stays behind
        discard(tmp)
        if isinstance(e, OSError):
            raise OutputError(f"{dst}: copy from {src} failed: {e.strerror or e}") from e
        raise
    return WrittenFile(dst, size, h.hexdigest())


def files_under(root: Path) -> list[str]:
    """Every file under `root` (symlinks as themselves, never followed), relative, sorted."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        links = [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
        dirnames[:] = [d for d in dirnames if d not in links]
        out += [os.path.relpath(os.path.join(dirpath, f), root) for f in [*filenames, *links]]
    return sorted(out)
