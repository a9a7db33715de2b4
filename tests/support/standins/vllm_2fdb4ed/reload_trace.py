"""Stand-in for what vllm/model_executor/model_loader/reload/trace.py gives `MLAReloadPolicy`:
`ReloadError`, `ReloadTarget` (a bound runtime tensor whose object and layout must survive a
reload round) and of `ReloadState` its targets, `bind_target` and `copy_`. From the stored version
at commit 0f6c0f5a (see __init__.py); the tracer itself (arrivals, rounds, dependencies) is left out."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


class ReloadError(RuntimeError):
    """A reload contract was violated."""


def _layout(tensor: torch.Tensor) -> tuple:
    return (
        tensor.data_ptr(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.storage_offset(),
        tensor.dtype,
        tensor.device,
    )


@dataclass
class ReloadTarget:
    tensor: torch.Tensor
    resolve: Callable[[], torch.Tensor]
    layout: tuple = field(init=False)

    def __post_init__(self) -> None:
        self.layout = _layout(self.tensor)

    def validate(self) -> None:
        if self.resolve() is not self.tensor or _layout(self.tensor) != self.layout:
            raise ReloadError("Runtime tensor identity or layout changed")

    @torch.no_grad()
    def copy_(self, source: torch.Tensor) -> None:
        self.validate()
        if source.shape != self.tensor.shape or source.dtype != self.tensor.dtype:
            raise ReloadError("Converted tensor does not match runtime shape/dtype")
        if source is not self.tensor:
            self.tensor.copy_(source)


@dataclass
class ReloadState:
    key: str
    module: torch.nn.Module
    roles: tuple[str, ...]
    policy: object
    dependencies: tuple[str, ...] = ()
    targets: dict[str, ReloadTarget] = field(default_factory=dict)
    checkpoint: dict[str, torch.Tensor] = field(default_factory=dict)
    runtime_modified: bool = False

    def bind_target(self, role: str, resolve: Callable[[], torch.Tensor]) -> None:
        self.targets[role] = ReloadTarget(resolve(), resolve)

    def copy_(self, role: str, source: torch.Tensor) -> None:
        self.runtime_modified = True
        self.targets[role].copy_(source)
