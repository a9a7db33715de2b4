"""Error statistics of one checked tensor, gathered over its row chunks.

`ErrorStats`: relative Frobenius error, cosine, max |error| and how much of the allowed error it
uses; `Mismatches`: how many elements a check flagged, and where the first one is. The bounds they
are measured against are in verification.bounds."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class ErrorStats:
    """Accumulates error statistics of `found` against `exact` over row chunks of one tensor."""

    def __init__(self) -> None:
        self.dd = self.xx = self.yy = 0.0
        self.max_abs = 0.0
        self.bound_use = 0.0
        self.chunk_bound_use = 0.0  # of the last chunk added: <= 1 means every element passed

    def add(self, found: torch.Tensor, exact: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """Add one chunk (fp32); returns |found - exact| / allowed per element (> 1 or NaN: fails)."""
        import torch

        f, x = found.reshape(-1), exact.reshape(-1)
        d = f - x
        self.dd += float(torch.dot(d, d))
        self.xx += float(torch.dot(x, x))
        self.yy += float(torch.dot(f, f))
        d.abs_()
        ratio = d / allowed.reshape(-1)
        if d.numel():
            self.max_abs = _nan_max(self.max_abs, float(d.max()))
            self.chunk_bound_use = _nan_max(0.0, float(ratio.max()))
            self.bound_use = max(self.bound_use, self.chunk_bound_use)
        return ratio.view(found.shape)

    def add_sums(self, dd: float, xx: float, yy: float, max_abs: float, bound_use: float) -> None:
        """Add one chunk already reduced elsewhere (the native verify pass)."""
        self.dd, self.xx, self.yy = self.dd + dd, self.xx + xx, self.yy + yy
        self.max_abs = _nan_max(self.max_abs, max_abs)
        self.chunk_bound_use = _nan_max(0.0, bound_use)
        self.bound_use = max(self.bound_use, self.chunk_bound_use)

    @property
    def rel_err(self) -> float:
        return math.sqrt(self.dd / self.xx) if self.xx > 0 else (0.0 if self.dd == 0 else math.inf)

    @property
    def cosine(self) -> float:
        xy = (self.xx + self.yy - self.dd) / 2  # <f, x>, from |f - x|^2 = |f|^2 - 2<f, x> + |x|^2
        return xy / math.sqrt(self.xx * self.yy) if self.xx > 0 and self.yy > 0 else float(self.dd == 0)


def _nan_max(a: float, b: float) -> float:
    return math.inf if math.isnan(a) or math.isnan(b) else max(a, b)


class Mismatches:
    """Counts elements flagged bad over row chunks of one tensor and remembers the first one."""

    def __init__(self) -> None:
        self.count = 0
        self.first: str | None = None

    def add(self, found: torch.Tensor, expected: torch.Tensor, bad: torch.Tensor, row_offset: int = 0) -> None:
        import torch

        n = int(bad.sum())
        if not n:
            return
        self.count += n
        if self.first is None:
            at = tuple(int(i) for i in torch.nonzero(bad)[0])
            where = [at[0] + row_offset, *at[1:]]
            self.first = f"first at {where}: {float(found[at]):.6g} vs expected {float(expected[at]):.6g}"

    def add_counted(self, count: int, where: list[int], found: float, expected: float) -> None:
        """Add `count` bad elements counted elsewhere, the first of them at `where`."""
        self.count += count
        if self.first is None and count:
            self.first = f"first at {where}: {found:.6g} vs expected {expected:.6g}"

    def text(self, total: int) -> str:
        return f"{self.count} of {total} elements; {self.first}"
