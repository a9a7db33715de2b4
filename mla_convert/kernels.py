"""Choose how the numerics run: eager torch on another device, native C kernels, torch.compile,
or eager torch on the CPU.

Eager on the CPU is `numerics` itself: the definition. torch.compile fuses the same functions. The
native kernels (native.py) do the same arithmetic in C, operation for operation. On a --device
other than the CPU, eager `numerics` runs there. Whichever is chosen is first checked
bit-identical to CPU eager on the probe set (probes.py) once per process, before it converts
anything (tests check all of them against the slow reference); any failure (no C compiler, no
inductor, a device that rounds differently) falls back with the reason: a device to the CPU kernels.
Every kernel set takes CPU tensors and returns CPU tensors.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import numerics, probes

BLOCK_DEFAULT = (128, 128)

# Test seam: "module:function", a factory (device, block, fp8_max, signed_zero) -> {op: function}
# used instead of device_funcs for a non-CPU device (a device kernel set where there is no device,
# in every process: worker processes inherit it).
DEVICE_KERNELS_ENV = "MLA_CONVERT_DEVICE_KERNELS"

# Kernels.device_check: how the device was checked.
CPU_ONLY, PASSED, DIFFERED, FAILED = "not needed", "passed", "differed", "failed"


@dataclass(frozen=True)
class Kernels:
    name: str  # "native", "torch.compile" or "eager"
    reason: str  # why this one was chosen
    to_channel_fp8: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    to_bf16: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    dequant_fp32: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    # a 16- or 32-bit float weight (a BF16 source's linear) -> (e4m3fn [N, K], fp32 scale [N, 1])
    quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    device: str = "cpu"  # where the arithmetic runs: the requested device, or the CPU after a fallback
    device_check: str = CPU_ONLY  # CPU_ONLY, PASSED, DIFFERED or FAILED
    device_reason: str = "the arithmetic runs on the CPU"


# The per-tensor conversions a plan can use: block-FP8 -> channel FP8, block-FP8 -> bf16, and a
# float (bf16) weight -> channel FP8.
OPS = ("fp8", "bf16", "quant")
BLOCK_OPS = ("fp8", "bf16")


def _funcs(block: tuple[int, int], fp8_max: float, signed_zero: bool = True) -> dict[str, Callable]:
    def to_channel_fp8(w, s):
        return numerics.block_to_channel_fp8(w, s, block, fp8_max, signed_zero)

    def to_bf16(w, s):
        return numerics.to_bf16(numerics.dequantize_block_fp8(w, s, block))

    def dequant_fp32(w, s):
        return numerics.dequantize_block_fp8(w, s, block)

    def quantize(w):
        return numerics.float_to_channel_fp8(w, fp8_max, signed_zero)

    return {"fp8": to_channel_fp8, "bf16": to_bf16, "dequant": dequant_fp32, "quant": quantize}


def _kernels(name: str, reason: str, f: dict[str, Callable], **device) -> Kernels:
    return Kernels(name, reason, f["fp8"], f["bf16"], f["dequant"], f["quant"], **device)


def eager_kernels(
    block=BLOCK_DEFAULT, fp8_max: float = 448.0, reason: str = "requested", signed_zero: bool = True
) -> Kernels:
    return _kernels("eager", reason, _funcs(tuple(block), fp8_max, signed_zero))


def device_funcs(device: str, block: tuple[int, int], fp8_max: float, signed_zero: bool) -> dict[str, Callable]:
    """Eager `numerics` on `device`: each function moves its CPU inputs there and its results back."""

    def on_device(fn: Callable) -> Callable:
        def run(*args):
            out = fn(*(a.to(device) for a in args))
            return tuple(o.cpu() for o in out) if isinstance(out, tuple) else out.cpu()

        return run

    return {op: on_device(fn) for op, fn in _funcs(block, fp8_max, signed_zero).items()}


def _device_factory() -> Callable:
    spec = os.environ.get(DEVICE_KERNELS_ENV)
    if not spec:
        return device_funcs
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def _bf16_only(fast: Callable, eager: Callable) -> Callable:
    """`fast` for bf16 weights (what it was probed on), `eager` for any other float dtype."""
    return lambda w: fast(w) if w.dtype == torch.bfloat16 else eager(w)


# Below this many bytes of weights to convert, torch.compile's compile time (long when inductor's cache is cold)
# costs more than it saves over eager. The native kernels build much faster, and are cached too.
AUTO_COMPILE_MIN_BYTES = 2 * 10**9

# What each --kernels mode tries on the CPU, in order; each falls back to the next with the reason.
CHAINS = {
    "native": ("native", "eager"),
    "compile": ("compile", "eager"),
    "eager": ("eager",),
}
MODES = ("auto", *CHAINS)


def resolve_mode(mode: str, convert_bytes: int) -> tuple[tuple[str, ...], str]:
    """--kernels MODE -> (the kernels to try in order, why) for `convert_bytes` of source weights
    to convert (block-FP8 weights, and the 16-bit linears a channel-FP8 conversion quantizes)."""
    if mode not in MODES:
        raise ValueError(f"kernels mode {mode!r}: expected {', '.join(MODES)}")
    if mode == "auto" and os.environ.get("MLA_CONVERT_KERNELS"):
        mode = os.environ["MLA_CONVERT_KERNELS"]
        if mode not in MODES:
            raise ValueError(f"MLA_CONVERT_KERNELS={mode!r}: expected {', '.join(MODES)}")
    if mode != "auto":
        return CHAINS[mode], "requested"
    if convert_bytes < AUTO_COMPILE_MIN_BYTES:
        return (
            "native",
            "eager",
        ), f"auto: {convert_bytes / 1e9:.2f} GB to convert is too little to repay torch.compile"
    return ("native", "compile", "eager"), "auto"


_CACHE: dict = {}


def select_kernels(
    block=BLOCK_DEFAULT,
    fp8_max: float = 448.0,
    device: str = "cpu",
    mode: str | tuple[str, ...] = "native",
    ops=OPS,
    signed_zero: bool = True,
) -> Kernels:
    """For a non-CPU `device`, eager numerics there if they give bit-identical results to CPU eager
    on the probes; else (and for the CPU) the first kernels of `mode` (a mode name or a chain from
    resolve_mode) that work here and pass the same check; eager at the end, with the reasons."""
    chain = CHAINS[mode] if isinstance(mode, str) else tuple(mode)
    key = (tuple(block), fp8_max, signed_zero, device, chain, tuple(sorted(ops)))
    if key not in _CACHE:
        _CACHE[key] = _select(tuple(block), fp8_max, signed_zero, device, chain, key[-1])
    return _CACHE[key]


def _select(block, fp8_max, signed_zero, device, chain, ops) -> Kernels:
    if torch.device(device).type == "cpu":
        return _select_cpu(block, fp8_max, signed_zero, chain, ops)
    try:
        return _on_device(device, block, fp8_max, signed_zero, ops)
    except _Unusable as e:
        cpu = _select_cpu(block, fp8_max, signed_zero, chain, ops)
        check = DIFFERED if isinstance(e, _Differed) else FAILED
        return dataclasses.replace(
            cpu,
            reason=f"{device} did not pass its check (device_reason), the CPU converts: {cpu.reason}",
            device_check=check,
            device_reason=f"{e}; converting on the CPU instead",
        )


def _on_device(device, block, fp8_max, signed_zero, ops) -> Kernels:
    """Eager numerics on `device`, checked against CPU eager on every op the run uses (block-FP8
    sources: the dequant feeding the MLA artifacts, and their split, too)."""
    checked = (*ops, "dequant", "mla") if set(ops) & set(BLOCK_OPS) else ops
    try:
        funcs = _device_factory()(device, block, fp8_max, signed_zero)
        n = _check_against_eager(device, funcs, block, fp8_max, signed_zero, checked)
    except _Unusable:
        raise
    except Exception as e:  # the device's own errors: an op it lacks, a failed transfer, ...
        raise _Unusable(f"{device} failed on the probe ({_first_line(e)})") from None
    why = f"{device}: {', '.join(checked)} bit-identical to eager on the CPU, on the probe set ({n} elements)"
    return _kernels("eager", f"eager numerics on {device}", funcs, device=device, device_check=PASSED,
                    device_reason=why)  # fmt: skip


def _select_cpu(block, fp8_max, signed_zero, chain, ops) -> Kernels:
    skipped = []
    for name in chain:
        if name == "eager":
            break
        try:
            chosen = {"native": _native, "compile": _compiled}[name](block, fp8_max, signed_zero, ops)
        except _Unusable as e:
            skipped.append(str(e))
            continue
        return chosen if not skipped else dataclasses.replace(chosen, reason="; ".join([*skipped, chosen.reason]))
    return eager_kernels(block, fp8_max, "; ".join(skipped) or "requested", signed_zero)


class _Unusable(Exception):
    pass


class _Differed(_Unusable):
    """Ran, and gave other results than CPU eager."""


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical, except that a NaN may be any NaN (torch's own bf16 casts differ there)."""
    return not _count_differing(a, b)


def _count_differing(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many elements of `a` are not those of `b` (all, for another dtype or shape): the bits
    differ, unless both are NaN."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return max(b.numel(), 1)
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    a_bits, b_bits = a.contiguous().view(bits), b.contiguous().view(bits)
    if torch.equal(a_bits, b_bits):
        return 0
    nan_a, nan_b = torch.isnan(a.float()), torch.isnan(b.float())
    return int(((nan_a != nan_b) | (~nan_a & (a_bits != b_bits))).sum())


# What each op returns, to count differences by.
_OUTPUTS = {"fp8": ("weights", "scales"), "quant": ("weights", "scales"), "mla": ("W_UK_T", "W_UV")}


def _check_against_eager(name: str, funcs: dict, block, fp8_max, signed_zero, ops) -> int:
    """Raises _Differed naming each op whose results on the probes differ from CPU eager, with how
    many elements of how many differed; returns how many output elements were checked."""
    eager = _funcs(block, fp8_max, signed_zero)
    if "mla" in ops:
        funcs = {**funcs, "mla": probes.mla_split(funcs["dequant"], block)}
        eager["mla"] = probes.mla_split(eager["dequant"], block)
    checked, differed = 0, []
    for op in ops:
        outputs = _OUTPUTS.get(op, ("values",))
        bad, total = [0] * len(outputs), [0] * len(outputs)
        for args in probes.inputs(block, fp8_max, op):
            got, want = funcs[op](*args), eager[op](*args)
            got, want = (got if isinstance(got, tuple) else (got,)), (want if isinstance(want, tuple) else (want,))
            for i, (a, b) in enumerate(zip(got, want, strict=True)):
                total[i] += b.numel()
                bad[i] += _count_differing(a, b)
        checked += sum(total)
        if any(bad):
            counts = [f"{n} of {t} {what}" for n, t, what in zip(bad, total, outputs, strict=True) if n]
            differed.append(f"{op} in {' and '.join(counts)}")
    if differed:
        raise _Differed(f"{name} differed from eager on the CPU, on the probe set: {'; '.join(differed)}")
    return checked


def _native(block, fp8_max, signed_zero, ops) -> Kernels:
    from . import native

    eager = _funcs(block, fp8_max, signed_zero)
    funcs = {
        "fp8": lambda w, s: native.to_channel_fp8(w, s, block, fp8_max, signed_zero),
        "bf16": lambda w, s: native.to_bf16(w, s, block),
        "dequant": lambda w, s: native.dequantize(w, s, block),
        "quant": _bf16_only(lambda w: native.bf16_to_channel_fp8(w, fp8_max, signed_zero), eager["quant"]),
    }
    try:
        native.library()
    except native.NativeUnavailable as e:
        raise _Unusable(f"native kernels unavailable ({e})") from None
    _check_against_eager("native", funcs, block, fp8_max, signed_zero, (*ops, "dequant"))
    return _kernels("native", f"C kernels built for this CPU; {', '.join(ops)} checked bit-identical to eager", funcs)


def _compiled(block, fp8_max, signed_zero, ops) -> Kernels:
    # Several probe shapes: torch.compile's automatic dynamic shapes compile a static graph for the
    # first and a shape-generic one at the second, which every later tensor reuses; so the graph
    # that converts is the one checked here. `dynamic=True` would also make the captured block
    # size and FP8 max symbolic, which makes the generated kernel much slower.
    eager = _funcs(block, fp8_max, signed_zero)
    chosen = dict(eager)
    try:
        for op in ops:
            chosen[op] = torch.compile(eager[op])
        if "quant" in ops:  # only the dtype probed: another would compile a graph of its own
            chosen["quant"] = _bf16_only(chosen["quant"], eager["quant"])
        _check_against_eager("torch.compile", chosen, block, fp8_max, signed_zero, ops)
    except _Unusable:
        raise
    except Exception as e:  # no compiler, no inductor, ...: eager is always correct
        raise _Unusable(f"torch.compile unavailable ({_first_line(e)})") from None
    return _kernels("torch.compile", f"compiled {', '.join(ops)}; checked bit-identical to eager", chosen)


def _first_line(e: Exception) -> str:
    first = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}"


@dataclass(frozen=True)
class Fp8Readers:
    """Exact reads of e4m3fn tensors for verify: native when it agrees with torch on the probes."""

    name: str  # "native" or "torch"
    reason: str  # why this one was chosen
    decode: Callable[[torch.Tensor], torch.Tensor]  # t.float()
    row_max_codes: Callable[[torch.Tensor], torch.Tensor]  # (t.view(uint8) & 0x7F).amax(dim=1), 2-D
    # int((~torch.isfinite(t)).sum()) for bf16 / f16 / f32 (natively from the exponent bits, as
    # torch's isfinite is slow on CPU)
    count_nonfinite: Callable[[torch.Tensor], int]
    count_code: Callable[[torch.Tensor, int], int]  # int((t.view(uint8) == code).sum()), any shape


def _torch_count_nonfinite(t: torch.Tensor) -> int:
    return int((~torch.isfinite(t)).sum())


def _torch_count_code(t: torch.Tensor, code: int) -> int:
    return int((t.view(torch.uint8) == code).sum())


def _code_count_agrees(native) -> bool:
    """Every byte value counted in every byte, and 0x80 placed across the 64K stretches and the
    threads' shares of a longer tensor, from an odd start too."""
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
    all16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    f32 = torch.randint(-(2**31), 2**31 - 1, (4096,), dtype=torch.int32).view(torch.float32)
    specials = torch.tensor([float("inf"), -float("inf"), float("nan"), 3.4e38, 1e-45, -0.0])
    return [all16.view(torch.bfloat16), all16.view(torch.float16), torch.cat([f32, specials])]


def _torch_row_max_codes(t: torch.Tensor) -> torch.Tensor:
    return (t.view(torch.uint8) & 0x7F).amax(dim=1)


def _torch_decode(t: torch.Tensor) -> torch.Tensor:
    return t.float()


TORCH_READERS = Fp8Readers(
    "torch", "requested", _torch_decode, _torch_row_max_codes, _torch_count_nonfinite, _torch_count_code
)
_READERS: list[Fp8Readers] = []


def torch_bound_rows(q, sc, w, s, block: tuple[int, int], rel: float, half_step: float) -> dict[str, torch.Tensor]:
    """The per-row results of native.fp8_bound_rows that do not depend on summation order, from
    the same fp32 formulas in torch: the FP8 bound of verify.bounds with x the exact source dequant."""
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
    from .verify.bounds import FP8_REL, FP8_SUBNORMAL_HALF_STEP, FP32_SLACK

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


def fp8_readers() -> Fp8Readers:
    """Built and probed once per process; torch's own ops, with the reason, when the native library
    is unusable or any of its readers (the bound check verify --source uses with them included)
    disagrees with torch on the probes."""
    if not _READERS:
        try:
            _READERS.append(_native_readers())
        except _Unusable as e:  # torch's ops are always right
            _READERS.append(dataclasses.replace(TORCH_READERS, reason=str(e)))
    return _READERS[0]


def _native_readers() -> Fp8Readers:
    """The native readers, each probed against torch; raises _Unusable naming the first that is not
    usable."""
    from . import native

    try:
        native.library()
    except Exception as e:  # no compiler, a failed build or load
        detail = str(e) if isinstance(e, native.NativeUnavailable) else _first_line(e)
        raise _Unusable(f"native library unavailable ({detail})") from None
    every_byte = (torch.arange(256 * 3, dtype=torch.int32) % 256).to(torch.uint8).view(torch.float8_e4m3fn)
    rows = every_byte.reshape(3, 256)[:, torch.randperm(256)][:, :100]
    checks = {
        "decode": lambda: same_values(native.decode(every_byte), every_byte.float()),
        "row max": lambda: torch.equal(native.row_max_codes(rows), _torch_row_max_codes(rows)),
        "non-finite count": lambda: all(
            native.count_nonfinite(t) == _torch_count_nonfinite(t) for t in _every_pattern()
        ),
        "code count": lambda: _code_count_agrees(native),
        "bound check": lambda: _bound_rows_agree(native),
    }
    for what, agrees in checks.items():
        try:
            ok = agrees()
        except Exception as e:
            raise _Unusable(f"native {what} failed on the probe ({_first_line(e)})") from None
        if not ok:
            raise _Unusable(f"native {what} disagreed with torch on the probe")
    return Fp8Readers(
        "native", f"C readers built for this CPU; {', '.join(checks)} agree with torch on the probes", native.decode,
        native.row_max_codes, native.count_nonfinite, native.count_code,
    )  # fmt: skip
