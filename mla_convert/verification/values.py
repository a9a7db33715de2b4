"""verify, values group: what a tensor's own values must satisfy, without a source. No NaN/Inf in
a float tensor; FP8 codes within the target's range, every non-zero row reaching it, and no -0 where
the target reads it as NaN; channel scales finite and > 0."""

from __future__ import annotations

import torch

from mla_convert.constants import FLOAT_DTYPES, FP8_E4M3
from mla_convert.kernels import native
from mla_convert.kernels.numerics import NEGATIVE_ZERO_CODE
from mla_convert.verification.bounds import Mismatches
from mla_convert.verification.readers import fp8_readers
from mla_convert.verification.report import VALUES, FileTally
from mla_convert.verification.rows import row_chunks
from mla_runtime.safetensors_file import TensorInfo


def check_values(info: TensorInfo, t: torch.Tensor, out: FileTally, fp8_max: float, signed_zero: bool) -> None:
    """The values checks of any tensor `t` (decoded from the file, described by `info`); integer
    tensors and empty ones have none."""
    if info.dtype not in FLOAT_DTYPES or not t.numel():
        return
    if info.dtype == FP8_E4M3:
        _check_fp8_codes(info, t, out, fp8_max, signed_zero)
        return
    flat = t.reshape(t.shape[0] if t.dim() else 1, -1)
    nonfinite = Mismatches()
    if t.dtype in native.NONFINITE_MASKS and fp8_readers().count_nonfinite(flat) == 0:
        out.verdict(nonfinite, VALUES, "nan-inf", info.name, "finite values", t.numel(), "NaN/Inf in ")
        return
    for r0, r1 in row_chunks(flat.shape[0], flat.shape[1]):  # locate them (a failing tensor only)
        x = flat[r0:r1]
        if not bool(torch.isfinite(x).all()):
            nonfinite.add(x.float(), x.float(), ~torch.isfinite(x), r0)
    out.verdict(nonfinite, VALUES, "nan-inf", info.name, "finite values", t.numel(), "NaN/Inf in ")


def check_channel_scale(info: TensorInfo, t: torch.Tensor, out: FileTally) -> None:
    """A channel-FP8 weight's scale: every element finite and > 0."""
    bad = ~(torch.isfinite(t) & (t > 0))
    m = Mismatches()
    m.add(t, t, bad)
    out.verdict(m, VALUES, "fp8-scale", info.name, "finite scales > 0", t.numel())


def _check_fp8_codes(info: TensorInfo, t: torch.Tensor, out: FileTally, fp8_max: float, signed_zero: bool) -> None:
    """On the e4m3 codes, without decoding: |code| 0x7F is NaN, codes order like magnitudes,
    max|row| / FP8_MAX scaling makes every non-zero row reach exactly FP8_MAX, and a target
    without -0 (gaudi2) has no code 0x80."""
    top = int(torch.tensor(fp8_max).to(torch.float8_e4m3fn).view(torch.uint8))
    flat = t.reshape(t.shape[0] if t.dim() else 1, -1)
    nan, out_of_range, rows = Mismatches(), Mismatches(), Mismatches()
    row_max = fp8_readers().row_max_codes(flat)  # every check below reads off it
    if bool((row_max > top).any()):  # locate the bad elements (a failing tensor only)
        for r0, r1 in row_chunks(flat.shape[0], flat.shape[1]):
            codes = flat[r0:r1].view(torch.uint8) & 0x7F
            x = flat[r0:r1].float()
            nan.add(x, x, codes == 0x7F, r0)
            out_of_range.add(x, x, (codes > top) & (codes != 0x7F), r0)
    off = (row_max != top) & (row_max != 0)
    if bool(off.any()):
        for r0, r1 in row_chunks(flat.shape[0], flat.shape[1]):
            found = flat[r0:r1].float().abs().amax(dim=1)
            rows.add(found, torch.full(found.shape, fp8_max), off[r0:r1], r0)
    n = t.numel()
    out.verdict(nan, VALUES, "nan-inf", info.name, "finite values", n, "NaN in ")
    out.verdict(out_of_range, VALUES, "fp8-range", info.name, f"|w| <= {fp8_max:g}", n)
    if not signed_zero:
        minus_zero = fp8_readers().count_code(t, NEGATIVE_ZERO_CODE)
        out.expect(
            not minus_zero,
            VALUES,
            "fp8-negative-zero",
            info.name,
            expected="no -0 code (0x80): this target's readers may take 0x80 for NaN (float8_e4m3fnuz)",
            found=f"{minus_zero} of {n} codes are 0x80",
        )
    if t.dim() == 2:
        out.verdict(
            rows,
            VALUES,
            "fp8-row-max",
            info.name,
            f"max|row| = {fp8_max:g} (or an all-zero row)",
            t.shape[0],
            "rows off: ",
        )
