"""How the arithmetic of a conversion runs: the device checked usable, the --kernels mode resolved
for the source, and the kernel set chosen and probed (kernels.select), the same for every job."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mla_convert.constants import SIGNED_ZERO
from mla_convert.errors import ConvertError
from mla_convert.kernels.select import (
    BLOCK_DEFAULT,
    DeviceKernelFactory,
    Kernels,
    device_factory,
    resolve_mode,
    select_kernels,
)
from mla_convert.plan.ops import CONVERTING_OPS
from mla_convert.plan.planner import Plan
from mla_convert.settings import RunSettings


@dataclass(frozen=True)
class Compute:
    """How the arithmetic runs, the same for every job of a conversion (sent to worker processes)."""

    block: tuple[int, int] | None  # the source's scale block (None: a BF16 source)
    fp8_max: float  # the target's FP8 range
    ops: tuple[str, ...]  # converting ops the plan uses (plan.ops): what gets probed and compiled
    device: str  # where the arithmetic should run, if it passes the check (kernels.select_kernels)
    chain: tuple[str, ...]  # CPU kernels to try in order (kernels.select.resolve_mode)
    signed_zero: bool = True  # the target's FP8 weights may hold -0 (constants.SIGNED_ZERO)
    factory: DeviceKernelFactory | None = None  # the device's kernel set (kernels.select.device_factory)

    def kernels(self) -> Kernels:
        """Chosen and checked once per process: the first call, before this process writes."""
        return select_kernels(
            self.block or BLOCK_DEFAULT, self.fp8_max, self.device, self.chain, self.ops, self.signed_zero,
            self.factory,
        )  # fmt: skip


def choose_compute(plan: Plan, settings: RunSettings) -> tuple[Compute, dict]:
    """The device checked, the --kernels mode resolved for this source, and the kernels that will run
    (with the reason, for the summary)."""
    src = plan.source
    check_device(settings.device)
    try:
        converted = {t.source for job in plan.shards for t in job.tensors if t.op in CONVERTING_OPS}
        chain, why = resolve_mode(settings.kernels, sum(src.info(n).nbytes for n in converted))
    except ValueError as e:
        raise ConvertError(f"--kernels: {e}") from e
    signed_zero = SIGNED_ZERO[plan.options.target]
    factory = None if torch.device(settings.device).type == "cpu" else device_factory(settings.device)
    compute = Compute(src.block, plan.options.fp8_max, plan.ops(), settings.device, chain, signed_zero, factory)
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
    try:
        torch.empty(1, device=device)
    except Exception as e:  # unknown device string, or no such device on this host
        raise ConvertError(f"--device {device!r} is not usable here ({type(e).__name__}: {e})") from e
