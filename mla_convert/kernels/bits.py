"""Bit-level equality of tensors, the one home of both rules:

- `identical` / `same_bits`: every bit the same, NaN payloads included (verify's exact checks:
  the converted bytes against the CPU reference computed the same way);
- `same_values` / `count_differing`: the same bits except that any NaN equals any NaN (the kernel
  probes: torch's own casts produce different NaN payloads on different code paths).
"""

from __future__ import annotations

import torch

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(_INT_OF_SIZE[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Element-wise bit equality of two tensors of the same dtype (NaN payloads compared too)."""
    return _bits(a) == _bits(b)


def identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whole-tensor bit equality (the fast path before locating differences with same_bits)."""
    return a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def count_differing(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many elements of `a` are not those of `b` (all, for another dtype or shape): the bits
    differ, unless both are NaN."""
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
