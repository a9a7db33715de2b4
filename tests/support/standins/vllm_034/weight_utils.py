"""Stand-in for vllm 0.34.0's vllm/model_executor/model_loader/weight_utils.py:
`finalize_model_weights` (lines 1549-1585): every module's own `process_weights_after_loading()`,
called with no argument, each after all of its submodules (children first, the root model last),
a module shared by several parents once, before all of them; quantization methods and the
submodules of quantized layers skipped (their quant method processed them). CPU only: the
`device_loading_context` for offloaded attention weights does nothing there.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from vllm_upstream import QuantizeMethodBase


def finalize_model_weights(model: torch.nn.Module, target_device: torch.device | None = None) -> None:
    seen: set[torch.nn.Module] = set()

    def children_first(module: torch.nn.Module) -> Iterable[torch.nn.Module]:
        quantized = isinstance(getattr(module, "quant_method", None), QuantizeMethodBase)
        for child in [] if quantized else module.children():
            if child not in seen:
                seen.add(child)
                yield from children_first(child)
        yield module

    for module in children_first(model):
        if isinstance(module, QuantizeMethodBase):
            continue
        hook = getattr(module, "process_weights_after_loading", None)
        if callable(hook):
            hook()
