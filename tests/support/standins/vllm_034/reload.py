"""Stand-in for vllm 0.34.0's vllm/model_executor/model_loader/reload/ (tests only): the three ways
a running engine takes new weights, as they touch an MLA layer.

- Layerwise (the default; layerwise.py, meta.py, lifecycle.py): `record_metadata_for_reloading`
  once the model is built; `initialize_layerwise_reload` saves every module's kernel tensors and
  puts the module back on meta tensors with the metadata recorded at build time (so an MLA layer
  has no W_UK_T / W_UV during the reload), and wraps the loaders; once all of a module's weights
  have arrived, `_layerwise_process` materializes it, loads them, runs its quant method and copies
  the result into the saved kernel tensors (the same storage). `finalize_layerwise_reload` puts the
  saved tensors back on the attention layers (and on modules nothing was loaded into), then runs
  `finalize_model_weights` without a device.
- Direct (`VLLM_RELOAD_MODE=direct`; direct.py): the cold start records each tensor's checkpoint
  layout before post-load processing; `begin_direct_reload` refuses a model whose processing
  replaced a checkpoint parameter's object, and views re-laid-out tensors back to that layout;
  the loaders write in place; `finish_direct_reload` reruns the whole `process_weights_after_loading`.
- Kernel format (`reload_weights(..., is_checkpoint_format=False)`; inplace.py): each tensor
  copied into the parameter of its name, then `finalize_model_weights` under
  `weights_already_processed` (MLAAttention recomputes W_UK_T / W_UV from kv_b_proj all the same).

Left out: online quantization, torchao, LoRA names, the copy counter (a module's loaded elements
are the numel of the parameters loaded), padding fill, tensors shared with a draft model.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field

import torch
from vllm_upstream import AttentionLayerBase, QuantizeMethodBase

from .utils import is_weights_pre_processed, storage_view, weights_already_processed
from .weight_utils import finalize_model_weights

# --------------------------------------------------------------------------- layerwise.py / meta.py


@dataclass
class LayerReloadingInfo:
    restore_metadata: tuple[dict, dict] = field(default_factory=lambda: ({}, {}))
    kernel_tensors: tuple[dict, dict] | None = None
    kernel_non_persistent: set = field(default_factory=set)
    loaded_weights: list = field(default_factory=list)
    load_numel: int = 0
    load_numel_total: int | None = None

    def can_load(self) -> bool:
        return self.load_numel_total is not None

    def reset(self) -> None:
        self.kernel_tensors, self.loaded_weights, self.load_numel, self.load_numel_total = None, [], 0, None


LAYERWISE_INFO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _info(layer: torch.nn.Module) -> LayerReloadingInfo:
    if layer not in LAYERWISE_INFO:
        LAYERWISE_INFO[layer] = LayerReloadingInfo()
    return LAYERWISE_INFO[layer]


def _params_buffers(layer: torch.nn.Module) -> tuple[dict, dict]:
    return (
        {n: p for n, p in layer._parameters.items() if p is not None},
        {n: b for n, b in layer._buffers.items() if b is not None},
    )


def _to_meta(t: torch.Tensor) -> torch.Tensor:
    meta = torch.empty_like(t, device="meta")
    if isinstance(t, torch.nn.Parameter):
        meta = torch.nn.Parameter(meta, requires_grad=False)
    meta.__dict__.update({k: v for k, v in t.__dict__.items() if k != "_ckpt"})
    return meta


def record_metadata_for_reloading(model: torch.nn.Module) -> None:
    for layer in model.modules():
        params, buffers = _params_buffers(layer)
        _info(layer).restore_metadata = ({n: _to_meta(p) for n, p in params.items()},
                                         {n: _to_meta(b) for n, b in buffers.items()})  # fmt: skip


def _layer_tensors(layer) -> dict:
    params, buffers = _params_buffers(layer)
    return params | buffers


@torch.no_grad()
def initialize_layerwise_reload(model: torch.nn.Module) -> None:
    for layer in model.modules():
        info = _info(layer)
        if info.can_load():
            continue
        info.kernel_tensors = _params_buffers(layer)
        info.kernel_non_persistent = set(layer._non_persistent_buffers_set)
        non_persistent = set(layer._non_persistent_buffers_set)
        restore_params, restore_buffers = info.restore_metadata
        for name in _layer_tensors(layer).keys() | restore_params.keys() | restore_buffers.keys():
            if hasattr(layer, name):
                delattr(layer, name)
        for name, meta in restore_params.items():
            layer.register_parameter(name, _to_meta(meta))
        for name, meta in restore_buffers.items():
            layer.register_buffer(name, _to_meta(meta), persistent=name not in non_persistent)
        info.load_numel_total = sum(t.numel() for t in _layer_tensors(layer).values())
        for param in _layer_tensors(layer).values():
            original = getattr(param, "weight_loader", None)
            if original is not None:
                param.weight_loader = _online_loader(layer, param, original)


def _online_loader(layer, param, original):
    def online_process_loader(p, loaded_weight, *args):
        info = _info(layer)
        name = next(n for n, t in _layer_tensors(layer).items() if t is p)
        info.loaded_weights.append((name, loaded_weight, args))
        info.load_numel += p.numel()
        if info.load_numel >= info.load_numel_total:
            _layerwise_process(layer, info)

    online_process_loader.__wrapped__ = original
    return online_process_loader


def _original_loader(t):
    loader = t.weight_loader
    while getattr(loader, "__name__", "") == "online_process_loader":
        loader = loader.__wrapped__
    return loader


@torch.no_grad()
def _layerwise_process(layer: torch.nn.Module, info: LayerReloadingInfo) -> None:
    for name, t in _layer_tensors(layer).items():  # materialize_layer
        if t.is_meta:
            real = torch.empty_like(t, device="cpu")
            if isinstance(t, torch.nn.Parameter):
                real = torch.nn.Parameter(real, requires_grad=False)
            real.__dict__.update(t.__dict__)
            setattr(layer, name, real)
    for t in _layer_tensors(layer).values():
        if hasattr(t, "weight_loader"):
            t.weight_loader = _original_loader(t)
    for name, loaded_weight, args in info.loaded_weights:
        param = getattr(layer, name)
        param.weight_loader(param, loaded_weight, *args)
    quant_method = getattr(layer, "quant_method", None)
    if isinstance(quant_method, QuantizeMethodBase):
        quant_method.process_weights_after_loading(layer)
    if info.kernel_tensors is not None:
        _copy_and_restore_kernel_tensors(layer, info)
    info.reset()


def _copy_and_restore_kernel_tensors(layer, info) -> None:
    parameters, buffers = info.kernel_tensors
    for name, param in parameters.items():
        param.data.copy_(getattr(layer, name))
    for name, buffer in buffers.items():
        if name in layer._buffers:
            buffer.data.copy_(getattr(layer, name))
    _place_kernel_tensors(layer, info)


def _place_kernel_tensors(layer, info) -> None:
    for name in _layer_tensors(layer):
        delattr(layer, name)
    parameters, buffers = info.kernel_tensors
    for name, param in parameters.items():
        layer.register_parameter(name, param)
    for name, buffer in buffers.items():
        layer.register_buffer(name, buffer, persistent=name not in info.kernel_non_persistent)


def _is_deferred_attention_layer(layer) -> bool:
    return isinstance(layer, AttentionLayerBase) and callable(getattr(layer, "process_weights_after_loading", None))


def finalize_layerwise_processing(model: torch.nn.Module) -> None:
    deferred = []
    for layer in model.modules():
        info = _info(layer)
        if not info.can_load():
            info.reset()
            continue
        if _is_deferred_attention_layer(layer):
            deferred.append((layer, info))
            continue
        if info.load_numel <= 0:
            _place_kernel_tensors(layer, info)
        elif info.load_numel < info.load_numel_total:
            _layerwise_process(layer, info)
        info.reset()
    for layer, info in deferred:  # _finalize_attention_layer, without checkpoint scales
        if info.load_numel > 0:
            raise NotImplementedError("stand-in: attention scales in a reload")
        _place_kernel_tensors(layer, info)
        info.reset()


def finalize_layerwise_reload(model: torch.nn.Module) -> None:
    finalize_layerwise_processing(model)
    finalize_model_weights(model)


# --------------------------------------------------------------------------- direct.py


def direct_reload_enabled() -> bool:
    return os.environ.get("VLLM_RELOAD_MODE", "layerwise") == "direct"


def _layout(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.dtype, t.storage_offset()


def _loadable_tensors(model: torch.nn.Module):
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        persistent = [(n, b) for n, b in module._buffers.items() if n not in module._non_persistent_buffers_set]
        for name, t in [*module._parameters.items(), *persistent]:
            if t is None or id(t) in seen:
                continue
            seen.add(id(t))
            yield (f"{module_name}.{name}" if module_name else name), t


def record_checkpoint_layout(model: torch.nn.Module) -> None:
    if hasattr(model, "_ckpt_param_names") or is_weights_pre_processed():
        return
    model._ckpt_owner = object()
    for _, t in _loadable_tensors(model):
        if not t.is_meta and not hasattr(t, "_ckpt"):
            t._ckpt = (model._ckpt_owner, _layout(t), {}, t.untyped_storage().data_ptr())
    model._ckpt_param_names = frozenset(
        name for name, p in model.named_parameters(remove_duplicate=False) if hasattr(p, "_ckpt")
    )


@torch.no_grad()
def begin_direct_reload(model: torch.nn.Module) -> None:
    if not hasattr(model, "_ckpt_param_names"):
        raise RuntimeError("direct reload: no checkpoint layout was recorded")
    replaced = [
        name for name, p in model.named_parameters(remove_duplicate=False)
        if name in model._ckpt_param_names and not hasattr(p, "_ckpt")
    ]  # fmt: skip
    if replaced:
        raise RuntimeError(
            f"direct reload: post-load processing replaced the parameter object of {len(replaced)} checkpoint "
            f"tensors (e.g. {replaced[:3]}); keep it with `replace_parameter` / `retire_parameter` instead"
        )
    views = []
    for name, t in _loadable_tensors(model):
        ckpt = getattr(t, "_ckpt", None)
        if ckpt is None or _layout(t) == ckpt[1]:
            continue
        shape, stride, dtype, offset = ckpt[1]
        storage = t.untyped_storage()
        if storage.data_ptr() != ckpt[3]:
            offset = t.storage_offset()
        span = 0 if 0 in shape else 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True))
        if (offset + span) * dtype.itemsize > storage.nbytes():
            raise RuntimeError(f"direct reload: {name} storage cannot hold its checkpoint layout")
        views.append((t, storage_view(storage, offset, shape, stride, dtype)))
    model._direct_reload_begun = True
    for t, view in views:
        t.data = view


def finish_direct_reload(model: torch.nn.Module) -> None:
    from .loader_utils import process_weights_after_loading

    if not model.__dict__.pop("_direct_reload_begun", False):
        raise RuntimeError("direct reload: finish without a begin; start a new full update")
    for module in model.modules():
        if isinstance(getattr(module, "quant_method", None), QuantizeMethodBase):
            module.__dict__.pop("_already_called_process_weights_after_loading", None)
    process_weights_after_loading(model)


# --------------------------------------------------------------------------- lifecycle.py / inplace.py


def start_reload(model: torch.nn.Module) -> None:
    if direct_reload_enabled():
        begin_direct_reload(model)
    else:
        initialize_layerwise_reload(model)


def finish_reload(model: torch.nn.Module) -> None:
    if direct_reload_enabled():
        finish_direct_reload(model)
    else:
        finalize_layerwise_reload(model)


def _parameter(model: torch.nn.Module, name: str) -> torch.nn.Parameter:
    module_name, _, param_name = name.rpartition(".")
    return model.get_submodule(module_name).get_parameter(param_name)


def reload_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor], is_checkpoint_format: bool = True) -> None:
    """inplace.reload_weights with the weights given: {parameter name: tensor}."""
    if is_checkpoint_format:
        start_reload(model)
        for name, tensor in weights.items():
            param = _parameter(model, name)
            param.weight_loader(param, tensor)
        finish_reload(model)
        return
    with torch.no_grad():
        for name, tensor in weights.items():
            _parameter(model, name).copy_(tensor)
    with weights_already_processed():
        finalize_model_weights(model)
