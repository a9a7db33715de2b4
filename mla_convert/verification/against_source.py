"""verify, source group (with --source): each converted tensor against the exact fp32 value of its
source tensor (the dequant of a block-FP8 weight, the widening of a 16-bit one, the (code - 8) x
scale of an INT4 one). A channel-FP8 weight must stay within the FP8 bound with a scale no larger
than its row allows, a bf16 weight must match bf16(exact) bit for bit (for an INT4 source: one
rounding of the exact product), and a copied tensor must match the source bit for bit.

The source is read by offset, in row chunks (on a block boundary of a block-FP8 source), and
compared chunk by chunk, so the working memory stays small. These are the torch forms of the
built-in comparisons (verification.comparisons declares each, with its native form); a comparison
registered from outside reads the source through `source_values` and `reader` and records through
`out`, as these do."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from mla_convert.kernels import native
from mla_convert.kernels.bits import identical, same_bits
from mla_convert.kernels.numerics import block_scale_f32, dequantize_block_fp8, dequantize_int4, to_bf16
from mla_convert.verification.bounds import (
    BF16_REL,
    FP8_REL,
    FP8_SUBNORMAL_HALF_STEP,
    FP32_SLACK,
    fp8_allowed_error,
    scale_limit,
)
from mla_convert.verification.error_stats import ErrorStats, Mismatches
from mla_convert.verification.readers import reader_backend
from mla_convert.verification.report import SOURCE, FileTally
from mla_convert.verification.rows import RowReader, row_chunks
from mla_convert.verification.tasks import TensorTask
from mla_runtime.safetensors_file import TensorInfo


@dataclass
class _Fp8Findings:
    """What comparing one channel-FP8 weight with its source gathers over its row chunks."""

    stats: ErrorStats = field(default_factory=ErrorStats)
    bad: Mismatches = field(default_factory=Mismatches)  # elements out of the FP8 bound
    big_scale: Mismatches = field(default_factory=Mismatches)  # rows whose scale is over the limit


class SourceComparisons:
    """The source comparisons of one file's tensors; `reader` reads the source tensors, `out`
    records the verdicts."""

    def __init__(self, reader: RowReader, out: FileTally, *, block: tuple[int, int] | None, fp8_max: float):
        self.reader, self.out = reader, out
        self.block = block  # the source's block size (a block-FP8 source)
        self.fp8_max = fp8_max

    def channel_fp8(self, info: TensorInfo, q: torch.Tensor, s: torch.Tensor, job: TensorTask) -> None:
        """A channel-FP8 weight with its scale against the source: the FP8 bound element-wise, and
        a scale no larger than max|row| / FP8_MAX allows (zero rows: any scale, the bound forces q = 0)."""
        if job.source is None:
            return
        findings = _Fp8Findings()
        native_pass = reader_backend().name == "native" and job.source_scale is not None
        chunk = self._fp8_chunk_native if native_pass else self._fp8_chunk_torch
        for r0, r1 in row_chunks(q.shape[0], q.shape[1], self.row_align(job)):
            chunk(job, q, s, r0, r1, findings)
        self.out.verdict(
            findings.bad,
            SOURCE,
            "fp8-bound",
            info.name,
            "|w*s - x| <= |x|*(2^-4 + 2^-20) + s*2^-10 (x: exact source dequant)",
            q.numel(),
            "out of bound: ",
        )
        self.out.verdict(
            findings.big_scale,
            SOURCE,
            "fp8-scale",
            job.scale_name,
            "s <= (max|row| + 1e-8)/FP8_MAX*(1 + 2^-10)",
            q.shape[0],
            "scale too large (value vs limit): ",
        )
        self.out.stats(info.name, "fp8", findings.stats)

    def bf16(self, info: TensorInfo, t: torch.Tensor, job: TensorTask) -> None:
        """A bf16 weight: bit-exact bf16 of the source's exact value."""
        stats, bad = ErrorStats(), Mismatches()
        for r0, r1 in row_chunks(t.shape[0], t.shape[1], self.row_align(job)):
            x = self.source_values(job, r0, r1)
            want, got = to_bf16(x), t[r0:r1]
            if not identical(got, want):
                bad.add(got, want, ~same_bits(got, want), r0)
            stats.add(got.float(), x, x.abs() * BF16_REL + 2.0**-133)  # stats only: bf16 rounding
        self.out.verdict(
            bad, SOURCE, "bf16-exact", info.name, "bit-exact bf16(fp32 dequant of the source)", t.numel(), "differs: "
        )
        self.out.stats(info.name, "bf16", stats)

    def int4_bf16(self, info: TensorInfo, t: torch.Tensor, job: TensorTask) -> None:
        """A bf16 weight from an INT4 source: bit-exact bf16 of the exact product (code - 8) x scale
        (exact in fp32), so within one bf16 rounding of it."""
        stats, bad = ErrorStats(), Mismatches()
        n, k = t.shape
        for r0, r1 in row_chunks(n, k):
            packed = self.reader.rows(job.source, r0, r1 - r0)
            x = dequantize_int4(packed, self.reader.rows(job.source_scale, r0, r1 - r0), k, job.group_size)
            want, got = to_bf16(x), t[r0:r1]
            if not identical(got, want):
                bad.add(got, want, ~same_bits(got, want), r0)
            stats.add(got.float(), x, x.abs() * BF16_REL + 2.0**-133)
        self.out.verdict(
            bad, SOURCE, "int4-bf16-exact", info.name, "bit-exact bf16((code - 8) x scale) of the source INT4",
            t.numel(), "differs: ",
        )  # fmt: skip
        self.out.stats(info.name, "bf16", stats)

    def copy(self, info: TensorInfo, t: torch.Tensor, job: TensorTask) -> None:
        """A copied tensor: the source's dtype, shape and bits."""
        if job.source.dtype != info.dtype or job.source.shape != info.shape:
            self.out.fail(
                SOURCE,
                "copy-exact",
                info.name,
                expected=f"{job.source.dtype}{list(job.source.shape)} as in the source",
                found=f"{info.dtype}{list(info.shape)}",
            )
            return
        flat = t.reshape(t.shape[0] if t.dim() else 1, -1)
        bad = Mismatches()
        for r0, r1 in row_chunks(flat.shape[0], flat.shape[1]):
            want = self.reader.rows(job.source, r0, r1 - r0).reshape(r1 - r0, -1)
            if not identical(flat[r0:r1], want):
                bad.add(flat[r0:r1], want, ~same_bits(flat[r0:r1], want), r0)
        self.out.verdict(
            bad, SOURCE, "copy-exact", info.name, "bit-exact copy of the source tensor", t.numel(), "differs: "
        )

    def _fp8_chunk_torch(self, job: TensorTask, q, s, r0: int, r1: int, findings: _Fp8Findings) -> None:
        """Rows [r0, r1) of channel_fp8, in torch."""
        x = self.source_values(job, r0, r1)
        sc = s[r0:r1]
        found = reader_backend().decode(q[r0:r1]) * sc
        abs_x = x.abs()
        ratio = findings.stats.add(found, x, fp8_allowed_error(abs_x, sc))
        if not findings.stats.chunk_bound_use <= 1:
            findings.bad.add(found, x, ~(ratio <= 1), r0)
        self._check_scale(sc, abs_x.amax(dim=1, keepdim=True), findings.big_scale, r0)

    def _fp8_chunk_native(self, job: TensorTask, q, s, r0: int, r1: int, findings: _Fp8Findings) -> None:
        """Rows [r0, r1) of channel_fp8 in one C pass (the same fp32 formulas); the torch
        formulation runs only to describe the first bad element."""
        bn = self.block[0]
        w, src_scale = self.source_rows(job, r0, r1)
        sc = s[r0:r1]
        o = native.fp8_bound_rows(q[r0:r1], sc, w, src_scale, self.block, FP8_REL + FP32_SLACK,
                                  FP8_SUBNORMAL_HALF_STEP)  # fmt: skip
        findings.stats.add_sums(float(o["dd"].sum()), float(o["xx"].sum()), float(o["yy"].sum()),
                                float(o["max_abs"].max()), float(o["max_ratio"].max()))  # fmt: skip
        n_bad = int(o["n_bad"].sum())
        if n_bad:
            row = int(torch.nonzero(o["n_bad"])[0])
            col = int(o["first_bad"][row])
            x = dequantize_block_fp8(w[row : row + 1], src_scale[row // bn : row // bn + 1], self.block)
            findings.bad.add_counted(n_bad, [r0 + row, col], float(q[r0 + row, col].float() * sc[row, 0]),
                                     float(x[0, col]))  # fmt: skip
        self._check_scale(sc, o["amax_x"].unsqueeze(1), findings.big_scale, r0)

    def _check_scale(self, sc: torch.Tensor, amax: torch.Tensor, big_scale: Mismatches, r0: int) -> None:
        """A channel scale no larger than max|row| / FP8_MAX allows (zero rows: any scale)."""
        limit = scale_limit(amax, self.fp8_max)
        big_scale.add(sc, limit, ~(sc <= limit) & (amax > 0), r0)

    def row_align(self, job: TensorTask) -> int:
        """Row chunks start on a block boundary of a block-FP8 source."""
        return self.block[0] if job.source_scale is not None else 1

    def source_rows(self, job: TensorTask, r0: int, r1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Source weight rows [r0, r1) (r0 on a block boundary) and their block-scale rows, float32."""
        bn = self.block[0]
        g0, g1 = r0 // bn, math.ceil(r1 / bn)
        scale = block_scale_f32(self.reader.rows(job.source_scale, g0, g1 - g0))
        return self.reader.rows(job.source, r0, r1 - r0), scale

    def source_values(self, job: TensorTask, r0: int, r1: int) -> torch.Tensor:
        """The exact fp32 value of source rows [r0, r1): the dequant of a block-FP8 weight, the
        widening of a 16-bit one."""
        if job.source_scale is None:
            return self.reader.rows(job.source, r0, r1 - r0).float()
        return dequantize_block_fp8(*self.source_rows(job, r0, r1), self.block, reader_backend().decode)
