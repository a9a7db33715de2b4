"""The conversion's kernel sets, and the fastest of them that passes its probes on this machine
(kernels.chooser: the one chooser, which verify's readers use too).

A kernel set implements the transforms of kernels.transforms: eager on the CPU is their definition;
torch.compile fuses the same functions; the native kernels (kernels.native) do the same arithmetic
in C, operation for operation; on a --device other than the CPU, the definition runs there.
Whichever is chosen is first checked bit-identical to CPU eager on each transform's probes, once
per run, before it converts anything (tests check all of them against the slow reference); any
failure (no C compiler, no inductor, a device that rounds differently) falls back with the reason:
a device to the CPU kernels. Every kernel set takes CPU tensors and returns CPU tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mla_convert.errors import first_line
from mla_convert.kernels import native, verdict
from mla_convert.kernels.bits import count_differing
from mla_convert.kernels.chooser import Candidate, Differed, Unusable, first_passing
from mla_convert.kernels.modes import (  # noqa: F401 (AUTO_COMPILE_MIN_BYTES, resolve_mode: this module's API too)
    AUTO_COMPILE_MIN_BYTES,
    BLOCK_DEFAULT,
    CHAINS,
    CPU_ONLY,
    DIFFERED,
    FAILED,
    OPS,
    PASSED,
    DeviceKernelFactory,
    native_ops,
    request_refused,
    resolve_mode,
)
from mla_convert.kernels.transforms import BLOCK_OPS, KERNEL_TRANSFORMS, SPLITS, Params, block_fp8_dequant, mla_split
from mla_convert.process import resources

# ---- the conversion's kernel sets ----------------------------------------------------------------


@dataclass(frozen=True)
class Kernels:
    """A kernel set: for each transform of KERNEL_TRANSFORMS it implements, a function on CPU tensors."""

    name: str  # "native", "torch.compile" or "eager"
    reason: str  # why this one was chosen
    funcs: dict[str, Callable] = field(repr=False)
    device: str = "cpu"  # where the arithmetic runs: the requested device, or the CPU after a fallback
    device_check: str = CPU_ONLY  # CPU_ONLY, PASSED, DIFFERED or FAILED
    device_reason: str = "the arithmetic runs on the CPU"

    def __getitem__(self, op: str) -> Callable:
        return self.funcs[op]

    # The transforms by what they do (the tests and verify call them so).
    @property
    def to_channel_fp8(self) -> Callable:
        return self.funcs["fp8"]

    @property
    def to_bf16(self) -> Callable:
        return self.funcs["bf16"]

    @property
    def dequant_fp32(self) -> Callable:
        return self.funcs["dequant"]

    @property
    def quantize(self) -> Callable:
        return self.funcs["quant"]


# The transforms every kernel set has: those on tensors alone (the MLA splits also take dims, and
# a set without a split of its own splits its dequant: mla_split.split_of).
_TENSOR_OPS = tuple(op for op in KERNEL_TRANSFORMS if op not in SPLITS)


def eager_funcs(block: tuple[int, int], fp8_max: float, signed_zero: bool = True) -> dict[str, Callable]:
    """The definitions: each transform's eager torch on the CPU."""
    p = Params(tuple(block), fp8_max, signed_zero)
    return {op: KERNEL_TRANSFORMS[op].eager(p) for op in _TENSOR_OPS}


def eager_kernels(
    block=BLOCK_DEFAULT, fp8_max: float = 448.0, reason: str = "requested", signed_zero: bool = True
) -> Kernels:
    return Kernels("eager", reason, eager_funcs(tuple(block), fp8_max, signed_zero))


def device_funcs(device: str, block: tuple[int, int], fp8_max: float, signed_zero: bool) -> dict[str, Callable]:
    """Eager definitions on `device`: each function moves its CPU inputs there and its results back."""

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


_DTYPES = {"BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn}


def _probed_dtypes_only(op: str, fast: Callable, eager: Callable) -> Callable:
    """`fast` for the dtypes its transform's fast implementations take (what they were probed on),
    `eager` for any other (a float32 source linear)."""
    dtypes = KERNEL_TRANSFORMS[op].native_dtypes
    if len(KERNEL_TRANSFORMS[op].reads) != 1 or not dtypes:
        return fast
    taken = {_DTYPES[d] for d in dtypes}
    return lambda w: fast(w) if w.dtype in taken else eager(w)


def forget() -> None:
    """Forget the kernel sets chosen in this run (the next choice probes again)."""
    resources.current().release(_CHOSEN)


_CHOSEN = "kernels.fastest.chosen"


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
    eager at the end, with the reasons. Chosen once per run and arguments."""
    chain = CHAINS[mode] if isinstance(mode, str) else tuple(mode)
    factory = factory or device_factory(device)
    key = (tuple(block), fp8_max, signed_zero, device, chain, tuple(sorted(ops)), factory)
    chosen = resources.current().slot(_CHOSEN, dict)
    if key not in chosen:
        chosen[key] = _select(Params(tuple(block), fp8_max, signed_zero), device, chain, key[5], factory)
    return chosen[key]


def _select(p: Params, device, chain, ops, factory) -> Kernels:
    if torch.device(device).type == "cpu":
        return _select_cpu(p, chain, ops)
    try:
        return _on_device(device, p, ops, factory)
    except Unusable as e:
        cpu = _select_cpu(p, chain, ops)
        check = DIFFERED if isinstance(e, Differed) else FAILED
        return dataclasses.replace(
            cpu,
            reason=f"{device} did not pass its check (device_reason), the CPU converts: {cpu.reason}",
            device_check=check,
            device_reason=f"{e}; converting on the CPU instead",
        )


def _on_device(device, p: Params, ops, factory) -> Kernels:
    """Eager definitions on `device`, checked against CPU eager on every op the run uses
    (block-FP8 sources: the dequant feeding the MLA artifacts, and their split, too)."""
    checked = (*ops, block_fp8_dequant.OP, mla_split.OP) if set(ops) & set(BLOCK_OPS) else ops
    try:
        funcs = factory(device, p.block, p.fp8_max, p.signed_zero)
        n = _check_against_eager(device, funcs, p, checked)
    except Unusable:
        raise
    except Exception as e:  # the device's own errors: an op it lacks, a failed transfer, ...
        raise Unusable(f"{device} failed on the probe ({first_line(e)})") from e
    why = f"{device}: {', '.join(checked)} bit-identical to eager on the CPU, on the probe set ({n} elements)"
    return Kernels("eager", f"eager numerics on {device}", funcs, device=device, device_check=PASSED,
                   device_reason=why)  # fmt: skip


def _select_cpu(p: Params, chain, ops) -> Kernels:
    makers = {"native": _native_candidate, "compile": _compiled_candidate}
    names = chain[: chain.index("eager")] if "eager" in chain else chain
    chosen, why, skipped = first_passing(makers[name](p, ops) for name in names)
    if chosen is None and "eager" not in chain:  # a request (modes.REQUESTED): no other kernels instead
        raise request_refused(names, skipped)
    if chosen is None:
        return eager_kernels(p.block, p.fp8_max, "; ".join(skipped) or "requested", p.signed_zero)
    return dataclasses.replace(chosen, reason="; ".join([*skipped, why]))


def _check_against_eager(name: str, funcs: dict, p: Params, ops) -> int:
    """Raises Differed naming each op whose results on its probes differ from CPU eager, with how
    many elements of how many differed; returns how many output elements were checked."""
    eager = {op: KERNEL_TRANSFORMS[op].eager(p) for op in ops}
    if mla_split.OP in ops and mla_split.OP not in funcs:  # the artifacts of a set without a split of its own
        funcs = {mla_split.OP: mla_split.split_of(funcs[block_fp8_dequant.OP]), **funcs}
    checked, differed = 0, []
    for op in ops:
        t = KERNEL_TRANSFORMS[op]
        bad, total = [0] * len(t.outputs), [0] * len(t.outputs)
        for args in t.probes(p):
            got, want = funcs[op](*args), eager[op](*args)
            got, want = (got if isinstance(got, tuple) else (got,)), (want if isinstance(want, tuple) else (want,))
            for i, (a, b) in enumerate(zip(got, want, strict=True)):
                total[i] += b.numel()
                bad[i] += count_differing(a, b)
        checked += sum(total)
        if any(bad):
            counts = [f"{n} of {t} {what}" for n, t, what in zip(bad, total, t.outputs, strict=True) if n]
            differed.append(f"{op} in {' and '.join(counts)}")
    if differed:
        raise Differed(f"{name} differed from eager on the CPU, on the probe set: {'; '.join(differed)}")
    return checked


def _native_candidate(p: Params, ops) -> Candidate:
    """The native kernels, checked on every op the conversion's hot path runs with them (the
    plan's, the dequant and both MLA splits); a pass is remembered for this machine, so that later
    runs need no torch (kernels.modes.cached_native), and a failure forgets any earlier pass."""
    checked = native_ops(ops)

    def key() -> str:
        try:
            return verdict.key(p.block, p.fp8_max, p.signed_zero, checked)
        except native.NativeUnavailable as e:
            raise Unusable(f"native kernels unavailable ({e})") from e

    def make() -> Kernels:
        eager = eager_funcs(p.block, p.fp8_max, p.signed_zero)
        funcs = {op: KERNEL_TRANSFORMS[op].native(p) for op in KERNEL_TRANSFORMS}
        funcs = {op: _probed_dtypes_only(op, fn, eager[op]) if op in eager else fn for op, fn in funcs.items()}
        why = f"C kernels built for this CPU; {', '.join(ops)} checked bit-identical to eager"
        return Kernels("native", why, funcs)

    def check(k: Kernels) -> str:
        _check_against_eager("native", k.funcs, p, checked)
        return k.reason

    return Candidate("native", make, check, key, checked)


def _compiled_candidate(p: Params, ops) -> Candidate:
    # Several probe shapes: torch.compile's automatic dynamic shapes compile a static graph for the
    # first and a shape-generic one at the second, which every later tensor reuses; so the graph
    # that converts is the one checked here. `dynamic=True` would also make the captured block
    # size and FP8 max symbolic, which makes the generated kernel much slower.
    def make() -> Kernels:
        eager = eager_funcs(p.block, p.fp8_max, p.signed_zero)
        chosen = dict(eager)
        try:
            for op in ops:
                if KERNEL_TRANSFORMS[op].compiles:  # only the dtype probed: another compiles a graph of its own
                    chosen[op] = _probed_dtypes_only(op, torch.compile(eager[op]), eager[op])
        except Exception as e:  # no compiler, no inductor, ...: eager is always correct
            raise Unusable(f"torch.compile unavailable ({first_line(e)})") from e
        return Kernels("torch.compile", f"compiled {', '.join(ops)}; checked bit-identical to eager", chosen)

    def check(k: Kernels) -> str:
        try:
            _check_against_eager("torch.compile", k.funcs, p, ops)
        except Unusable:
            raise
        except Exception as e:  # the compile itself runs at the first call
            raise Unusable(f"torch.compile unavailable ({first_line(e)})") from e
        return k.reason

    return Candidate("compile", make, check)
