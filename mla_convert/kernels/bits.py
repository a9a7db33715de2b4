"""Bit-level facts about tensors, the one home of each rule:

- `NONFINITE`: the exponent-field mask of each float dtype; a value is NaN or Inf exactly when all
  of its bits are set (the native kernels count them, verify's native pass and the source's block
  scales refuse them; `any_nonfinite` reads them off bytes, without torch or C);
- `identical` / `same_bits`: every bit the same, NaN payloads included (verify's exact checks:
  the converted bytes against the CPU reference computed the same way);
- `same_values` / `count_differing`: the same bits except that any NaN equals any NaN (the kernel
  probes: torch's own casts produce different NaN payloads on different code paths).

torch is imported by the functions that take tensors, not by this module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# safetensors dtype -> (bytes per value, exponent-field mask of its little-endian bits)
NONFINITE: dict[str, tuple[int, int]] = {"BF16": (2, 0x7F80), "F16": (2, 0x7C00), "F32": (4, 0x7F800000)}

# mask byte m -> a table giving 1 for every byte holding all of m's bits, 0 otherwise (for bytes.translate)
_ALL_SET = {
    m: bytes(int(b & m == m) for b in range(256))
    for size, mask in NONFINITE.values()
    for m in mask.to_bytes(size, "little")
    if m
}


def any_nonfinite(data: bytes, dtype: str) -> bool:
    """Whether the little-endian `dtype` values in `data` hold a NaN or an Inf: byte by byte, each
    byte of the exponent marked 1 where it holds all of the mask's bits, the marks ANDed."""
    size, mask = NONFINITE[dtype]
    hits = -1
    for i, m in enumerate(mask.to_bytes(size, "little")):
        if m:
            hits &= int.from_bytes(data[i::size].translate(_ALL_SET[m]), "little")
    return hits != 0


def _bits(t: torch.Tensor) -> torch.Tensor:
    import torch

    return t.contiguous().view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Element-wise bit equality of two tensors of the same dtype (NaN payloads compared too)."""
    return _bits(a) == _bits(b)


def identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whole-tensor bit equality (the fast path before locating differences with same_bits)."""
    import torch

    return a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def count_differing(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many elements of `a` are not those of `b` (all, for another dtype or shape): the bits
    differ, unless both are NaN."""
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return max(b.numel(), 1)
    a_bits, b_bits = _bits(a), _bits(b)
    if torch.equal(a_bits, b_bits):
        return 0
    nan_a, nan_b = torch.isnan(a.float()), torch.isnan(b.float())
    return int(((nan_a != nan_b) | (~nan_a & (a_bits != b_bits))).sum())


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical, except that a NaN may be any NaN."""
    return not count_differing(a, b)
