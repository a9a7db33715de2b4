"""Stand-in for vllm 0.34.0's vllm/model_executor/model_loader/utils.py: `process_weights_after_loading`
(lines 139-216: under direct reload the checkpoint layout is recorded first; every module's quant
method; then `finalize_model_weights`), and what `initialize_model` does once the model is built
(`record_metadata_for_reloading`, for a later layerwise reload). Left out: tied embeddings, CPU
offloading, online-quantization timing, torchao.
"""

from __future__ import annotations

import torch
from vllm_upstream import QuantizeMethodBase

from .reload import direct_reload_enabled, record_checkpoint_layout, record_metadata_for_reloading
from .weight_utils import finalize_model_weights

__all__ = ["initialize_model_done", "process_weights_after_loading"]


def initialize_model_done(model: torch.nn.Module) -> torch.nn.Module:
    """What initialize_model does right after the model class is built."""
    record_metadata_for_reloading(model)
    return model


def process_weights_after_loading(model: torch.nn.Module, model_config=None, target_device=None) -> None:
    if direct_reload_enabled():
        record_checkpoint_layout(model)
    for module in model.modules():
        quant_method = getattr(module, "quant_method", None)
        if isinstance(quant_method, QuantizeMethodBase):
            quant_method.process_weights_after_loading(module)
    finalize_model_weights(model, target_device)
