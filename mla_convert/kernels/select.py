"""Choose how the numerics run: eager torch on another device, native C kernels, torch.compile,
or eager torch on the CPU.

Eager on the CPU is `numerics` itself: the definition. torch.compile fuses the same functions. The
native kernels (kernels.native) do the same arithmetic in C, operation for operation. On a --device
other than the CPU, eager `numerics` runs there. Whichever is chosen is first checked
bit-identical to CPU eager on the probe set (kernels.probes) once per process, before it converts
anything (tests check all of them against the slow reference); any failure (no C compiler, no
inductor, a device that rounds differently) falls back with the reason: a device to the CPU kernels.
Every kernel set takes CPU tensors and returns CPU tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mla_convert.errors import first_line
from mla_convert.kernels import native, numerics, probes, verdict
from mla_convert.kernels.bits import count_differing
from mla_convert.kernels.choice import (  # noqa: F401 (AUTO_COMPILE_MIN_BYTES, resolve_mode: this module's API too)
    AUTO_COMPILE_MIN_BYTES,
    BLOCK_DEFAULT,
    BLOCK_OPS,
    CHAINS,
    CPU_ONLY,
    DIFFERED,
    FAILED,
    OPS,
    PASSED,
    DeviceKernelFactory,
    native_ops,
    resolve_mode,
)
from mla_runtime.layout import split_kv_b_proj


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


def eager_funcs(block: tuple[int, int], fp8_max: float, signed_zero: bool = True) -> dict[str, Callable]:
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
    return _kernels("eager", reason, eager_funcs(tuple(block), fp8_max, signed_zero))


def device_funcs(device: str, block: tuple[int, int], fp8_max: float, signed_zero: bool) -> dict[str, Callable]:
    """Eager `numerics` on `device`: each function moves its CPU inputs there and its results back."""

    def on_device(fn: Callable) -> Callable:
        def run(*args):
            out = fn(*(a.to(device) for a in args))
            return tuple(o.cpu() for o in out) if isinstance(out, tuple) else out.cpu()

        return run

    return {op: on_device(fn) for op, fn in eager_funcs(block, fp8_max, signed_zero).items()}


# The documented hook for a device kernel set other than eager numerics, by device type ("cuda",
# "hpu", "meta", ...): the tests put a fake device's kernels here (tests/support/fake_device.py),
# where there is no device. A conversion resolves it once (device_factory) and hands it to its
# worker processes with the rest of its Compute.
DEVICE_KERNEL_FACTORIES: dict[str, DeviceKernelFactory] = {}


def device_factory(device: str) -> DeviceKernelFactory:
    """The kernel set factory for `device`: the one registered for its type, else device_funcs."""
    return DEVICE_KERNEL_FACTORIES.get(torch.device(device).type, device_funcs)


def _bf16_only(fast: Callable, eager: Callable) -> Callable:
    """`fast` for bf16 weights (what it was probed on), `eager` for any other float dtype."""
    return lambda w: fast(w) if w.dtype == torch.bfloat16 else eager(w)


class KernelChoices:
    """Kernel sets already chosen and probed in this process, by what they were chosen for: a
    conversion asks once per process (each worker too), verify's tests many times. `clear()`
    forgets them (the next choice probes again)."""

    def __init__(self) -> None:
        self._chosen: dict[tuple, Kernels] = {}

    def get(self, key: tuple, choose: Callable[[], Kernels]) -> Kernels:
        if key not in self._chosen:
            self._chosen[key] = choose()
        return self._chosen[key]

    def clear(self) -> None:
        self._chosen.clear()


CHOICES = KernelChoices()  # this process's choices (select_kernels)


def select_kernels(
    block=BLOCK_DEFAULT,
    fp8_max: float = 448.0,
    device: str = "cpu",
    mode: str | tuple[str, ...] = "native",
    ops=OPS,
    signed_zero: bool = True,
    factory: DeviceKernelFactory | None = None,
) -> Kernels:
    """For a non-CPU `device`, its kernel set (`factory`, default `device_factory(device)`) if it
    gives bit-identical results to CPU eager on the probes; else (and for the CPU) the first kernels
    of `mode` (a mode name or a chain from resolve_mode) that work here and pass the same check;
    eager at the end, with the reasons. Chosen once per process and arguments (CHOICES)."""
    chain = CHAINS[mode] if isinstance(mode, str) else tuple(mode)
    factory = factory or device_factory(device)
    key = (tuple(block), fp8_max, signed_zero, device, chain, tuple(sorted(ops)), factory)
    return CHOICES.get(key, lambda: _select(tuple(block), fp8_max, signed_zero, device, chain, key[5], factory))


def _select(block, fp8_max, signed_zero, device, chain, ops, factory) -> Kernels:
    if torch.device(device).type == "cpu":
        return _select_cpu(block, fp8_max, signed_zero, chain, ops)
    try:
        return _on_device(device, block, fp8_max, signed_zero, ops, factory)
    except _Unusable as e:
        cpu = _select_cpu(block, fp8_max, signed_zero, chain, ops)
        check = DIFFERED if isinstance(e, _Differed) else FAILED
        return dataclasses.replace(
            cpu,
            reason=f"{device} did not pass its check (device_reason), the CPU converts: {cpu.reason}",
            device_check=check,
            device_reason=f"{e}; converting on the CPU instead",
        )


def _on_device(device, block, fp8_max, signed_zero, ops, factory) -> Kernels:
    """Eager numerics on `device`, checked against CPU eager on every op the run uses (block-FP8
    sources: the dequant feeding the MLA artifacts, and their split, too)."""
    checked = (*ops, "dequant", "mla") if set(ops) & set(BLOCK_OPS) else ops
    try:
        funcs = factory(device, block, fp8_max, signed_zero)
        n = _check_against_eager(device, funcs, block, fp8_max, signed_zero, checked)
    except _Unusable:
        raise
    except Exception as e:  # the device's own errors: an op it lacks, a failed transfer, ...
        raise _Unusable(f"{device} failed on the probe ({first_line(e)})") from e
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


# What each op returns, to count differences by.
_OUTPUTS = {op: ("weights", "scales") for op in ("fp8", "quant")} | {op: ("W_UK_T", "W_UV") for op in ("mla", "mla16")}


def _check_against_eager(name: str, funcs: dict, block, fp8_max, signed_zero, ops) -> int:
    """Raises _Differed naming each op whose results on the probes differ from CPU eager, with how
    many elements of how many differed; returns how many output elements were checked."""
    eager = eager_funcs(block, fp8_max, signed_zero)
    if "mla" in ops:  # the artifacts of a kernel set without a split of its own: torch's split of its dequant
        funcs = {"mla": probes.mla_split(funcs["dequant"], block), **funcs}
        eager["mla"] = probes.mla_split(eager["dequant"], block)
    if "mla16" in ops:
        eager["mla16"] = lambda w: split_kv_b_proj(w, probes.mla_probe(block)[2], torch.bfloat16)
    checked, differed = 0, []
    for op in ops:
        outputs = _OUTPUTS.get(op, ("values",))
        bad, total = [0] * len(outputs), [0] * len(outputs)
        for args in probes.inputs(block, fp8_max, op):
            got, want = funcs[op](*args), eager[op](*args)
            got, want = (got if isinstance(got, tuple) else (got,)), (want if isinstance(want, tuple) else (want,))
            for i, (a, b) in enumerate(zip(got, want, strict=True)):
                total[i] += b.numel()
                bad[i] += count_differing(a, b)
        checked += sum(total)
        if any(bad):
            counts = [f"{n} of {t} {what}" for n, t, what in zip(bad, total, outputs, strict=True) if n]
            differed.append(f"{op} in {' and '.join(counts)}")
    if differed:
        raise _Differed(f"{name} differed from eager on the CPU, on the probe set: {'; '.join(differed)}")
    return checked


def _native(block, fp8_max, signed_zero, ops) -> Kernels:
    """The native kernels, checked on every op the conversion's hot path runs with them (the
    plan's, the dequant and both MLA splits); a pass is remembered for this machine (kernels.verdict),
    so that later runs need no torch, and a failure forgets any earlier pass."""
    eager = eager_funcs(block, fp8_max, signed_zero)
    dims = probes.mla_probe(block)[2]
    funcs = {
        "fp8": lambda w, s: native.to_channel_fp8(w, s, block, fp8_max, signed_zero),
        "bf16": lambda w, s: native.to_bf16(w, s, block),
        "dequant": lambda w, s: native.dequantize(w, s, block),
        "quant": _bf16_only(lambda w: native.bf16_to_channel_fp8(w, fp8_max, signed_zero), eager["quant"]),
        "mla": lambda w, s: native.split_kv_b_proj(w, s, block, dims),
        "mla16": lambda w: native.split_kv_b_proj(w, None, None, dims),
    }
    checked = native_ops(ops)
    try:
        key = verdict.key(block, fp8_max, signed_zero, checked)
    except native.NativeUnavailable as e:
        raise _Unusable(f"native kernels unavailable ({e})") from e
    try:
        _check_against_eager("native", funcs, block, fp8_max, signed_zero, checked)
    except _Unusable:
        verdict.record(key, False, checked, torch.__version__)
        raise
    verdict.record(key, True, checked, torch.__version__)
    return _kernels("native", f"C kernels built for this CPU; {', '.join(ops)} checked bit-identical to eager", funcs)


def _compiled(block, fp8_max, signed_zero, ops) -> Kernels:
    # Several probe shapes: torch.compile's automatic dynamic shapes compile a static graph for the
    # first and a shape-generic one at the second, which every later tensor reuses; so the graph
    # that converts is the one checked here. `dynamic=True` would also make the captured block
    # size and FP8 max symbolic, which makes the generated kernel much slower.
    eager = eager_funcs(block, fp8_max, signed_zero)
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
        raise _Unusable(f"torch.compile unavailable ({first_line(e)})") from e
    return _kernels("torch.compile", f"compiled {', '.join(ops)}; checked bit-identical to eager", chosen)


def _first_line(e: Exception) -> str:
    first = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}"
