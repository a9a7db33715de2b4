"""verify, source group: the comparisons of a converted tensor with its source, by the name its
transform declares (kernels.transforms.Transform.verify). Each is declared once (`Comparison`):
the checks it records, its torch form (verification.against_source, which describes a failure)
and its native form (verification.native_pass, on the bytes read), side by side. `register` adds
one (a transform added from outside, docs/adding-a-format.md). No torch at import.

A comparison that `partners` a scale is given the weight's scale too (the tensor written right
after it, its layout the format's): data_pass holds the weight until its scale is read.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mla_convert.registry import Registry

if TYPE_CHECKING:
    import torch

    from mla_convert.verification.against_source import SourceComparisons
    from mla_convert.verification.native_pass import NativePass
    from mla_convert.verification.tasks import TensorTask
    from mla_runtime.safetensors_file import TensorInfo

# torch(source, info, tensor, scale or None, job): records each of `checks`, describing a failure
TorchForm = Callable[["SourceComparisons", "TensorInfo", "torch.Tensor", "torch.Tensor | None", "TensorTask"], None]
# native(checks, info, bytes, the scale's bytes or None (then read by job.scale), job) -> every check passed
NativeForm = Callable[["NativePass", "TensorInfo", memoryview, "memoryview | None", "TensorTask"], bool]
# by_parts(checks, info, bytes [start, start + len) of the tensor, start, job) -> every check passed there
PartForm = Callable[["NativePass", "TensorInfo", memoryview, int, "TensorTask"], bool]


@dataclass(frozen=True)
class Comparison:
    name: str  # as a transform's `verify` names it
    checks: tuple[str, ...]  # the checks it records, one each (what a native pass counts)
    torch: TorchForm
    native: NativeForm | None = None
    partners_scale: bool = False  # it takes the weight's scale (TensorTask.scale / scale_name)
    # Its native form on a part of the tensor: where it passes on every part, `native` passes on the
    # whole (a large tensor is then compared as it is read, rather than read whole: data_pass).
    by_parts: PartForm | None = None


class _Comparisons:
    """The comparisons by name (an attribute of one object: no module variable is rebound)."""

    def __init__(self, comparisons: list[Comparison]) -> None:
        self.by_name = {c.name: c for c in comparisons}


COMPARISONS = _Comparisons([
    Comparison("copy", ("copy-exact",), lambda s, info, t, _, job: s.copy(info, t, job),
               lambda n, info, view, _, job: n.copy(info, view, job),
               by_parts=lambda n, info, view, start, job: n.copy(info, view, job, start)),
    Comparison("channel_fp8", ("fp8-bound", "fp8-scale"), lambda s, info, q, sc, job: s.channel_fp8(info, q, sc, job),
               lambda n, info, q, sc, job: n.channel_fp8(info, q, sc, job), partners_scale=True),
    Comparison("bf16", ("bf16-exact",), lambda s, info, t, _, job: s.bf16(info, t, job)),
    Comparison("int4_bf16", ("int4-bf16-exact",), lambda s, info, t, _, job: s.int4_bf16(info, t, job)),
])  # fmt: skip
_REGISTRY = Registry("comparison", COMPARISONS.by_name, lambda c: c.name)


def comparison(name: str) -> Comparison | None:
    return COMPARISONS.by_name.get(name)


def register(c: Comparison) -> Comparison:
    return _REGISTRY.add(c)


def unregister(name: str) -> None:
    _REGISTRY.remove(name)


def registered(*comparisons: Comparison) -> contextlib.AbstractContextManager:
    return _REGISTRY.scoped(comparisons)
