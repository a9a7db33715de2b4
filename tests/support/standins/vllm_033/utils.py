"""Stand-in for vllm 0.33.0's vllm/model_executor/utils.py: `replace_parameter` (lines 71-149)."""

from __future__ import annotations

import torch


def replace_parameter(layer: torch.nn.Module, param_name: str, new_tensor: torch.Tensor | None):
    """Keep an existing parameter object: copy into it when shape, stride, dtype and device match
    (its data_ptr stays), else rebind its `.data`. Register a new parameter only if there is none
    (or it is an online requantization source, or a meta parameter getting real data)."""
    if new_tensor is None:
        setattr(layer, param_name, None)
        return
    old_param = getattr(layer, param_name, None)
    new_tensor_attrs = dict(new_tensor.__dict__)
    new_tensor_attrs.pop("weight_loader", None)
    new_tensor_attrs.pop("_weight_loader", None)
    if isinstance(new_tensor, torch.nn.Parameter):
        new_tensor = new_tensor.data
    if (
        isinstance(old_param, torch.nn.Parameter)
        and not getattr(old_param, "requantization_source", False)
        and not (old_param.is_meta and not new_tensor.is_meta)
    ):
        if (
            old_param.shape == new_tensor.shape
            and old_param.stride() == new_tensor.stride()
            and old_param.dtype == new_tensor.dtype
            and old_param.device == new_tensor.device
        ):
            old_param.data.copy_(new_tensor)
        else:
            old_param.data = new_tensor
        for attr_name, attr in new_tensor_attrs.items():
            setattr(old_param, attr_name, attr)
        return
    new_param = torch.nn.Parameter(new_tensor, requires_grad=False)
    for attr_name, attr in new_tensor_attrs.items():
        setattr(new_param, attr_name, attr)
    if old_param is not None and hasattr(old_param, "weight_loader"):
        new_param.weight_loader = old_param.weight_loader  # set_weight_attrs, without the TPU sync wrapper
    setattr(layer, param_name, new_param)
