"""verify, the checks of a tensor on the bytes read, in the native kernels (no torch).

Each method decides one tensor's checks (the native forms of its comparison with the source, a
layer's MLA checks; the value checks' own are in verification.values, beside their torch forms,
reading the rows' maxima from here) from the buffer it was read into and, where it needs them, the
source tensors and partner scales read by offset into this thread's reused buffers. Where every
check passes it returns True, and the caller counts the checks the declaration names
(verification.comparisons.Comparison.checks; the MLA check counts its own). Anything else (a check that fails, a case it does not
cover: a bf16 output's comparison with its source, INT4, E8M0 block scales, a 16-bit kv_b_proj)
returns False having recorded nothing: the caller then runs the torch path (data_pass), which
describes the failure. So a failing tensor's report is the torch path's, word for word, and torch is
imported only where one is met.

Used only where the native readers passed their probes (readers.reader_backend, reader_probes).
"""

from __future__ import annotations

import math

from mla_convert.constants import FP8_E4M3
from mla_convert.io.buffers import Buffer, address_of, scratch
from mla_convert.io.reader import Reader, Ref
from mla_convert.kernels import native
from mla_convert.kernels.transforms import mla_split
from mla_convert.plan.ops import COPY_OPS
from mla_convert.verification.bounds import (
    ARTIFACT_REL,
    FP8_REL,
    FP8_SUBNORMAL_HALF_STEP,
    FP32_SLACK,
    FUNCTIONAL_TOL_EXACT,
    FUNCTIONAL_TOL_FP8,
    SCALE_EPS,
    SCALE_REL,
)
from mla_convert.verification.error_stats import ErrorStats
from mla_convert.verification.reference_mla import FUNCTIONAL_CACHE, FUNCTIONAL_QUERIES
from mla_convert.verification.report import MLA, FileTally
from mla_convert.verification.rows import CHUNK_ELEMS
from mla_convert.verification.tasks import MlaTask, TensorTask
from mla_runtime.format import MlaDims, w_uk_t_name, w_uv_name
from mla_runtime.safetensors_file import TensorInfo

_OUTS = ("dd", "xx", "yy", "max_abs", "max_ratio", "n_bad", "first_bad", "amax_x")  # mla_fp8_bound_rows


def e4m3_value(code: int) -> float:
    em = code & 0x7F
    value = em * 2.0**-9 if em < 8 else (1 + (em & 7) / 8) * 2.0 ** ((em >> 3) - 7)
    return -value if code & 0x80 else value


def top_code(fp8_max: float) -> int | None:
    """The e4m3fn code of +fp8_max; None where it has none (the torch path then decides)."""
    return next((c for c in range(0x7F) if e4m3_value(c) == fp8_max), None)


def _addr(view: memoryview) -> int:
    return address_of(view)


class NativePass:
    """The native checks of one file's tensors (see the module docstring)."""

    def __init__(self, out: FileTally, reader: Reader, *, fp8_max: float, block, dims, rope_dim: int):
        self.out, self.fp8_max, self.block = out, fp8_max, block
        self.dims: MlaDims | None = dims
        self.rope_dim = rope_dim
        self.top = top_code(fp8_max)  # the code every non-zero row of a channel-FP8 weight reaches
        self.reader = reader  # the file's (data_pass): source tensors and partner scales read by offset
        self.scratch = scratch()  # this thread's reused buffers (source, source_scale, partner, rows, ...)

    # ---- values (verification.values: each check's native form) ----------------------------------

    def fp8_row_maxima(self, info: TensorInfo, view: memoryview) -> bytes:
        """Each row's largest |code| of the e4m3fn tensor in `view` (rows: its first dimension)."""
        n = math.prod(info.shape)
        rows = info.shape[0] if info.shape else 1
        maxima = self.scratch.rows.view(rows)
        native.row_max_codes_at(_addr(view), rows, n // rows, _addr(maxima))
        return maxima.tobytes()

    # ---- against the source ----------------------------------------------------------------------

    def channel_fp8(self, info: TensorInfo, q: memoryview, scale: memoryview | None, job: TensorTask) -> bool:
        """SourceComparisons.channel_fp8 of a weight against its block-FP8 source (scale: its channel
        scale's bytes, or None to read it by job.scale)."""
        src, src_scale, block = job.source, job.source_scale, self.block
        if src is None or src_scale is None or block is None or job.scale is None:
            return False
        n, k = info.shape if len(info.shape) == 2 else (0, 0)
        grid = (-(-n // block[0]), -(-k // block[1]))
        if (
            not n or not k or info.dtype != FP8_E4M3 or src.dtype != FP8_E4M3 or tuple(src.shape) != (n, k)
            or src_scale.dtype != "F32" or tuple(src_scale.shape) != grid or job.scale.dtype != "F32"
            or math.prod(job.scale.shape) != n
        ):  # fmt: skip
            return False
        if scale is None:
            scale = self._read(job.scale, 0, 1, self.scratch.partner, row_bytes=n * 4)
        if len(scale) != n * 4:
            return False
        stats = ErrorStats()
        q_addr, sc_addr = _addr(q), _addr(scale)
        bn = block[0]
        step = max(bn, (CHUNK_ELEMS // k) // bn * bn)
        for r0 in range(0, n, step):
            r1 = min(n, r0 + step)
            rows = r1 - r0
            w = self._read(src, r0, rows, self.scratch.source, row_bytes=k)
            g0, g1 = r0 // bn, -(-r1 // bn)
            s = self._read(src_scale, g0, g1 - g0, self.scratch.source_scale, row_bytes=grid[1] * 4)
            outs = self.scratch.outs.view(8 * 8 * rows)
            base = _addr(outs)
            ptrs = [base + i * 8 * rows for i in range(8)]
            native.fp8_bound_rows_at(q_addr + r0 * k, sc_addr + r0 * 4, _addr(w), _addr(s), k, block,
                                     FP8_REL + FP32_SLACK, FP8_SUBNORMAL_HALF_STEP, ptrs, rows)  # fmt: skip
            dd, xx, yy, max_abs, max_ratio, n_bad = native.bound_totals(ptrs, rows)
            if n_bad:
                return False
            over, near = native.scale_over_limit(sc_addr + r0 * 4, ptrs[_OUTS.index("amax_x")], rows, SCALE_EPS,
                                                 self.fp8_max, SCALE_REL)  # fmt: skip
            if over or near:
                return False
            stats.add_sums(dd, xx, yy, max_abs, max_ratio)
        self.out.stats(info.name, "fp8", stats)
        return True

    def copy(self, info: TensorInfo, view: memoryview, job: TensorTask, at: int = 0) -> bool:
        """SourceComparisons.copy: the source tensor's dtype, shape and bytes (`view`: the tensor's
        bytes from byte `at`, compared with the source's there)."""
        src = job.source
        if job.op not in COPY_OPS or src is None or src.dtype != info.dtype or tuple(src.shape) != tuple(info.shape):
            return False
        nbytes = len(view)
        if not nbytes:
            return True
        chunk = 64 * 1024 * 1024
        addr = _addr(view)
        for start in range(0, nbytes, chunk):
            m = min(chunk, nbytes - start)
            got = self._read_bytes(src, at + start, m, self.scratch.source)
            if native.first_difference(addr + start, _addr(got), m) >= 0:
                return False
        return True

    # ---- MLA -------------------------------------------------------------------------------------

    def mla(self, job: MlaTask, artifacts: dict[str, tuple[TensorInfo, memoryview]]) -> bool:
        """MlaChecks.layer: the split (bit-exact against a block-FP8 source's dequant, within the
        artifact bound of a stored channel-FP8 kv_b_proj) and the functional check."""
        dims = self.dims
        if dims is None:
            return False
        uk, uv = artifacts.get(w_uk_t_name(job.layer)), artifacts.get(w_uv_name(job.layer))
        for a, shape in ((uk, dims.w_uk_t_shape()), (uv, dims.w_uv_shape())):
            if a is None or a[0].dtype != "BF16" or tuple(a[0].shape) != shape:
                return False
        rows, l = dims.kv_b_shape()
        uk_addr, uv_addr = _addr(uk[1]), _addr(uv[1])
        ref = self.scratch.ref.view(rows * l * 4)  # the fp32 kv_b_proj for the functional check
        if job.source is not None and job.source_scale is not None and self.block is not None:
            src, sc, block = job.source, job.source_scale, self.block
            grid = (-(-rows // block[0]), -(-l // block[1]))
            if src.dtype != FP8_E4M3 or tuple(src.shape) != (rows, l) or sc.dtype != "F32" or tuple(sc.shape) != grid:
                return False
            w = self._read(src, 0, rows, self.scratch.source, row_bytes=l)
            s = self._read(sc, 0, grid[0], self.scratch.source_scale, row_bytes=grid[1] * 4)
            split = self.scratch.split.view(len(uk[1]) + len(uv[1]))
            mine_uk, mine_uv = _addr(split), _addr(split) + len(uk[1])
            mla_split.split_fp8(_addr(w), _addr(s), block, dims, mine_uk, mine_uv)
            if native.first_difference(uk_addr, mine_uk, len(uk[1])) >= 0:
                return False
            if native.first_difference(uv_addr, mine_uv, len(uv[1])) >= 0:
                return False
            native.dequant_rows_at(_addr(w), _addr(s), l, block, _addr(ref), rows)
            tol = FUNCTIONAL_TOL_EXACT
        elif job.source is None and job.kv_b is not None and job.kv_b.dtype == FP8_E4M3 and job.kv_b_scale is not None:
            kv_b, kv_s = job.kv_b, job.kv_b_scale
            if tuple(kv_b.shape) != (rows, l) or kv_s.dtype != "F32" or math.prod(kv_s.shape) != rows:
                return False
            q = self._read(kv_b, 0, rows, self.scratch.source, row_bytes=l)
            s = self._read(kv_s, 0, 1, self.scratch.source_scale, row_bytes=rows * 4)
            if native.artifact_bound(_addr(q), _addr(s), uk_addr, uv_addr, dims, ARTIFACT_REL,
                                     FP8_SUBNORMAL_HALF_STEP):  # fmt: skip
                return False
            native.dequant_rows_at(_addr(q), _addr(s), l, (1, l), _addr(ref), rows)
            tol = FUNCTIONAL_TOL_FP8
        else:
            return False  # a 16-bit kv_b_proj, or none usable: the torch path
        err = native.functional_error(_addr(ref), uk_addr, uv_addr, dims, self.rope_dim, FUNCTIONAL_QUERIES,
                                      FUNCTIONAL_CACHE, self._functional_inputs(job.layer))  # fmt: skip
        if not err <= tol:
            return False
        self.out.tally.ok(MLA, 3)
        return True

    def _functional_inputs(self, seed: int) -> tuple[int, int, int, int]:
        """q_nope, q_pe, latent, k_pe for the layer (reader_probes.functional_inputs: one stream)."""
        d, r, b, t = self.dims, self.rope_dim, FUNCTIONAL_QUERIES, FUNCTIONAL_CACHE
        sizes = [b * d.num_heads * d.qk_nope_head_dim, b * d.num_heads * r, t * d.kv_lora_rank, t * r]
        buf = self.scratch.inputs.view(4 * sum(sizes))
        base = _addr(buf)
        native.normal_fill(seed, base, sum(sizes))
        starts = [base + 4 * sum(sizes[:i]) for i in range(4)]
        return tuple(starts)

    # ---- reads -----------------------------------------------------------------------------------

    def _read(self, ref: Ref, first: int, count: int, buf: Buffer, *, row_bytes: int) -> memoryview:
        """Rows [first, first + count) of `ref` (row_bytes each) into `buf`: its view."""
        return self._read_bytes(ref, first * row_bytes, count * row_bytes, buf)

    def _read_bytes(self, ref: Ref, start: int, nbytes: int, buf: Buffer) -> memoryview:
        return self.reader.read(ref, buf.view(nbytes), start)
