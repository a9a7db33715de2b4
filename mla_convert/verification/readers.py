"""Exact reads of FP8 (and 16/32-bit float) tensors for verify: the native C readers where they
agree with torch on the probes below, torch's own ops otherwise.

Chosen once per run (`reader_backend()`; `use()` sets the choice, `reset()` forgets it) by the
kernels' one chooser (kernels.fastest.first_passing): a pass of these probes is remembered per
machine (kernels.verdict, the same record the conversion's kernels use, keyed by the library,
torch and these sources), so a verify
whose readers were checked here before imports no torch at all and runs its checks on the bytes
read (verification.native_pass). A disagreement, a missing compiler or a failed build means
torch's ops are used, and the report names the reader that failed (`readers`, `readers_reason`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mla_convert.errors import first_line
from mla_convert.kernels import native, verdict
from mla_convert.kernels.chooser import Candidate, Unusable, first_passing
from mla_convert.process import resources
from mla_convert.verification.bounds import FP8_REL, FP8_SUBNORMAL_HALF_STEP, FP32_SLACK

if TYPE_CHECKING:
    import torch

# The verdict record of these probes: its key covers this file (the probes), native_pass.py and
# values.py (how the checks are called on raw buffers: the value checks' native forms live in
# values.py), besides the library, torch and the kernels' sources.
_VERDICT_OPS = ("verify-readers",)
_VERDICT_SOURCES = tuple(Path(__file__).with_name(n) for n in ("readers.py", "native_pass.py", "values.py"))


@dataclass(frozen=True)
class ReaderBackend:
    """The backend verify reads e4m3fn (and float) tensors with, exactly: native when it agrees with
    torch on the probes, else torch."""

    name: str  # "native" or "torch"
    reason: str  # why this one was chosen
    decode: Callable[[torch.Tensor], torch.Tensor]  # t.float()
    row_max_codes: Callable[[torch.Tensor], torch.Tensor]  # (t.view(uint8) & 0x7F).amax(dim=1), 2-D
    # int((~torch.isfinite(t)).sum()) for bf16 / f16 / f32 (natively from the exponent bits, as
    # torch's isfinite is slow on CPU)
    count_nonfinite: Callable[[torch.Tensor], int]
    count_code: Callable[[torch.Tensor, int], int]  # int((t.view(uint8) == code).sum()), any shape


def _torch_count_nonfinite(t: torch.Tensor) -> int:
    import torch

    return int((~torch.isfinite(t)).sum())


def _torch_count_code(t: torch.Tensor, code: int) -> int:
    import torch

    return int((t.view(torch.uint8) == code).sum())


def _code_count_agrees(native) -> bool:
    """Every byte value counted in every byte, and 0x80 placed across the 64K stretches and the
    threads' shares of a longer tensor, from an odd start too."""
    import torch

    from mla_convert.kernels import numerics

    every = (torch.arange(256 * 3, dtype=torch.int32) % 256).to(torch.uint8)
    long = torch.zeros(3 * 65536 + 17, dtype=torch.uint8)
    long[[0, 65535, 65536, 2 * 65536 + 1, long.numel() - 1]] = numerics.NEGATIVE_ZERO_CODE
    pairs = [(every, c) for c in range(256)] + [(long, numerics.NEGATIVE_ZERO_CODE), (long[1:], 0)]
    return all(
        native.count_code(t.view(torch.float8_e4m3fn), c) == _torch_count_code(t.view(torch.float8_e4m3fn), c)
        for t, c in pairs
    )


def _every_pattern() -> list[torch.Tensor]:
    """Every bf16 and f16 bit pattern, and f32 specials among random bits."""
    import torch

    all16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    f32 = torch.randint(-(2**31), 2**31 - 1, (4096,), dtype=torch.int32).view(torch.float32)
    specials = torch.tensor([float("inf"), -float("inf"), float("nan"), 3.4e38, 1e-45, -0.0])
    return [all16.view(torch.bfloat16), all16.view(torch.float16), torch.cat([f32, specials])]


def _torch_row_max_codes(t: torch.Tensor) -> torch.Tensor:
    import torch

    return (t.view(torch.uint8) & 0x7F).amax(dim=1)


def _torch_decode(t: torch.Tensor) -> torch.Tensor:
    return t.float()


TORCH_BACKEND = ReaderBackend(
    "torch", "requested", _torch_decode, _torch_row_max_codes, _torch_count_nonfinite, _torch_count_code
)
_CHOSEN = "verification.readers.chosen"  # the run's slot (process.resources): this run's choice


class _Requested:
    """Readers asked for by use(): every run of this process takes them until reset() (an attribute
    of one object, as the other test seams are, so no module variable is rebound)."""

    readers: ReaderBackend | None = None


_REQUESTED = _Requested()


def torch_bound_rows(q, sc, w, s, block: tuple[int, int], rel: float, half_step: float) -> dict[str, torch.Tensor]:
    """The per-row results of native.fp8_bound_rows that do not depend on summation order, from
    the same fp32 formulas in torch: the FP8 bound of verify.bounds with x the exact source dequant."""
    import torch

    from mla_convert.kernels import numerics

    x = numerics.dequantize_block_fp8(w, s, block)
    d = (q.float() * sc - x).abs()
    ratio = d / (x.abs() * rel + sc * half_step)
    bad = ~(ratio <= 1)
    first = torch.where(bad.any(1), bad.float().argmax(1), torch.full((q.shape[0],), -1))
    return {"n_bad": bad.sum(1), "first_bad": first, "max_abs": d.amax(1), "max_ratio": ratio.amax(1),
            "amax_x": x.abs().amax(1)}  # fmt: skip


def _bound_rows_agree(native) -> bool:
    """verify --source's one-pass C check against torch_bound_rows on a probe with an element out
    of bound, a NaN, a zero row and partial blocks."""
    import torch

    from mla_convert.kernels import numerics
    from mla_convert.kernels.bits import same_values

    g = torch.Generator().manual_seed(0)
    block = (4, 96)
    w = (torch.randn(10, 300, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.rand(3, 4, generator=g) * 0.01 + 1e-3
    q, sc = numerics.block_to_channel_fp8(w, s, block, 448.0)
    codes = q.view(torch.uint8).clone()
    codes[1, 150] ^= 0x21
    codes[-1, -1] = 0x7F
    codes[2, :] = 0
    q = codes.view(torch.float8_e4m3fn)
    args = (q, sc, w, s, block, FP8_REL + FP32_SLACK, FP8_SUBNORMAL_HALF_STEP)
    got, want = native.fp8_bound_rows(*args), torch_bound_rows(*args)
    return all(same_values(got[k], want[k].to(got[k].dtype)) for k in want)


def reader_backend() -> ReaderBackend:
    """Chosen once per run: the native readers where their check passed on this machine
    before (kernels.verdict: no torch needed), else built and probed now (with torch), the pass
    remembered; torch's own ops, with the reason, when the native library is unusable or any of
    its readers (the checks verify runs on raw buffers included) disagrees with torch on the probes."""
    if _REQUESTED.readers is not None:
        return _REQUESTED.readers
    return resources.current().slot(_CHOSEN, _choose)


def _choose() -> ReaderBackend:
    chosen, why, skipped = first_passing([_NATIVE])
    if chosen is None:  # torch's ops are always right
        return dataclasses.replace(TORCH_BACKEND, reason=skipped[0])
    return dataclasses.replace(chosen, reason=why)


def _verdict_key() -> str:
    return verdict.key((1, 1), 448.0, True, _VERDICT_OPS, extra=_VERDICT_SOURCES)


def use(readers: ReaderBackend) -> None:
    """Use `readers` in every run of this process from now on, instead of probing (TORCH_BACKEND:
    torch's own ops, as where the native library is unusable; the tests compare the two)."""
    _REQUESTED.readers = readers


def reset() -> None:
    """Forget the readers chosen in this run and the pass remembered on this machine: the next
    reader_backend() probes again."""
    _REQUESTED.readers = None
    resources.current().release(_CHOSEN)
    if native.is_loaded():  # else there is no record to key (and no library is built for one)
        verdict.record(_verdict_key(), False, _VERDICT_OPS, "")


def _native(reason: str = "") -> ReaderBackend:
    return ReaderBackend(
        "native", reason, native.decode, native.row_max_codes, native.count_nonfinite, native.count_code
    )


def _native_key() -> str:
    try:
        native.library()
        return _verdict_key()
    except Exception as e:  # no compiler, a failed build or load
        detail = str(e) if isinstance(e, native.NativeUnavailable) else first_line(e)
        raise Unusable(f"native library unavailable ({detail})") from e


def _native_checks() -> dict[str, Callable[[], bool]]:
    """Each native reader against torch's own op, and the checks verify runs on raw buffers."""
    import torch

    from mla_convert.kernels.bits import same_values
    from mla_convert.verification import reader_probes

    codes = (torch.arange(256 * 3, dtype=torch.int32) % 256).to(torch.uint8)
    every_byte = codes.view(torch.float8_e4m3fn)
    # The columns are shuffled as uint8 codes, the same bytes: torch's CPU indexing takes float8 only from 2.10.
    rows = codes.reshape(3, 256)[:, torch.randperm(256)][:, :100].view(torch.float8_e4m3fn)
    return {
        "decode": lambda: same_values(native.decode(every_byte), every_byte.float()),
        "row max": lambda: torch.equal(native.row_max_codes(rows), _torch_row_max_codes(rows)),
        "non-finite count": lambda: all(
            native.count_nonfinite(t) == _torch_count_nonfinite(t) for t in _every_pattern()
        ),
        "code count": lambda: _code_count_agrees(native),
        **reader_probes.raw_checks(),
        "bound check": lambda: _bound_rows_agree(native),
    }


def _check_native(_readers: ReaderBackend) -> str:
    """Raises Unusable naming the first native reader that fails or disagrees with torch."""
    checks = _native_checks()
    for what, agrees in checks.items():
        try:
            ok = agrees()
        except Exception as e:
            raise Unusable(f"native {what} failed on the probe ({first_line(e)})") from e
        if not ok:
            raise Unusable(f"native {what} disagreed with torch on the probe")
    return f"C readers built for this CPU; {', '.join(checks)} agree with torch on the probes"


_NATIVE = Candidate(
    "native",
    make=_native,
    check=_check_native,
    key=_native_key,
    ops=_VERDICT_OPS,
    recorded=lambda found: f"C readers built for this CPU; they agree with torch on the probes (remembered: {found})",
)
