"""Stand-in for vllm 0.34.0's vllm/model_executor/utils.py: `replace_parameter` with
`_in_own_storage` / `storage_view` / `_extent`, and `weights_already_processed`.

Against 0.33.0: when the existing parameter's layout differs from the new tensor's, the new tensor
is copied into the bytes the parameter spans where it fits (so the loaded storage and its address
are kept), else `.data` is rebound to it; a new parameter is registered only when there is none
(or it is an online requantization source, or a meta parameter getting real data). On a first
load W_UK_T / W_UV do not exist yet, so they are registered as given: views of kv_b_proj's weight
when that is unquantized and already in the activation dtype.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

_weights_pre_processed = contextvars.ContextVar("weights_pre_processed", default=False)


@contextlib.contextmanager
def weights_already_processed():
    token = _weights_pre_processed.set(True)
    try:
        yield
    finally:
        _weights_pre_processed.reset(token)


def is_weights_pre_processed() -> bool:
    return _weights_pre_processed.get()


def _extent(t: torch.Tensor) -> int:
    """Elements `t` spans in its storage."""
    if t.numel() == 0:
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))


def storage_view(storage, offset: int, shape, stride, dtype) -> torch.Tensor:
    return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, shape, stride)


def _in_own_storage(old: torch.Tensor, new: torch.Tensor, whole_storage: bool = False) -> torch.Tensor:
    """`new` copied into the bytes `old` spans when it fits there, else `new` itself."""
    storage = old.untyped_storage()
    offset, size = old.storage_offset() * old.element_size(), new.element_size()
    span = _extent(new)
    if whole_storage:
        fits = span >= new.numel() and offset + span * size <= storage.nbytes()
    else:
        fits = (
            new.numel() > 0
            and span == new.numel()
            and _extent(old) == old.numel()
            and new.numel() * size <= old.numel() * old.element_size()
        )
    if not fits or old.device != new.device or new.untyped_storage().data_ptr() == storage.data_ptr() or offset % size:
        return new
    return storage_view(storage, offset // size, new.shape, new.stride(), new.dtype).copy_(new)


def replace_parameter(layer: torch.nn.Module, param_name: str, new_tensor: torch.Tensor | None):
    if new_tensor is None:
        setattr(layer, param_name, None)
        return
    old_param = getattr(layer, param_name, None)
    new_tensor_attrs = dict(new_tensor.__dict__)
    for name in ("weight_loader", "_weight_loader", "_ckpt"):
        new_tensor_attrs.pop(name, None)
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
        elif getattr(getattr(layer, "quant_method", None), "uses_meta_device", False):
            old_param.data = new_tensor
        else:
            from .reload import direct_reload_enabled  # model_loader/reload/direct.py there

            old_param.data = _in_own_storage(old_param, new_tensor, whole_storage=direct_reload_enabled())
        for attr_name, attr in new_tensor_attrs.items():
            setattr(old_param, attr_name, attr)
        return
    new_param = torch.nn.Parameter(new_tensor, requires_grad=False)
    for attr_name, attr in new_tensor_attrs.items():
        setattr(new_param, attr_name, attr)
    if old_param is not None and hasattr(old_param, "weight_loader"):
        new_param.weight_loader = old_param.weight_loader
    setattr(layer, param_name, new_param)
