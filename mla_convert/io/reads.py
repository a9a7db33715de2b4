"""Source bytes read by offset into memory the caller owns (no torch): positioned reads, no
seek, no intermediate copy."""

from __future__ import annotations

import os
from pathlib import Path

from mla_convert.errors import SourceError


def read_exact(fd: int, offset: int, view: memoryview, path: Path | str, name: str) -> None:
    """Fill `view` with the file's bytes from `offset`; SourceError naming the tensor if the file
    ends first or the read fails."""
    done, want = 0, len(view)
    while done < want:
        try:
            got = os.preadv(fd, [view[done:]], offset + done)
        except OSError as e:
            raise SourceError(f"{path}: tensor {name!r}: read failed ({e.strerror or e})") from e
        if not got:
            raise SourceError(f"{path}: tensor {name!r}: file ended after {done} of {want} bytes (truncated?)")
        done += got
