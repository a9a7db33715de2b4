"""Safetensors headers for mla-convert, torch-free: mla_runtime.safetensors_file's strict header
parser, its refusals raised as SourceError (the message names the file). Tensors are read by
offset in io.reader."""

from __future__ import annotations

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
