"""Safetensors files for mla-convert, torch-free: mla_runtime.safetensors_file's strict header
parser, its refusals raised as SourceError (the message names the file), and a tensor's bytes read
by offset into memory the caller owns (positioned reads, no seek, no intermediate copy)."""

from __future__ import annotations

import os
from pathlib import Path

from mla_convert.errors import SourceError
from mla_runtime import safetensors_file
from mla_runtime.safetensors_file import HeaderError, ShardHeader


def read_header(path: Path) -> ShardHeader:
    """The strict header parser (mla_runtime.safetensors_file), its refusals as SourceError."""
    try:
        return safetensors_file.read_header(path)
    except HeaderError as e:
        raise SourceError(str(e)) from e


def parse_header(path: Path, raw: bytes, file_size: int) -> ShardHeader:
    try:
        return safetensors_file.parse_header(path, raw, file_size)
    except HeaderError as e:
        raise SourceError(str(e)) from e


def header_length(path: Path, first8: bytes, file_size: int) -> int:
    try:
        return safetensors_file.header_length(path, first8, file_size)
    except HeaderError as e:
        raise SourceError(str(e)) from e


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
