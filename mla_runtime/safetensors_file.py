"""Safetensors at the byte level, without torch: header length and strict header parsing, the
header a writer puts first, tensor info and dtype sizes, file hashing, and exact positioned reads.

The one implementation of these details for both packages: `mla_convert` reads sources, writes
outputs and verifies them with it, `mla_runtime` reads the MLA artifacts with it. Standard library
only, so it can run while torch is still importing.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

# safetensors dtype string -> bytes per element
DTYPE_SIZES: dict[str, int] = {
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,  # float8_e8m0fnu: block scales stored as a power-of-two exponent
    "BF16": 2,
    "F16": 2,
    "F32": 4,
    "F64": 8,
    "I8": 1,
    "U8": 1,
    "I16": 2,
    "I32": 4,
    "I64": 8,
    "BOOL": 1,
}
MAX_HEADER_BYTES = 100 * 1024 * 1024  # a larger header is corruption, not a checkpoint
HASH_CHUNK = 64 * 1024 * 1024


class HeaderError(ValueError):
    """A file that a safe reader must refuse; the message names the file and what is wrong."""


class TruncatedRead(EOFError):
    """A positioned read that met the end of the file: `done` of the `want` bytes asked for at `offset`."""

    def __init__(self, done: int, want: int, offset: int):
        super().__init__(f"file ended after {done} of {want} bytes at offset {offset}")
        self.done, self.want, self.offset = done, want, offset

    def __reduce__(self):
        return type(self), (self.done, self.want, self.offset)


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]
    begin: int  # offsets relative to the start of the data section
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ShardHeader:
    path: Path
    tensors: dict[str, TensorInfo]
    data_start: int  # byte offset of the data section in the file
    file_size: int
    header_bytes: bytes  # the raw JSON header, for fingerprints
    metadata: dict


def nbytes_of(dtype: str, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * DTYPE_SIZES[dtype]


def read_header(path: str | Path, *, fd: int | None = None) -> ShardHeader:
    """Parse and validate a safetensors file's header without reading tensor data.

    With `fd` (an open descriptor of `path`) the header is read through it, so read-ahead advice
    the caller gave on it applies; otherwise `path` is opened for the read and closed.

    Raises HeaderError naming the file for anything a safe reader must refuse: short file, header
    length out of range, bad JSON, unknown dtype, size/shape mismatch, offsets out of range,
    overlapping or non-contiguous tensors, bytes after the last tensor; or a failed read.
    """
    path = Path(path)
    try:
        if fd is None:
            fd = os.open(path, os.O_RDONLY)
            try:
                return _read_header_at(path, fd)
            finally:
                os.close(fd)
        return _read_header_at(path, fd)
    except OSError as e:
        raise HeaderError(f"{path}: cannot read ({e.strerror or e})") from e


def _read_header_at(path: Path, fd: int) -> ShardHeader:
    file_size = os.fstat(fd).st_size
    try:
        first8 = bytearray(min(8, file_size))
        pread_exact(fd, first8, 0)
        raw = bytearray(header_length(path, bytes(first8), file_size))
        pread_exact(fd, raw, 8)
    except EOFError as e:  # shorter than fstat said: cut while being read
        raise HeaderError(f"{path}: truncated safetensors file (it shrank while its header was read)") from e
    return parse_header(path, bytes(raw), file_size)


def header_length(path: Path, first8: bytes, file_size: int) -> int:
    """The JSON header length from a file's first 8 bytes, checked against the file size."""
    if len(first8) < 8:
        raise HeaderError(f"{path}: truncated safetensors file ({file_size} bytes, no header)")
    (n,) = struct.unpack("<Q", first8[:8])
    if n == 0 or n > MAX_HEADER_BYTES or 8 + n > file_size:
        raise HeaderError(
            f"{path}: corrupt safetensors header length {n} (file is {file_size} bytes); "
            "the file is truncated or not a safetensors file"
        )
    return n


def parse_header(path: Path, raw: bytes, file_size: int) -> ShardHeader:
    """Validate the JSON header `raw` of a safetensors file of `file_size` bytes (local or remote)."""
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HeaderError(f"{path}: corrupt safetensors header (not JSON: {e})") from e
    if not isinstance(header, dict):
        raise HeaderError(f"{path}: corrupt safetensors header (not a JSON object)")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise HeaderError(f"{path}: corrupt safetensors header (__metadata__ is not an object)")
    data_start = 8 + len(raw)
    data_len = file_size - data_start
    tensors = {name: _tensor_info(path, name, entry, data_len) for name, entry in header.items()}
    pos = 0
    for t in sorted(tensors.values(), key=lambda t: (t.begin, t.end)):
        if t.begin != pos:
            kind = "overlaps the previous tensor" if t.begin < pos else "leaves a gap before it"
            raise HeaderError(f"{path}: tensor {t.name!r} at offset {t.begin} {kind} (expected {pos})")
        pos = t.end
    if pos != data_len:
        raise HeaderError(
            f"{path}: data section is {data_len} bytes but the tensors cover {pos}"
            + ("; the file is truncated" if pos > data_len else "; trailing bytes after the last tensor")
        )
    return ShardHeader(path, tensors, data_start, file_size, raw, metadata)


def _tensor_info(path: Path, name: str, entry: object, data_len: int) -> TensorInfo:
    if not isinstance(entry, dict):
        raise HeaderError(f"{path}: tensor {name!r}: header entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise HeaderError(f"{path}: tensor {name!r}: unsupported dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise HeaderError(f"{path}: tensor {name!r}: bad shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise HeaderError(f"{path}: tensor {name!r}: bad data_offsets {offsets!r}")
    begin, end = offsets
    if end > data_len:
        raise HeaderError(
            f"{path}: tensor {name!r} ends at {end} but the data section has {data_len} bytes; the file is truncated"
        )
    expected = nbytes_of(dtype, tuple(shape))
    if end - begin != expected:
        raise HeaderError(f"{path}: tensor {name!r}: {end - begin} bytes for {dtype}{shape}, expected {expected}")
    return TensorInfo(name, dtype, tuple(shape), begin, end)


def encode_header(specs: dict[str, tuple[str, tuple[int, ...]]], metadata: dict[str, str]) -> bytes:
    """The bytes before the data section of a file holding `specs` (name -> dtype, shape) back to
    back in that order: the 8-byte length and the compact JSON header, padded with spaces so the
    data starts at a multiple of 8."""
    header: dict[str, object] = {"__metadata__": dict(metadata)}
    pos = 0
    for name, (dtype, shape) in specs.items():
        size = nbytes_of(dtype, shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + size]}
        pos += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw


class FileDigest(NamedTuple):
    size: int  # bytes read
    sha256: str  # hex digest


def file_digest(path: str | Path, chunk: int = HASH_CHUNK) -> FileDigest:
    """The size and sha256 of a whole file, read front to back."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
            size += len(block)
    return FileDigest(size, h.hexdigest())


def pread_exact(fd: int, buf, offset: int) -> None:
    """Fill the writable buffer `buf` from `fd` at `offset`, looping over short reads.

    Raises TruncatedRead (an EOFError) when the file ends first (a truncated file), naming how far it got.
    """
    view = memoryview(buf).cast("B")
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise TruncatedRead(done, len(view), offset)
        done += got
