"""What `--kernels` means for a run, and the native kernels without torch (no torch here).

`resolve_mode` turns a mode into the kernels to try in order; kernels.fastest tries them, each
checked bit-identical to eager torch on the probe set. Where that check already passed on this
machine for this library, this torch and these sources (kernels.verdict), `cached_native` gives the
native kernels directly: a conversion that needs nothing else of torch then never imports it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mla_convert import envs
from mla_convert.constants import KERNEL_MODES, KERNELS_AUTO
from mla_convert.errors import ConvertError
from mla_convert.kernels import native_build, verdict
from mla_convert.kernels.native_build import NativeUnavailable
from mla_convert.kernels.transforms import BLOCK_OPS as BLOCK_OPS
from mla_convert.kernels.transforms import CONVERTING_OPS, KERNEL_TRANSFORMS, Params, Transform
from mla_convert.kernels.transforms.transform import RowKernel

BLOCK_DEFAULT = (128, 128)

# A device kernel set: (device, block, fp8_max, signed_zero) -> {op: function taking and returning
# CPU tensors}; kernels.fastest.device_funcs (eager numerics on the device) unless
# kernels.fastest.DEVICE_KERNEL_FACTORIES names another for the device's type.
DeviceKernelFactory = Callable[[str, tuple[int, int], float, bool], dict[str, Callable]]

# Kernels.device_check: how the device was checked.
CPU_ONLY, PASSED, DIFFERED, FAILED = "not needed", "passed", "differed", "failed"

# The per-tensor conversions a plan can use that a kernel set implements (kernels.transforms).
OPS = CONVERTING_OPS
# What a native check covers besides the plan's ops: the exact dequant, and the MLA split of a
# block-FP8 kv_b_proj ("mla") and of a bf16 one ("mla16"), as the artifacts are made.
NATIVE_EXTRA_OPS = tuple(op for op, t in KERNEL_TRANSFORMS.items() if op not in OPS and t.native is not None)

# Below this many bytes of weights to convert, torch.compile's compile time (long when inductor's
# cache is cold) costs more than it saves over eager. The native kernels build much faster, and are
# cached too.
AUTO_COMPILE_MIN_BYTES = 2 * 10**9

# What each --kernels mode (constants.KERNEL_MODES) tries on the CPU, in order; each falls back to
# the next with the reason. A conversion that asks for the native kernels by name tries them alone
# (REQUESTED): a request that cannot be met is refused, not met with another kernel set.
REQUESTED = {"native": ("native",)}
CHAINS = {
    "native": ("native", "eager"),
    "compile": ("compile", "eager"),
    "eager": ("eager",),
}
assert (KERNELS_AUTO, *CHAINS) == KERNEL_MODES


def resolve_mode(mode: str, convert_bytes: int) -> tuple[tuple[str, ...], str]:
    """--kernels MODE -> (the kernels to try in order, why) for `convert_bytes` of source weights
    to convert (block-FP8 weights, and the 16-bit linears a channel-FP8 conversion quantizes)."""
    if mode not in KERNEL_MODES:
        raise ValueError(f"kernels mode {mode!r}: expected {', '.join(KERNEL_MODES)}")
    if mode == KERNELS_AUTO:
        mode = envs.kernels_auto() or KERNELS_AUTO
    if mode != KERNELS_AUTO:
        return REQUESTED.get(mode, CHAINS[mode]), "requested"
    if convert_bytes < AUTO_COMPILE_MIN_BYTES:
        return (
            "native",
            "eager",
        ), f"auto: {convert_bytes / 1e9:.2f} GB to convert is too little to repay torch.compile"
    return ("native", "compile", "eager"), "auto"


def request_refused(names: tuple[str, ...], reasons: list[str]) -> ConvertError:
    """The refusal of kernels asked for by name (REQUESTED) that cannot run here, with the reasons."""
    build = "install a C compiler (gcc, or set CC), or " if any("unavailable" in r for r in reasons) else ""
    return ConvertError(
        f"--kernels {' or '.join(names)}: {'; '.join(reasons)}; {build}use --kernels auto, which runs eager "
        "where these cannot run"
    )


def check_request(mode: str) -> None:
    """What a dry run can check of a request for the native kernels without torch: that they build
    here (whether they pass their probes, the run checks with torch). Refused as the run refuses it."""
    if mode == KERNELS_AUTO:
        mode = envs.kernels_auto() or KERNELS_AUTO
    if "native" in REQUESTED.get(mode, ()):
        try:
            native_build.build()
        except NativeUnavailable as e:
            raise request_refused(("native",), [f"native kernels unavailable ({e})"]) from e


def is_cpu(device: str) -> bool:
    return device.split(":", 1)[0] == "cpu"


@dataclass(frozen=True)
class NativeRows:
    """The native kernels as the conversion's hot path calls them: each transform's C entry on raw
    addresses, a range of rows at a time (kernels.native), for one block size, FP8 range and zero
    rule."""

    params: Params
    reason: str  # why they run: checked in this process, or a cached verdict

    def rows(self, t: Transform) -> RowKernel:
        """`t`'s row kernel (Transform.rows) for these parameters."""
        assert t.rows is not None, t.op
        return t.rows(self.params)


def native_ops(ops: tuple[str, ...]) -> tuple[str, ...]:
    """What a native check of a plan's `ops` covers (the ops the native kernels have, and the
    split and dequant the artifacts need)."""
    return (*(op for op in OPS if op in ops), *NATIVE_EXTRA_OPS)


def cached_native(block, fp8_max: float, signed_zero: bool, ops: tuple[str, ...]) -> NativeRows | None:
    """The native kernels, if a check of them with these parameters passed on this machine for
    the library and torch of this run (kernels.verdict); None otherwise (and where the library
    cannot be built or loaded: kernels.fastest then says why)."""
    try:
        key = verdict.key(tuple(block), fp8_max, signed_zero, native_ops(ops))
    except NativeUnavailable:
        return None
    found = verdict.lookup(key)
    if found is None:
        return None
    return NativeRows(Params(tuple(block), fp8_max, signed_zero), f"C kernels built for this CPU; {found}")
