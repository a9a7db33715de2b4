"""verify, data pass: one file read once, front to back.

Every byte goes to sha256 (integrity) and each tensor is decoded from the same buffer for the value,
source and MLA checks, so memory holds about one tensor of the file at a time. Source tensors
(and a weight's channel scale stored elsewhere) are read on demand by offset, in row chunks; the
comparisons run in row chunks too, so their working memory stays small.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import hashlib
import math
import mmap
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mla_convert.constants import FLOAT_DTYPES, FP8_E4M3
from mla_convert.io.read_ahead import will_need
from mla_convert.io.tensors import TORCH_DTYPES
from mla_convert.kernels import native
from mla_convert.kernels.bits import identical, same_bits
from mla_convert.kernels.numerics import NEGATIVE_ZERO_CODE, block_scale_f32, dequantize_block_fp8, to_bf16
from mla_convert.plan.ops import CHANNEL_FP8_OPS, COPY, FP8_SCALE, TO_BF16
from mla_convert.verification.bounds import (
    BF16_REL,
    FP8_REL,
    FP8_SUBNORMAL_HALF_STEP,
    FP32_SLACK,
    FUNCTIONAL_TOL_EXACT,
    FUNCTIONAL_TOL_FP8,
    ErrorStats,
    Mismatches,
    artifact_allowed_error,
    fp8_allowed_error,
    functional_error,
    scale_limit,
)
from mla_convert.verification.readers import fp8_readers
from mla_convert.verification.report import INTEGRITY, MLA, SOURCE, VALUES, Tally, TensorStats
from mla_runtime.format import MlaDims, w_uk_t_name, w_uv_name
from mla_runtime.layout import split_kv_b_proj
from mla_runtime.safetensors_file import DTYPE_SIZES, HASH_CHUNK, ShardHeader, TensorInfo, pread_exact

CHUNK_ELEMS = 1 << 23  # elements per row chunk in comparisons
READ_AHEAD_BYTES = 128 * 1024 * 1024  # asked of the kernel past the tensor being read
HEADS_PER_CHUNK = 8  # attention heads per chunk in the MLA artifact comparisons


@dataclass(frozen=True)
class Ref:
    """Where a tensor's bytes lie: a file, the tensor's name, the absolute offset of its data, dtype
    and shape."""

    path: str
    name: str
    offset: int
    dtype: str
    shape: tuple[int, ...]

    @classmethod
    def of(cls, path: Path, header: ShardHeader, name: str) -> Ref | None:
        t = header.tensors.get(name)
        return None if t is None else cls(str(path), name, header.data_start + t.begin, t.dtype, t.shape)


@dataclass(frozen=True)
class TensorJob:
    """What to check for one tensor beyond its values (absent: values only)."""

    op: str  # the plan's op: COPY, TO_BF16, TO_FP8, QUANT_FP8, FP8_SCALE
    scale: Ref | None = None  # channel FP8: its channel scale, when it does not follow it in this file
    scale_name: str | None = None  # channel FP8: the name of its channel scale
    source: Ref | None = None  # with --source: the source tensor
    source_scale: Ref | None = None  # with --source, block-FP8 sources: the block scale_inv


@dataclass(frozen=True)
class MlaJob:
    layer: int
    kv_b: Ref | None  # the converted model's kv_b_proj weight
    kv_b_scale: Ref | None  # ... and its channel scale (channel-FP8 output)
    source: Ref | None = None  # with --source: the source kv_b_proj and its block scale (none: 16-bit)
    source_scale: Ref | None = None


@dataclass(frozen=True)
class FileTask:
    root: str
    rel: str
    header: ShardHeader | None  # None: hash only (side files, JSON, unparseable shards)
    fp8_max: float
    signed_zero: bool = True  # the target's FP8 weights may hold -0 (constants.SIGNED_ZERO)
    block: tuple[int, int] | None = None  # the source's block size (with a block-FP8 --source)
    dims: MlaDims | None = None
    rope_dim: int = 0
    tensors: dict[str, TensorJob] = field(default_factory=dict)
    mla: MlaJob | None = None


@dataclass
class FileResult:
    rel: str
    size: int | None  # None: the file is missing
    sha256: str | None
    tally: Tally


class _ReadError(Exception):
    pass


@dataclass
class _Fp8Findings:
    """What comparing one channel-FP8 weight with its source gathers over its row chunks."""

    stats: ErrorStats = field(default_factory=ErrorStats)
    bad: Mismatches = field(default_factory=Mismatches)  # elements out of the FP8 bound
    big_scale: Mismatches = field(default_factory=Mismatches)  # rows whose scale is over the limit


class _Reader:
    """Reads row ranges of tensors by offset (source tensors, partner scales); files stay open."""

    def __init__(self) -> None:
        self.files: dict[str, int] = {}

    def rows(self, ref: Ref, first: int = 0, count: int | None = None) -> torch.Tensor:
        dtype, size = TORCH_DTYPES[ref.dtype], DTYPE_SIZES[ref.dtype]
        shape = ref.shape or (1,)
        per_row = math.prod(shape[1:]) * size
        count = shape[0] - first if count is None else count
        nbytes = count * per_row
        if ref.path not in self.files:
            try:
                self.files[ref.path] = os.open(ref.path, os.O_RDONLY)
            except OSError as e:
                raise _ReadError(f"{ref.path}: cannot open ({e.strerror or e})") from e
        if first == 0 and count < shape[0]:  # the first of several chunks: read ahead the rest
            will_need(self.files[ref.path], ref.offset, shape[0] * per_row)
        buf = bytearray(nbytes)
        try:
            pread_exact(self.files[ref.path], buf, ref.offset + first * per_row)
        except EOFError as e:
            raise _ReadError(f"{ref.path}: tensor {ref.name!r}: {e}; the file is truncated") from e
        return _decode(buf, dtype, (count, *shape[1:]))

    def close(self) -> None:
        for fd in self.files.values():
            os.close(fd)


def _decode(buf: bytearray | memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if not buf:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype).view(shape)


def _row_chunks(n_rows: int, row_elems: int, align: int = 1):
    step = max(align, (CHUNK_ELEMS // max(row_elems, 1)) // align * align)
    for r0 in range(0, n_rows, step):
        yield r0, min(n_rows, r0 + step)


def run_file_task(task: FileTask, progress: Callable[[int], None] | None = None) -> FileResult:
    """Hash one file and check every tensor in it; never raises for a bad file (records it)."""
    tally = Tally()
    h = _BackgroundSha256()
    checks = _Checks(task, tally, _thread_buffers())
    try:
        with open(Path(task.root) / task.rel, "rb") as f:
            if task.header is not None:
                _hash_and_check_tensors(f, task.header, h, checks, progress)
            while chunk := f.read(HASH_CHUNK):
                h.update(chunk)
        checks.finish()
    except FileNotFoundError:
        return FileResult(task.rel, None, None, tally)
    except (OSError, _ReadError) as e:
        tally.fail(INTEGRITY, "read", task.rel, expected="a readable file", found=str(e))
        return FileResult(task.rel, h.nbytes, None, tally)
    finally:
        checks.close()
        h.close()
    tally.bytes_read += h.nbytes
    return FileResult(task.rel, h.nbytes, h.hexdigest(), tally)


def _hash_and_check_tensors(f, header: ShardHeader, h: _BackgroundSha256, checks: _Checks, progress) -> None:
    """The header and then each tensor of the open file `f`, in file order: read once, hashed and
    checked from the same buffer."""
    h.update(f.read(header.data_start))
    for info in sorted(header.tensors.values(), key=lambda t: t.begin):
        # a cold file: this tensor and what follows are read in large requests, and the disk goes
        # on reading while this one is hashed and checked
        will_need(f.fileno(), header.data_start + info.begin, info.nbytes + READ_AHEAD_BYTES)
        buf = checks.buffers.read(f, info.nbytes)
        h.update(buf)
        if len(buf) != info.nbytes:
            raise _ReadError(f"short read of {info.name!r}: the file changed or is truncated")
        checks.tensor(info, buf)
        del buf
        if progress:
            progress(info.nbytes)


@dataclass(eq=False)
class Lease:
    """A holder's claim on the read buffer a tensor lives in: while the lease is live, the
    buffer set does not write that buffer again. The holder releases it when it drops the tensor."""

    owner: str  # the tensor kept in the buffer
    live: bool = True

    def release(self) -> None:
        self.live = False


class _ReadBuffers:
    """Two buffers, used in turn, for the tensors a thread reads: the hash of one runs while the
    next is read and checked (_BackgroundSha256 waits for it before taking the next). They are
    reused across tensors and files: a fresh buffer costs a page fault per 4 KB, more than the copy
    from the page cache. A buffer under a live lease when its turn comes again (a check keeps an MLA
    artifact, or a weight whose scale comes later) is left to its holder and replaced. Tensors over
    REUSE_BYTES (embeddings) get memory of their own, so none is held after its file."""

    REUSE_BYTES = 256 * 1024 * 1024

    def __init__(self) -> None:
        self._slots = [_new_buffer(0), _new_buffer(0)]
        self._leases: list[list[Lease]] = [[], []]  # per slot: the leases handed out on its buffer
        self._turn = 0

    def read(self, f, nbytes: int) -> memoryview:
        """The next `nbytes` of `f` (fewer at the end of the file)."""
        self._turn ^= 1
        if nbytes > self.REUSE_BYTES:
            return _read_into(f, memoryview(_new_buffer(nbytes)))
        turn = self._turn
        if any(lease.live for lease in self._leases[turn]) or len(self._slots[turn]) < nbytes:
            self._slots[turn] = _new_buffer(nbytes)
        self._leases[turn] = []
        return _read_into(f, memoryview(self._slots[turn])[:nbytes])

    def lease(self, view: memoryview, owner: str) -> Lease:
        """Lease the buffer behind `view` (returned by read) to `owner`, until it releases it. A
        tensor over REUSE_BYTES has memory of its own, which no later read writes anyway."""
        lease = Lease(owner)
        for slot, leases in zip(self._slots, self._leases, strict=True):
            if view.obj is slot:
                leases.append(lease)
        return lease


_PER_THREAD = threading.local()


def _thread_buffers() -> _ReadBuffers:
    if not hasattr(_PER_THREAD, "buffers"):
        _PER_THREAD.buffers = _ReadBuffers()
    return _PER_THREAD.buffers


def _new_buffer(nbytes: int):
    """Writable memory for `nbytes`, its pages mapped in one call (MAP_POPULATE) rather than one
    fault per 4 KB as they are first written; zero-filled like a bytearray, which is the fallback."""
    populate = getattr(mmap, "MAP_POPULATE", 0)
    if nbytes and populate:
        try:
            return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate)
        except OSError:
            pass
    return bytearray(nbytes)


def _read_into(f, view: memoryview) -> memoryview:
    pos = 0
    while pos < len(view):
        got = f.readinto(view[pos : pos + HASH_CHUNK])
        if not got:
            break
        pos += got
    return view if pos == len(view) else view[:pos]


class _BackgroundSha256:
    """sha256 on a helper thread (hashlib drops the GIL), in order, while the caller checks the
    tensor just read; at most one buffer waits, so memory stays at two tensors."""

    def __init__(self) -> None:
        self._h = hashlib.sha256()
        self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="verify-sha256")
        self._last: cf.Future | None = None
        self.nbytes = 0  # handed to update so far

    def update(self, data) -> None:
        if self._last is not None:
            self._last.result()
        self._last = self._pool.submit(self._h.update, data)
        self.nbytes += len(data)

    def hexdigest(self) -> str:
        self.close()
        return self._h.hexdigest()

    def close(self) -> None:
        if self._last is not None:
            self._last.result()
            self._last = None
        self._pool.shutdown()


class _Checks:
    """The per-tensor checks of one file, fed in file order."""

    def __init__(self, task: FileTask, tally: Tally, buffers: _ReadBuffers):
        self.task, self.tally, self.rel = task, tally, task.rel
        self.buffers = buffers  # what the file's tensors are read into
        self.reader = _Reader()
        self.pending: dict[str, tuple[TensorInfo, torch.Tensor]] = {}  # scale name -> its FP8 weight
        self.artifacts: dict[str, torch.Tensor] = {}
        self.leases: dict[str, Lease] = {}  # a kept tensor's name -> the lease on its buffer

    def tensor(self, info: TensorInfo, buf: memoryview) -> None:
        """Check one tensor, read into `buf` by self.buffers. A tensor kept for a later check (an
        MLA artifact, a weight waiting for its scale) leases `buf` until that check is done."""
        t = _decode(buf, TORCH_DTYPES[info.dtype], info.shape)
        self._values(info, t)
        kept = False
        job = self.task.tensors.get(info.name)
        if job is not None:
            try:
                kept = self._role(info, t, job)
            except _ReadError as e:
                self.tally.fail(
                    SOURCE if job.source else INTEGRITY,
                    "read",
                    self.rel,
                    info.name,
                    expected="readable input",
                    found=str(e),
                )
        if self.task.mla is not None:
            self.artifacts[info.name] = t
            kept = True
        if kept:
            self.leases[info.name] = self.buffers.lease(buf, owner=info.name)

    def _drop(self, name: str) -> None:
        """A kept tensor is no longer needed: its buffer may be read into again."""
        self.leases.pop(name).release()

    def close(self) -> None:
        """Drop what the checks kept, release its buffers for reuse, and close the source files."""
        self.pending.clear()
        self.artifacts.clear()
        for lease in self.leases.values():
            lease.release()
        self.leases.clear()
        self.reader.close()

    def finish(self) -> None:
        if self.task.mla is not None:
            try:
                self._mla(self.task.mla)
            except _ReadError as e:
                self.tally.fail(MLA, "read", self.rel, expected="readable kv_b_proj", found=str(e))

    # --- values: no source needed ---------------------------------------------------------------

    def _values(self, info: TensorInfo, t: torch.Tensor) -> None:
        if info.dtype not in FLOAT_DTYPES or not t.numel():
            return
        if info.dtype == FP8_E4M3:
            self._fp8_values(info, t)
            return
        flat = t.reshape(t.shape[0] if t.dim() else 1, -1)
        nonfinite = Mismatches()
        if t.dtype in native.NONFINITE_MASKS and fp8_readers().count_nonfinite(flat) == 0:
            self._verdict(nonfinite, VALUES, "nan-inf", info.name, "finite values", t.numel(), "NaN/Inf in ")
            return
        for r0, r1 in _row_chunks(flat.shape[0], flat.shape[1]):  # locate them (a failing tensor only)
            x = flat[r0:r1]
            if not bool(torch.isfinite(x).all()):
                nonfinite.add(x.float(), x.float(), ~torch.isfinite(x), r0)
        self._verdict(nonfinite, VALUES, "nan-inf", info.name, "finite values", t.numel(), "NaN/Inf in ")

    def _fp8_values(self, info: TensorInfo, t: torch.Tensor) -> None:
        """On the e4m3 codes, without decoding: |code| 0x7F is NaN, codes order like magnitudes,
        max|row| / FP8_MAX scaling makes every non-zero row reach exactly FP8_MAX, and a target
        without -0 (gaudi2) has no code 0x80."""
        fp8_max = self.task.fp8_max
        top = int(torch.tensor(fp8_max).to(torch.float8_e4m3fn).view(torch.uint8))
        flat = t.reshape(t.shape[0] if t.dim() else 1, -1)
        nan, out_of_range, rows = Mismatches(), Mismatches(), Mismatches()
        row_max = fp8_readers().row_max_codes(flat)  # every check below reads off it
        if bool((row_max > top).any()):  # locate the bad elements (a failing tensor only)
            for r0, r1 in _row_chunks(flat.shape[0], flat.shape[1]):
                codes = flat[r0:r1].view(torch.uint8) & 0x7F
                x = flat[r0:r1].float()
                nan.add(x, x, codes == 0x7F, r0)
                out_of_range.add(x, x, (codes > top) & (codes != 0x7F), r0)
        off = (row_max != top) & (row_max != 0)
        if bool(off.any()):
            for r0, r1 in _row_chunks(flat.shape[0], flat.shape[1]):
                found = flat[r0:r1].float().abs().amax(dim=1)
                rows.add(found, torch.full(found.shape, fp8_max), off[r0:r1], r0)
        n = t.numel()
        self._verdict(nan, VALUES, "nan-inf", info.name, "finite values", n, "NaN in ")
        self._verdict(out_of_range, VALUES, "fp8-range", info.name, f"|w| <= {fp8_max:g}", n)
        if not self.task.signed_zero:
            minus_zero = fp8_readers().count_code(t, NEGATIVE_ZERO_CODE)
            self.tally.expect(
                not minus_zero,
                VALUES,
                "fp8-negative-zero",
                self.rel,
                info.name,
                expected="no -0 code (0x80): this target's readers may take 0x80 for NaN (float8_e4m3fnuz)",
                found=f"{minus_zero} of {n} codes are 0x80",
            )
        if t.dim() == 2:
            self._verdict(
                rows,
                VALUES,
                "fp8-row-max",
                info.name,
                f"max|row| = {fp8_max:g} (or an all-zero row)",
                t.shape[0],
                "rows off: ",
            )

    def _role(self, info: TensorInfo, t: torch.Tensor, job: TensorJob) -> bool:
        """The checks of the tensor's role in the conversion. Returns whether `t` is kept for later."""
        if job.op in CHANNEL_FP8_OPS and job.source is not None and job.scale is not None:
            if job.scale_name in self.task.tensors and self.task.header.tensors[job.scale_name].begin > info.begin:
                self.pending[job.scale_name] = (info, t)  # checked when its scale streams by
                return True
            self._compare_fp8(info, t, self.reader.rows(job.scale), job)
        elif job.op == FP8_SCALE:
            bad = ~(torch.isfinite(t) & (t > 0))
            m = Mismatches()
            m.add(t, t, bad)
            self._verdict(m, VALUES, "fp8-scale", info.name, "finite scales > 0", t.numel())
            if info.name in self.pending:
                w_info, q = self.pending.pop(info.name)
                try:
                    self._compare_fp8(w_info, q, t, self.task.tensors[w_info.name])
                finally:
                    self._drop(w_info.name)
        elif job.op == TO_BF16 and job.source is not None:
            self._compare_bf16(info, t, job)
        elif job.op == COPY and job.source is not None:
            self._compare_copy(info, t, job)
        return False

    def _compare_fp8(self, info: TensorInfo, q: torch.Tensor, s: torch.Tensor, job: TensorJob) -> None:
        """A channel-FP8 weight with its scale against the source: the FP8 bound element-wise, and
        a scale no larger than max|row| / FP8_MAX allows (zero rows: any scale, the bound forces q = 0)."""
        if job.source is None:
            return
        findings = _Fp8Findings()
        native_pass = fp8_readers().name == "native" and job.source_scale is not None
        chunk = self._fp8_chunk_native if native_pass else self._fp8_chunk_torch
        for r0, r1 in _row_chunks(q.shape[0], q.shape[1], self._row_align(job)):
            chunk(job, q, s, r0, r1, findings)
        self._verdict(
            findings.bad,
            SOURCE,
            "fp8-bound",
            info.name,
            "|w*s - x| <= |x|*(2^-4 + 2^-20) + s*2^-10 (x: exact source dequant)",
            q.numel(),
            "out of bound: ",
        )
        self._verdict(
            findings.big_scale,
            SOURCE,
            "fp8-scale",
            job.scale_name,
            "s <= (max|row| + 1e-8)/FP8_MAX*(1 + 2^-10)",
            q.shape[0],
            "scale too large (value vs limit): ",
        )
        self._record(info, "fp8", findings.stats)

    def _fp8_chunk_torch(self, job: TensorJob, q, s, r0: int, r1: int, findings: _Fp8Findings) -> None:
        """Rows [r0, r1) of _compare_fp8, in torch."""
        x = self._source_values(job, r0, r1)
        sc = s[r0:r1]
        found = fp8_readers().decode(q[r0:r1]) * sc
        abs_x = x.abs()
        ratio = findings.stats.add(found, x, fp8_allowed_error(abs_x, sc))
        if not findings.stats.chunk_bound_use <= 1:
            findings.bad.add(found, x, ~(ratio <= 1), r0)
        self._check_scale(sc, abs_x.amax(dim=1, keepdim=True), findings.big_scale, r0)

    def _fp8_chunk_native(self, job: TensorJob, q, s, r0: int, r1: int, findings: _Fp8Findings) -> None:
        """Rows [r0, r1) of _compare_fp8 in one C pass (the same fp32 formulas); the torch
        formulation runs only to describe the first bad element."""
        bn = self.task.block[0]
        w, src_scale = self._source_rows(job, r0, r1)
        sc = s[r0:r1]
        o = native.fp8_bound_rows(q[r0:r1], sc, w, src_scale, self.task.block, FP8_REL + FP32_SLACK,
                                  FP8_SUBNORMAL_HALF_STEP)  # fmt: skip
        findings.stats.add_sums(float(o["dd"].sum()), float(o["xx"].sum()), float(o["yy"].sum()),
                                float(o["max_abs"].max()), float(o["max_ratio"].max()))  # fmt: skip
        n_bad = int(o["n_bad"].sum())
        if n_bad:
            row = int(torch.nonzero(o["n_bad"])[0])
            col = int(o["first_bad"][row])
            x = dequantize_block_fp8(w[row : row + 1], src_scale[row // bn : row // bn + 1], self.task.block)
            findings.bad.add_counted(n_bad, [r0 + row, col], float(q[r0 + row, col].float() * sc[row, 0]),
                                     float(x[0, col]))  # fmt: skip
        self._check_scale(sc, o["amax_x"].unsqueeze(1), findings.big_scale, r0)

    def _check_scale(self, sc: torch.Tensor, amax: torch.Tensor, big_scale: Mismatches, r0: int) -> None:
        """A channel scale no larger than max|row| / FP8_MAX allows (zero rows: any scale)."""
        limit = scale_limit(amax, self.task.fp8_max)
        big_scale.add(sc, limit, ~(sc <= limit) & (amax > 0), r0)

    def _row_align(self, job: TensorJob) -> int:
        """Row chunks start on a block boundary of a block-FP8 source."""
        return self.task.block[0] if job.source_scale is not None else 1

    def _source_rows(self, job: TensorJob, r0: int, r1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Source weight rows [r0, r1) (r0 on a block boundary) and their block-scale rows, float32."""
        bn = self.task.block[0]
        g0, g1 = r0 // bn, math.ceil(r1 / bn)
        scale = block_scale_f32(self.reader.rows(job.source_scale, g0, g1 - g0))
        return self.reader.rows(job.source, r0, r1 - r0), scale

    def _source_values(self, job: TensorJob, r0: int, r1: int) -> torch.Tensor:
        """The exact fp32 value of source rows [r0, r1): the dequant of a block-FP8 weight, the
        widening of a 16-bit one."""
        if job.source_scale is None:
            return self.reader.rows(job.source, r0, r1 - r0).float()
        return dequantize_block_fp8(*self._source_rows(job, r0, r1), self.task.block, fp8_readers().decode)

    def _compare_bf16(self, info: TensorInfo, t: torch.Tensor, job: TensorJob) -> None:
        stats, bad = ErrorStats(), Mismatches()
        for r0, r1 in _row_chunks(t.shape[0], t.shape[1], self._row_align(job)):
            x = self._source_values(job, r0, r1)
            want, got = to_bf16(x), t[r0:r1]
            if not identical(got, want):
                bad.add(got, want, ~same_bits(got, want), r0)
            stats.add(got.float(), x, x.abs() * BF16_REL + 2.0**-133)  # stats only: bf16 rounding
        self._verdict(
            bad, SOURCE, "bf16-exact", info.name, "bit-exact bf16(fp32 dequant of the source)", t.numel(), "differs: "
        )
        self._record(info, "bf16", stats)

    def _compare_copy(self, info: TensorInfo, t: torch.Tensor, job: TensorJob) -> None:
        if job.source.dtype != info.dtype or job.source.shape != info.shape:
            self.tally.fail(
                SOURCE,
                "copy-exact",
                self.rel,
                info.name,
                expected=f"{job.source.dtype}{list(job.source.shape)} as in the source",
                found=f"{info.dtype}{list(info.shape)}",
            )
            return
        flat = t.reshape(t.shape[0] if t.dim() else 1, -1)
        bad = Mismatches()
        for r0, r1 in _row_chunks(flat.shape[0], flat.shape[1]):
            want = self.reader.rows(job.source, r0, r1 - r0).reshape(r1 - r0, -1)
            if not identical(flat[r0:r1], want):
                bad.add(flat[r0:r1], want, ~same_bits(flat[r0:r1], want), r0)
        self._verdict(
            bad, SOURCE, "copy-exact", info.name, "bit-exact copy of the source tensor", t.numel(), "differs: "
        )

    def _verdict(self, bad: Mismatches, group, check, tensor, expected: str, total: int, what: str = "") -> None:
        """Record one check over a tensor: it passed when `bad` counted no element."""
        self.tally.expect(
            not bad.count, group, check, self.rel, tensor, expected=expected, found=what + bad.text(total)
        )

    def _record(self, info: TensorInfo, op: str, st: ErrorStats) -> None:
        self.tally.add_stats(TensorStats(self.rel, info.name, op, st.max_abs, st.rel_err, st.cosine, st.bound_use))

    # --- MLA artifacts -----------------------------------------------------------------------------

    def _mla(self, job: MlaJob) -> None:
        """The layer's W_UK_T and W_UV against its kv_b_proj: split, and absorbed vs naive attention."""
        dims, layer = self.task.dims, job.layer
        uk, uv = self.artifacts.get(w_uk_t_name(layer)), self.artifacts.get(w_uv_name(layer))
        for name, a, shape in (
            (w_uk_t_name(layer), uk, dims.w_uk_t_shape()),
            (w_uv_name(layer), uv, dims.w_uv_shape()),
        ):
            if a is None or a.dtype != torch.bfloat16 or tuple(a.shape) != shape:
                found = "missing" if a is None else f"{a.dtype}{list(a.shape)}"
                self.tally.fail(MLA, "artifact", self.rel, name, expected=f"bfloat16{list(shape)}", found=found)
                return
        reference = self._mla_reference(job)
        if reference is None:
            self.tally.fail(
                MLA,
                "reference",
                self.rel,
                f"layer {layer}",
                expected="a kv_b_proj to compare with",
                found="none usable (see the structure failures)",
            )
            return
        x, s, what = reference
        if tuple(x.shape) != dims.kv_b_shape():
            self.tally.fail(
                MLA,
                "reference",
                self.rel,
                f"layer {layer}",
                expected=f"kv_b_proj {list(dims.kv_b_shape())}",
                found=list(x.shape),
            )
            return
        self._compare_split(layer, (uk, uv), x, s, what)
        tol = FUNCTIONAL_TOL_EXACT if s is None else FUNCTIONAL_TOL_FP8
        err = functional_error(uk, uv, x, dims, self.task.rope_dim, seed=layer)
        self.tally.expect(
            err <= tol,
            MLA,
            "functional",
            self.rel,
            f"layer {layer}",
            expected=f"absorbed decode == naive attention within relative error {tol:g}",
            found=f"relative error {err:.3g}",
        )

    def _mla_reference(self, job: MlaJob) -> tuple[torch.Tensor, torch.Tensor | None, str] | None:
        """The kv_b_proj the artifacts are compared with, fp32: (x, its channel scale when x is the
        stored channel-FP8 kv_b_proj (the artifacts are then within a bound of it, else bit-exact
        splits of it), what it is); None when there is none to use."""
        if job.source is not None and job.source_scale is None:
            return self.reader.rows(job.source).float(), None, "split_kv_b_proj(the source's 16-bit kv_b_proj)"
        if job.source is not None:
            scale = block_scale_f32(self.reader.rows(job.source_scale))
            x = dequantize_block_fp8(self.reader.rows(job.source), scale, self.task.block)
            return x, None, "split_kv_b_proj(exact fp32 dequant of the source kv_b_proj)"
        if job.kv_b is not None and job.kv_b.dtype == "BF16":
            return self.reader.rows(job.kv_b), None, "split_kv_b_proj(the stored bf16 kv_b_proj)"
        if job.kv_b is not None and job.kv_b.dtype == FP8_E4M3 and job.kv_b_scale is not None:
            s = self.reader.rows(job.kv_b_scale)
            x = fp8_readers().decode(self.reader.rows(job.kv_b)).mul_(s)
            return x, s, "within the artifact bound of the stored channel-FP8 kv_b_proj"
        return None

    def _compare_split(self, layer: int, artifacts, x: torch.Tensor, scale: torch.Tensor | None, what: str) -> None:
        """W_UK_T / W_UV against split_kv_b_proj(x): bit-exact, or within the artifact bound of a
        channel-FP8 x with its `scale`. A few heads at a time: whole-layer fp32 temporaries cost
        more in page faults than in arithmetic."""
        dims, per_head = self.task.dims, self.task.dims.qk_nope_head_dim + self.task.dims.v_head_dim
        names, bad = (w_uk_t_name(layer), w_uv_name(layer)), (Mismatches(), Mismatches())
        for h0 in range(0, dims.num_heads, HEADS_PER_CHUNK):
            h1 = min(dims.num_heads, h0 + HEADS_PER_CHUNK)
            part, rows = dataclasses.replace(dims, num_heads=h1 - h0), slice(h0 * per_head, h1 * per_head)
            if scale is None:
                for m, a, want in zip(bad, artifacts, split_kv_b_proj(x[rows], part, torch.bfloat16), strict=True):
                    m.add(a[h0:h1], want, ~same_bits(a[h0:h1], want), h0)
                continue
            ref = split_kv_b_proj(x[rows], part, torch.float32)
            # a row's scale laid out as a one-column kv_b_proj: [h, P, 1] and [h, 1, V], which broadcast
            scale_layout = split_kv_b_proj(scale[rows], dataclasses.replace(part, kv_lora_rank=1), torch.float32)
            for m, a, want, sc in zip(bad, artifacts, ref, scale_layout, strict=True):
                af = a[h0:h1].float()
                m.add(af, want, ~((af - want).abs() <= artifact_allowed_error(af, sc)), h0)
        for name, a, m in zip(names, artifacts, bad, strict=True):
            if scale is None:
                self._verdict(m, MLA, "split-exact", name, f"bit-exact {what}", a.numel(), "differs: ")
            else:
                self._verdict(m, MLA, "split-bound", name, what, a.numel(), "out of bound: ")
