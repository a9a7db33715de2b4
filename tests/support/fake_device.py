"""Device kernel sets for tests, where there is no device: factories for the documented hook
kernels.fastest.DEVICE_KERNEL_FACTORIES (a test registers one for the device type "meta"; a
conversion hands it to its worker processes, which import it from here).

Each runs the real eager `numerics` on CPU tensors that divide as a device might:

- `reciprocal_division`: every division a multiplication by the divisor's float32 reciprocal;
- `cuda_scalar_division`: only a division by a Python number, as torch on CUDA does;
- `unsigned_zero_ignored`: correct arithmetic that ignores the target's zero rule (writes -0);
- `subnormals_flushed`: a dequant that flushes float32 subnormal results to zero;
- `bf16_truncated`: a bf16 cast that truncates instead of rounding to nearest even.

With MLA_TEST_DEVICE_LOG=path every factory call and kernel call appends a line
"pid event detail" there: `factory` (detail: `writing` when the calling shard job has opened its
writer, `job-not-writing` when it has not, outside a job how many files the output directory
MLA_TEST_DEVICE_OUT holds), and `probe` (made by kernels' check) or `convert` for a kernel call.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from mla_convert.kernels import fastest as kernels
from mla_convert.kernels import numerics

_DIVISIONS = {torch.Tensor.__truediv__, torch.Tensor.div, torch.div, torch.true_divide}


class _ReciprocalDivision(torch.Tensor):
    """A tensor that divides as `a * fl(1 / b)`: by any divisor, or (scalar_only) by a Python number."""

    scalar_only = False

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _DIVISIONS and not kwargs.get("rounding_mode"):
            a, b = args[0], args[1]
            if not (cls.scalar_only and isinstance(b, torch.Tensor)):
                with torch._C.DisableTorchFunctionSubclass():
                    a = a.as_subclass(torch.Tensor)
                    b = b.as_subclass(torch.Tensor) if isinstance(b, torch.Tensor) else torch.tensor(b, dtype=a.dtype)
                    return (a * torch.reciprocal(b.to(a.dtype))).as_subclass(cls)
        return super().__torch_function__(func, types, args, kwargs)


class _ScalarReciprocalDivision(_ReciprocalDivision):
    scalar_only = True


def _plain(out):
    return tuple(_plain(o) for o in out) if isinstance(out, tuple) else out.as_subclass(torch.Tensor)


def _run_as(cls, funcs: dict) -> dict:
    """Each function run on `cls` views of its inputs, its results plain tensors again."""
    return {op: _logged(op, lambda *a, fn=fn: _plain(fn(*(x.as_subclass(cls) for x in a)))) for op, fn in funcs.items()}


def reciprocal_division(device, block, fp8_max, signed_zero) -> dict:
    _log("factory", _where())
    return _run_as(_ReciprocalDivision, kernels.eager_funcs(block, fp8_max, signed_zero))


def cuda_scalar_division(device, block, fp8_max, signed_zero) -> dict:
    _log("factory", _where())
    return _run_as(_ScalarReciprocalDivision, kernels.eager_funcs(block, fp8_max, signed_zero))


def unsigned_zero_ignored(device, block, fp8_max, signed_zero) -> dict:
    _log("factory", _where())
    return {op: _logged(op, fn) for op, fn in kernels.eager_funcs(block, fp8_max).items()}


def subnormals_flushed(device, block, fp8_max, signed_zero) -> dict:
    _log("factory", _where())
    funcs = kernels.eager_funcs(block, fp8_max, signed_zero)

    def dequant(w, s):
        x = numerics.dequantize_block_fp8(w, s, block)
        return torch.where(x.abs() < torch.finfo(torch.float32).tiny, torch.zeros_like(x), x)

    return {
        **funcs,
        "dequant": dequant,
        "bf16": lambda w, s: numerics.to_bf16(dequant(w, s)),
        "fp8": lambda w, s: numerics.quantize_channel_fp8(dequant(w, s), fp8_max, signed_zero),
    }


def _logged(op, fn):
    def run(*args):
        _log("probe" if _frame("_check_against_eager") is not None else "convert", op)
        return fn(*args)

    return run


def _frame(function: str):
    """The innermost frame of `function` on the calling stack, if any."""
    f = sys._getframe()
    while f is not None and f.f_code.co_name != function:
        f = f.f_back
    return f


def _where() -> str:
    job = _frame("start_shard_job")
    if job is not None:
        return "writing" if "writer" in job.f_locals else "job-not-writing"
    out = os.environ.get("MLA_TEST_DEVICE_OUT")
    files = [p for p in Path(out).rglob("*") if p.is_file()] if out and Path(out).exists() else []
    return f"files={len(files)}"


def _log(event: str, detail: str) -> None:
    path = os.environ.get("MLA_TEST_DEVICE_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"{os.getpid()} {event} {detail}\n")


def bf16_truncated(device, block, fp8_max, signed_zero) -> dict:
    _log("factory", _where())
    funcs = kernels.eager_funcs(block, fp8_max, signed_zero)

    def to_bf16(w, s):
        bits = numerics.dequantize_block_fp8(w, s, block).view(torch.int32) >> 16
        return bits.to(torch.int16).view(torch.bfloat16)

    return {**funcs, "bf16": to_bf16}
