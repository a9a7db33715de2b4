"""verify, values group: what a tensor's own values must satisfy, without a source. Each check is
declared once (`ValueCheck`, in CHECKS): the tensors it applies to, the targets it applies for, its
torch form and its native form side by side. Which checks a conversion's tensors get is its
format's (formats.Format.value_checks) and its target's: `selected`. The built-in ones: no NaN/Inf
in a float tensor; FP8 codes within the target's range, no -0 where the target reads it as NaN,
every non-zero row reaching FP8_MAX (channel FP8's max|row| / FP8_MAX scaling); scales finite and
> 0. `register` adds one (a format added from outside, docs/adding-a-verify-check.md).

A tensor's checks run first in their native forms on the bytes read (no torch: a form returns True
where its check passes, False where it fails or is not covered); where all pass they are counted,
one each. Otherwise every torch form runs and records its own verdict, so that a failing tensor's
report is the torch path's, word for word. No torch at import: the native path never imports it.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mla_convert.constants import FLOAT_DTYPES, FP8_E4M3
from mla_convert.formats import Target
from mla_convert.io.buffers import address_of
from mla_convert.kernels import native
from mla_convert.kernels.bits import NONFINITE
from mla_convert.registry import Registry
from mla_convert.verification.error_stats import Mismatches
from mla_convert.verification.readers import reader_backend
from mla_convert.verification.report import VALUES, FileTally
from mla_convert.verification.rows import row_chunks
from mla_runtime.safetensors_file import TensorInfo

if TYPE_CHECKING:
    import torch

NEGATIVE_ZERO_CODE, NAN_CODE = 0x80, 0x7F  # e4m3fn: -0, and |code| 0x7F is NaN


class TorchValues:
    """One tensor on the torch path: the tensor, where its verdicts go, and what several checks
    read, computed once."""

    def __init__(self, info: TensorInfo, t: torch.Tensor, out: FileTally, fp8_max: float):
        self.info, self.t, self.out, self.fp8_max = info, t, out, fp8_max
        self.n = t.numel()
        self.flat = t.reshape(t.shape[0] if t.dim() else 1, -1)

    @functools.cached_property
    def top(self) -> int:
        import torch

        return int(torch.tensor(self.fp8_max).to(torch.float8_e4m3fn).view(torch.uint8))

    @functools.cached_property
    def row_max(self) -> torch.Tensor:
        """Each row's largest |code| (e4m3: codes order like magnitudes, 0x7F is NaN)."""
        return reader_backend().row_max_codes(self.flat)

    def located(self, bad: Callable, rows=None) -> Mismatches:
        """The elements `bad(codes & 0x7F, values)` flags, counted over row chunks (a failing tensor
        only: `rows`, when given, says whether any row holds one)."""
        import torch

        found = Mismatches()
        if rows is not None and not bool(rows.any()):
            return found
        for r0, r1 in row_chunks(self.flat.shape[0], self.flat.shape[1]):
            x = self.flat[r0:r1].float()
            found.add(x, x, bad(self.flat[r0:r1].view(torch.uint8) & 0x7F, x), r0)
        return found


class NativeValues:
    """One tensor on the native path: its bytes, and what several checks read, computed once
    (`checks`: the file's verification.native_pass.NativePass, whose scratch memory they use)."""

    def __init__(self, info: TensorInfo, view: memoryview, checks):
        self.info, self.view, self.checks = info, view, checks
        self.n = math.prod(info.shape)
        self.addr = address_of(view)

    @functools.cached_property
    def row_max(self) -> bytes:
        """Each row's largest |code| of an FP8 tensor."""
        return self.checks.fp8_row_maxima(self.info, self.view)


@dataclass(frozen=True)
class ValueCheck:
    name: str  # as the report names it
    applies: Callable[[TensorInfo, bool], bool]  # (the tensor, whether it is a weight's scale)
    torch: Callable[[TorchValues], None]  # records its verdict, describing a failure
    native: Callable[[NativeValues], bool] | None = None  # True: it passes; False: ask torch
    for_target: Callable[[Target], bool] = lambda target: True
    # Its native form passes on a tensor exactly where it passes on each run of the tensor's rows
    # (a check of each element or each row): a large tensor is then checked as it is read, a chunk
    # of rows at a time (stream), rather than read whole into memory of its own.
    by_rows: bool = False


# ---- the checks: each one's torch form, then its native form ----------------------------------


def _float(info: TensorInfo, is_scale: bool) -> bool:
    return info.dtype in FLOAT_DTYPES and math.prod(info.shape) > 0


def _fp8(info: TensorInfo, is_scale: bool) -> bool:
    return info.dtype == FP8_E4M3 and math.prod(info.shape) > 0


def _nan_inf_torch(v: TorchValues) -> None:
    import torch

    if v.info.dtype == FP8_E4M3:
        nan = v.located(lambda codes, x: codes == NAN_CODE, v.row_max == NAN_CODE)
        v.out.verdict(nan, VALUES, "nan-inf", v.info.name, "finite values", v.n, "NaN in ")
        return
    nonfinite = Mismatches()
    if v.t.dtype in native.NONFINITE_MASKS and reader_backend().count_nonfinite(v.flat) == 0:
        v.out.verdict(nonfinite, VALUES, "nan-inf", v.info.name, "finite values", v.n, "NaN/Inf in ")
        return
    for r0, r1 in row_chunks(v.flat.shape[0], v.flat.shape[1]):  # locate them (a failing tensor only)
        x = v.flat[r0:r1]
        if not bool(torch.isfinite(x).all()):
            nonfinite.add(x.float(), x.float(), ~torch.isfinite(x), r0)
    v.out.verdict(nonfinite, VALUES, "nan-inf", v.info.name, "finite values", v.n, "NaN/Inf in ")


def _nan_inf_native(v: NativeValues) -> bool:
    if v.info.dtype == FP8_E4M3:
        return NAN_CODE not in v.row_max
    if v.info.dtype not in NONFINITE:
        return False  # F64, E5M2: the torch path
    size, mask = NONFINITE[v.info.dtype]
    return not native.count_matching(v.addr, v.n, size, mask, mask)


def _range_torch(v: TorchValues) -> None:
    out_of_range = v.located(lambda codes, x: (codes > v.top) & (codes != NAN_CODE), v.row_max > v.top)
    v.out.verdict(out_of_range, VALUES, "fp8-range", v.info.name, f"|w| <= {v.fp8_max:g}", v.n)


def _range_native(v: NativeValues) -> bool:
    top = v.checks.top
    return top is not None and max(v.row_max) <= top


def _negative_zero_torch(v: TorchValues) -> None:
    minus_zero = reader_backend().count_code(v.t, NEGATIVE_ZERO_CODE)
    v.out.expect(
        not minus_zero,
        VALUES,
        "fp8-negative-zero",
        v.info.name,
        expected="no -0 code (0x80): this target's readers may take 0x80 for NaN (float8_e4m3fnuz)",
        found=f"{minus_zero} of {v.n} codes are 0x80",
    )


def _negative_zero_native(v: NativeValues) -> bool:
    return not native.count_matching(v.addr, v.n, 1, 0xFF, NEGATIVE_ZERO_CODE)


def _row_max_torch(v: TorchValues) -> None:
    """max|row| / FP8_MAX scaling makes every non-zero row reach exactly FP8_MAX."""
    import torch

    rows = Mismatches()
    off = (v.row_max != v.top) & (v.row_max != 0)
    if bool(off.any()):
        for r0, r1 in row_chunks(v.flat.shape[0], v.flat.shape[1]):
            found = v.flat[r0:r1].float().abs().amax(dim=1)
            rows.add(found, torch.full(found.shape, v.fp8_max), off[r0:r1], r0)
    v.out.verdict(
        rows, VALUES, "fp8-row-max", v.info.name, f"max|row| = {v.fp8_max:g} (or an all-zero row)", v.t.shape[0],
        "rows off: ",
    )  # fmt: skip


def _row_max_native(v: NativeValues) -> bool:
    top = v.checks.top
    return top is not None and v.row_max.count(top) + v.row_max.count(0) == len(v.row_max)


def _scale_torch(v: TorchValues) -> None:
    import torch

    t = v.t
    m = Mismatches()
    m.add(t, t, ~(torch.isfinite(t) & (t > 0)))
    v.out.verdict(m, VALUES, "fp8-scale", v.info.name, "finite scales > 0", t.numel())


def _scale_native(v: NativeValues) -> bool:
    """Every element finite and > 0: no Inf/NaN exponent, no sign bit, no zero."""
    if v.info.dtype != "F32" or not v.n:
        return False
    exponent = NONFINITE["F32"][1]
    masks = ((exponent, exponent), (0x80000000, 0x80000000), (0xFFFFFFFF, 0))
    return not any(native.count_matching(v.addr, v.n, 4, mask, value) for mask, value in masks)


class _Checks:
    """The value checks by name, in the order they run and report (an attribute of one object: no
    module variable is rebound)."""

    def __init__(self, checks: list[ValueCheck]) -> None:
        self.checks = {c.name: c for c in checks}


CHECKS = _Checks([
    ValueCheck("nan-inf", _float, _nan_inf_torch, _nan_inf_native, by_rows=True),
    ValueCheck("fp8-range", _fp8, _range_torch, _range_native, by_rows=True),
    ValueCheck("fp8-negative-zero", _fp8, _negative_zero_torch, _negative_zero_native,
               for_target=lambda target: not target.signed_zero, by_rows=True),
    ValueCheck("fp8-row-max", lambda info, s: _fp8(info, s) and len(info.shape) == 2, _row_max_torch, _row_max_native,
               by_rows=True),
    ValueCheck("fp8-scale", lambda info, is_scale: is_scale, _scale_torch, _scale_native, by_rows=True),
])  # fmt: skip
_REGISTRY = Registry("value check", CHECKS.checks, lambda c: c.name)


def register(check: ValueCheck) -> ValueCheck:
    """Add a value check (after the built-in ones); a format names it in its value_checks."""
    return _REGISTRY.add(check)


def unregister(name: str) -> None:
    _REGISTRY.remove(name)


def registered(*checks: ValueCheck) -> contextlib.AbstractContextManager:
    return _REGISTRY.scoped(checks)


def selected(names: tuple[str, ...], target: Target) -> tuple[str, ...]:
    """The checks of a format (its value_checks) that apply for `target`, in their order."""
    unknown = [n for n in names if n not in CHECKS.checks]
    if unknown:
        raise ValueError(f"no value check named {', '.join(unknown)}")
    return tuple(n for n, c in CHECKS.checks.items() if n in names and c.for_target(target))


class ValueChecks:
    """The value checks of one file's tensors: those `names` selected (`selected`), each tensor's
    run native first (`native`: the file's NativePass, None where the native readers are not
    used), then in torch."""

    def __init__(self, names: tuple[str, ...], out: FileTally, fp8_max: float, native_pass=None):
        self.checks = [CHECKS.checks[n] for n in names]
        self.out, self.fp8_max, self.native = out, fp8_max, native_pass
        self._by_kind: dict[tuple, list[ValueCheck]] = {}

    def of(self, info: TensorInfo, is_scale: bool) -> list[ValueCheck]:
        kind = (info.dtype, len(info.shape), is_scale, math.prod(info.shape) > 0)
        if kind not in self._by_kind:
            self._by_kind[kind] = [c for c in self.checks if c.applies(info, is_scale)]
        return self._by_kind[kind]

    def run(self, info: TensorInfo, view: memoryview, is_scale: bool, tensor: Callable[[], torch.Tensor]) -> None:
        """Check one tensor (`view`: its bytes; `tensor()`: the torch tensor over them)."""
        checks = self.of(info, is_scale)
        if not checks:
            return
        if self.native is not None:
            v = NativeValues(info, view, self.native)
            if all(c.native is not None and c.native(v) for c in checks):
                self.out.tally.ok(VALUES, len(checks))
                return
        t = TorchValues(info, tensor(), self.out, self.fp8_max)
        for c in checks:
            c.torch(t)

    def by_rows(self, info: TensorInfo, is_scale: bool) -> bool:
        """Whether the native forms decide this tensor's checks a run of its rows at a time
        (`rows_pass`, then `count`): every check that applies has a native form that is `by_rows`."""
        return self.native is not None and all(c.native is not None and c.by_rows for c in self.of(info, is_scale))

    def rows_pass(self, info: TensorInfo, view: memoryview, rows: int, is_scale: bool) -> bool:
        """The native forms on `rows` whole rows of the tensor (`view`: their bytes): whether every
        one passes there. Where they pass on every run, `count` counts the checks, as `run` would."""
        part = TensorInfo(info.name, info.dtype, (rows, *info.shape[1:]), 0, len(view))
        v = NativeValues(part, view, self.native)
        return all(c.native(v) for c in self.of(info, is_scale))

    def count(self, info: TensorInfo, is_scale: bool) -> None:
        """The tensor's checks passed (every run of its rows passed `rows_pass`)."""
        checks = self.of(info, is_scale)
        if checks:
            self.out.tally.ok(VALUES, len(checks))
