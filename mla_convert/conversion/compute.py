"""How the arithmetic of a conversion runs: the device checked usable, the --kernels mode resolved
for the source, and the kernel set chosen and probed (kernels.fastest), the same for every job.

No torch at import, and none at all for a CPU conversion whose native kernels this machine has
already checked (kernels.modes.cached_native): the shard jobs then run them on raw buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

from mla_convert.errors import OptionError
from mla_convert.kernels.modes import (
    BLOCK_DEFAULT,
    CPU_ONLY,
    DeviceKernelFactory,
    NativeRows,
    cached_native,
    is_cpu,
    resolve_mode,
)
from mla_convert.kernels.transforms import Params
from mla_convert.plan.ops import CONVERTING_OPS
from mla_convert.plan.planner import Plan
from mla_convert.process import resources
from mla_convert.process.torch_import import import_torch
from mla_convert.settings import RunSettings

_NATIVE_ROWS = "conversion.compute.native_rows"  # the run's slot: Compute -> its native_rows()


@dataclass(frozen=True)
class Compute:
    """How the arithmetic runs, the same for every job of a conversion (sent to worker processes)."""

    block: tuple[int, int] | None  # the source's scale block (None: a BF16 source)
    fp8_max: float  # the target's FP8 range
    ops: tuple[str, ...]  # converting ops the plan uses (plan.ops): what gets probed and compiled
    device: str  # where the arithmetic should run, if it passes the check (kernels.fastest.select_kernels)
    chain: tuple[str, ...]  # CPU kernels to try in order (kernels.modes.resolve_mode)
    signed_zero: bool = True  # the target's FP8 weights may hold -0 (formats.Target.signed_zero)
    factory: DeviceKernelFactory | None = None  # the device's kernel set (kernels.fastest.device_factory)

    def kernels(self):
        """The torch kernel set (kernels.fastest.Kernels), chosen and checked once per run: the
        first call, before this process writes. Imports torch."""
        import_torch()
        from mla_convert.kernels.fastest import select_kernels

        return select_kernels(
            self.block or BLOCK_DEFAULT, self.fp8_max, self.device, self.chain, self.ops, self.signed_zero,
            self.factory,
        )  # fmt: skip

    def native_rows(self) -> NativeRows | None:
        """The native kernels on raw buffers, where they are what this conversion runs: on the CPU,
        with native first in the chain, checked on this machine (a remembered verdict, without
        torch) or in this process (with torch). None: the torch kernels (`kernels()`) run."""
        answers = resources.current().slot(_NATIVE_ROWS, dict)
        if self not in answers:
            answers[self] = self._native_rows()
        return answers[self]

    def _native_rows(self) -> NativeRows | None:
        if not is_cpu(self.device) or not self.chain or self.chain[0] != "native":
            return None
        block = self.block or BLOCK_DEFAULT
        found = cached_native(block, self.fp8_max, self.signed_zero, self.ops)
        if found is not None:
            return found
        chosen = self.kernels()  # checks them with torch, remembering a pass for later runs
        if chosen.name != "native" or not is_cpu(chosen.device):
            return None
        return NativeRows(Params(block, self.fp8_max, self.signed_zero), chosen.reason)


def choose_compute(plan: Plan, settings: RunSettings) -> tuple[Compute, dict]:
    """The device checked, the --kernels mode resolved for this source, and the kernels that will run
    (with the reason, for the summary)."""
    src = plan.source
    check_device(settings.device)
    try:
        converted = {t.source for shard in plan.shards for t in shard.tensors if t.op in CONVERTING_OPS}
        chain, why = resolve_mode(settings.kernels, sum(src.info(n).nbytes for n in converted))
    except ValueError as e:
        raise OptionError(f"kernels: {e}", f"--kernels: {e}") from e
    factory = None
    if not is_cpu(settings.device):
        import_torch()
        from mla_convert.kernels.fastest import device_factory

        factory = device_factory(settings.device)
    compute = Compute(src.block, plan.options.fp8_max, plan.ops(), settings.device, chain, plan.options.signed_zero,
                      factory)  # fmt: skip
    rows = compute.native_rows()
    if rows is not None:
        return compute, {
            "kernels": "native",
            "kernels_reason": rows.reason,
            "compute_device": "cpu",
            "device_check": CPU_ONLY,
            "device_reason": "the arithmetic runs on the CPU",
        }
    chosen = compute.kernels()
    cpu_eager_by_policy = chosen.name == "eager" and chosen.device == "cpu" and why not in ("requested", "auto")
    reason = f"{chosen.reason}; {why}" if cpu_eager_by_policy else chosen.reason
    return compute, {
        "kernels": chosen.name,
        "kernels_reason": reason,
        "compute_device": chosen.device,
        "device_check": chosen.device_check,
        "device_reason": chosen.device_reason,
    }


def check_device(device: str) -> None:
    if is_cpu(device) and device.split(":", 1)[-1] in ("cpu", "0"):
        return  # the CPU is always there
    torch = import_torch()

    try:
        torch.empty(1, device=device)
    except Exception as e:  # unknown device string, or no such device on this host
        why = f"is not usable here ({type(e).__name__}: {e})"
        raise OptionError(f"device={device!r} {why}", f"--device {device!r} {why}") from e
