"""Choose how the numerics run: torch.compile (one fused pass, ~5x eager on CPU) or eager.

Both call the same functions of `numerics`, so the compiled path is the eager path fused, and a
test checks they are bit-identical. Compilation is tried once per process on a small tensor; any
failure (no C compiler, no inductor, an unsupported device) falls back to eager with the reason.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch

from . import numerics

BLOCK_DEFAULT = (128, 128)


@dataclass(frozen=True)
class Kernels:
    name: str  # "torch.compile" or "eager"
    reason: str  # why this one was chosen
    to_channel_fp8: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    to_bf16: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    # Eager always: only kv_b_proj (0.3% of R1's bytes) needs it, for the MLA artifacts, and a
    # compile would cost more than it saves.
    dequant_fp32: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


OPS = ("fp8", "bf16")  # the per-tensor conversions a plan can use


def _funcs(block: tuple[int, int], fp8_max: float) -> dict[str, Callable]:
    def to_channel_fp8(w, s):
        return numerics.block_to_channel_fp8(w, s, block, fp8_max)

    def to_bf16(w, s):
        return numerics.to_bf16(numerics.dequantize_block_fp8(w, s, block))

    def dequant_fp32(w, s):
        return numerics.dequantize_block_fp8(w, s, block)

    return {"fp8": to_channel_fp8, "bf16": to_bf16, "dequant": dequant_fp32}


def eager_kernels(block=BLOCK_DEFAULT, fp8_max: float = 448.0, reason: str = "requested") -> Kernels:
    f = _funcs(tuple(block), fp8_max)
    return Kernels("eager", reason, f["fp8"], f["bf16"], f["dequant"])


# Below this many FP8 bytes, compiling (~15 s cold on 2 cores, ~2 s from inductor's cache) costs
# more than the ~4x it saves over eager (~0.12 GB/s eager vs ~0.5 GB/s compiled, measured here).
AUTO_COMPILE_MIN_BYTES = 2 * 10**9


def resolve_mode(mode: str, fp8_bytes: int) -> tuple[str, str]:
    """'auto' -> 'compile' or 'eager' for a checkpoint with `fp8_bytes` of FP8 weights."""
    if mode not in ("auto", "compile", "eager"):
        raise ValueError(f"kernels mode {mode!r}: expected auto, compile or eager")
    mode = os.environ.get("MLA_CONVERT_KERNELS", mode) if mode == "auto" else mode
    if mode == "auto":
        if fp8_bytes < AUTO_COMPILE_MIN_BYTES:
            return "eager", f"auto: {fp8_bytes / 1e9:.2f} GB of FP8 is too little to repay compiling"
        return "compile", "auto"
    return mode, "requested"


_CACHE: dict = {}


def select_kernels(
    block=BLOCK_DEFAULT, fp8_max: float = 448.0, device: str = "cpu", mode: str = "compile", ops=OPS
) -> Kernels:
    """mode 'compile': torch.compile the `ops` the plan uses if that works here (each checked
    bit-identical to eager on a probe), else eager with the reason; 'eager': eager."""
    key = (tuple(block), fp8_max, device, mode, tuple(sorted(ops)))
    if key not in _CACHE:
        _CACHE[key] = _select(tuple(block), fp8_max, device, mode, key[-1])
    return _CACHE[key]


def _select(block, fp8_max, device, mode, ops) -> Kernels:
    if mode == "eager":
        return eager_kernels(block, fp8_max, "requested")
    if torch.device(device).type != "cpu":
        return eager_kernels(block, fp8_max, f"eager kernels run fast on {device}")
    eager = _funcs(block, fp8_max)
    chosen = dict(eager)
    # Two probe shapes: torch.compile's automatic dynamic shapes compile a static graph for the
    # first and a shape-generic one at the second, which every later tensor reuses; so the graph
    # that converts is the one checked here. Grid dims differ and exceed 1 (no specialisation on
    # equal or unit sizes). `dynamic=True` would also make the captured block size and FP8 max
    # symbolic, and the kernel ~15x slower (measured).
    probes = [
        (torch.randn(2 * block[0] + 5, 3 * block[1] + 7).to(torch.float8_e4m3fn), torch.rand(3, 4) + 0.5),
        (torch.randn(4 * block[0], 5 * block[1] + 1).to(torch.float8_e4m3fn), torch.rand(4, 6) + 0.5),
    ]
    try:
        for op in ops:
            compiled = torch.compile(eager[op])
            for w, s in probes:
                got, want = compiled(w, s), eager[op](w, s)
                got, want = (got if isinstance(got, tuple) else (got,)), (want if isinstance(want, tuple) else (want,))
                if not all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, want)):
                    return eager_kernels(block, fp8_max, f"torch.compile output of {op!r} differed from eager")
            chosen[op] = compiled
    except Exception as e:  # no compiler, no inductor, ...: eager is always correct
        first = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
        return eager_kernels(block, fp8_max, f"torch.compile unavailable ({type(e).__name__}: {first})")
    return Kernels(
        "torch.compile", f"compiled {', '.join(ops)}; checked bit-identical to eager", chosen["fp8"], chosen["bf16"],
        chosen["dequant"],
    )  # fmt: skip
