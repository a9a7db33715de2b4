"""Stand-in for vllm_gaudi/ops/hpu_compressed_tensors.py, for compressed-tensors checkpoints with
channel-FP8 weights (this tool's default output) or block-FP8 ones (Mistral-Large-3's FP8_BLOCK):

- `HPUCompressedTensorsConfig`: `from_config` (the Gaudi2 `fp8_dtype_flavor` check) and
  `get_quant_method` (a KV-cache method for MLA attention layers, the HPU linear method for
  quantized linears, unquantized for ignored ones). The parsing it inherits from upstream's
  CompressedTensorsConfig keeps every group's targets (a target -> scheme map) and upstream's
  matching order (`find_matched_target`: ignore first, a name or `re:` target, then a class-name
  target such as "Linear"), reduced to what an MLA layer's kv_b_proj needs;
- `HPUCompressedTensorsLinearMethod` and the `HPUCompressedTensorsW8A8Fp8` scheme it installs:
  parameters (Gaudi2 loader wrapper; a float32 block-scale grid for the block strategy),
  `process_weights_after_loading` (channel: weight stored transposed; block: `weight_scale`
  aliased to `weight_scale_inv`, then `fp8_block_linear_postprocess_weights`, which requantizes to
  channel FP8 under VLLM_HPU_FORCE_CHANNEL_FP8), `apply_weights` (the FP8 GEMM that upstream's
  identity-matrix dequant runs through);
- `HPUCompressedTensorsKVCacheMethodForMLA.process_weights_after_loading`, which deletes the layer's
  `_k_scale` / `_v_scale` / `_q_scale` before the MLA layer's own method runs.
"""

from __future__ import annotations

import re

import torch
from torch import nn
from vllm_upstream import BaseKVCacheMethod, LinearBase, MLAAttention, QuantizeMethodBase, UnquantizedLinearMethod

import vllm_gaudi.extension.ops as hpu_ops
from vllm_gaudi import envs
from vllm_gaudi.extension.runtime import get_config

GAUDI2_NATIVE_FP8_FORMAT = "float8_e4m3fnuz"


def _hpu_weight_scale_alias(layer: nn.Module, scale_name: str, hpu_scale_name: str) -> None:
    """Register the layer's `scale_name` also as `hpu_scale_name` (block quantization: HPU ops read
    `weight_scale_inv`), unless that exists already."""
    if hasattr(layer, hpu_scale_name) or not hasattr(layer, scale_name):
        return
    scale = getattr(layer, scale_name)
    scale = scale.data if isinstance(scale, nn.Parameter) else scale
    layer.register_parameter(hpu_scale_name, nn.Parameter(scale, requires_grad=False))


class HPUCompressedTensorsW8A8Fp8:
    """Channel or block strategy (`strategy: channel` / `block` with its `block_structure`),
    dynamic activations."""

    def __init__(self, strategy: str, is_static_input_scheme: bool = False, weight_quant: dict | None = None):
        if strategy not in ("channel", "block") or is_static_input_scheme:
            raise NotImplementedError("stand-in: channel or block FP8 weights with dynamic activations only")
        self.strategy = strategy
        self.is_static_input_scheme = is_static_input_scheme
        self.weight_quant = weight_quant or {}
        self.weight_block_size = self.weight_quant.get("block_structure") if strategy == "block" else None

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, weight_loader=None, **_):  # fmt: skip
        if hpu_ops.is_hpu_gaudi2:
            weight_loader = hpu_ops.gaudi_weight_wrapper(weight_loader)
        rows = sum(output_partition_sizes)
        layer.logical_widths = output_partition_sizes
        layer.input_size_per_partition = input_size_per_partition
        layer.output_size_per_partition = rows
        layer.orig_dtype = params_dtype
        layer.weight_block_size = None
        weight = nn.Parameter(torch.empty(rows, input_size_per_partition, dtype=torch.float8_e4m3fn),
                              requires_grad=False)  # fmt: skip
        weight.output_dim, weight.weight_loader = 0, weight_loader
        layer.register_parameter("weight", weight)
        if self.strategy == "block":  # BlockQuantScaleParameter: float32, one per block
            layer.weight_block_size = self.weight_block_size
            bn, bk = self.weight_block_size
            shape = ((rows + bn - 1) // bn, (input_size_per_partition + bk - 1) // bk)
        else:
            shape = (rows, 1)
        scale = nn.Parameter(torch.full(shape, torch.finfo(torch.float32).min), requires_grad=False)
        scale.output_dim, scale.weight_loader = 0, weight_loader
        layer.register_parameter("weight_scale", scale)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.strategy == "block":  # "Needed for models like Mistral-Large-3-675B"
            _hpu_weight_scale_alias(layer, "weight_scale", "weight_scale_inv")
            layer.quant_config.weight_block_size = self.weight_block_size
            hpu_ops.fp8_block_linear_postprocess_weights(layer, envs.VLLM_HPU_FORCE_CHANNEL_FP8)
            return
        layer.weight_scale = nn.Parameter(layer.weight_scale.data, requires_grad=False)
        layer.weight = nn.Parameter(layer.weight.t(), requires_grad=False)  # [K, N], a transposed view
        layer.input_scale = None
        hpu_ops.fp8_perchannel_linear_postprocess_weights(layer)

    def apply_weights(self, layer: nn.Module, x: torch.Tensor, bias=None) -> torch.Tensor:
        scale = layer.weight_scale_inv if hasattr(layer, "weight_scale_inv") else layer.weight_scale
        scale = scale.transpose(0, 1) if scale.dim() > 1 else scale
        out = hpu_ops.apply_fp8_linear_hpu(input=x.view(-1, x.shape[-1]), weight=layer.weight, weight_scale=scale,
                                           input_scale=getattr(layer, "input_scale", None), bias=bias,
                                           trans_B=False)  # fmt: skip
        return out.view(*x.shape[:-1], -1)


class HPUCompressedTensorsLinearMethod(QuantizeMethodBase):
    def __init__(self, quantization_config: HPUCompressedTensorsConfig):
        self.quantization_config = quantization_config

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, **extra_weight_attrs):  # fmt: skip
        layer.scheme.create_weights(layer, input_size_per_partition, output_partition_sizes, input_size,
                                    output_size, params_dtype, weight_loader=extra_weight_attrs.get("weight_loader"))  # fmt: skip

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.scheme.process_weights_after_loading(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias=None) -> torch.Tensor:
        return layer.scheme.apply_weights(layer, x, bias=bias)


class HPUCompressedTensorsKVCacheMethod(BaseKVCacheMethod):
    SUBMODULES_TO_CHECK = ("k_cache", "v_cache", "matmul_qk", "matmul_av")
    OLD_SCALE_ATTRS = ("_k_scale", "_v_scale", "_q_scale", "_k_scale_float", "_v_scale_float", "_q_scale_float")
    SCALE_ATTRS = ("input_scale", "output_scale", "scale_input", "scale_other")

    def _update_kv_cache_scales(self, layer, k_scale, v_scale) -> None:
        raise NotImplementedError("stand-in: MLA layers only")

    def process_weights_after_loading(self, layer: nn.Module, submodules_to_check=None) -> None:
        super().process_weights_after_loading(layer)
        # Scales as calibrated (448 range, or 240 without scale adjustment) onto this device's range.
        fp8_max_original = 448.0 if get_config().scale_adjustment else 240.0
        q_scale = hpu_ops.FP8_MAX / (layer._q_scale * fp8_max_original)
        k_scale = hpu_ops.FP8_MAX / (layer._k_scale * fp8_max_original)
        v_scale = hpu_ops.FP8_MAX / (layer._v_scale * fp8_max_original)
        self._update_kv_cache_scales(layer, k_scale=k_scale, v_scale=v_scale)
        impl = layer.impl
        impl.matmul_qk.scale_input, impl.matmul_qk.scale_other = q_scale, k_scale
        impl.matmul_av.scale_input, impl.matmul_av.scale_other = 1.0, v_scale
        sdpa = impl.fused_scaled_dot_product_attention
        sdpa.scale_q, sdpa.scale_k, sdpa.scale_v = q_scale.detach(), k_scale.detach(), v_scale.detach()
        sdpa.d_scale_q, sdpa.d_scale_k, sdpa.d_scale_v = (
            1 / q_scale.detach(),
            1 / k_scale.detach(),
            1 / v_scale.detach(),
        )
        for name in self.OLD_SCALE_ATTRS:  # one graph recipe for every decoder layer
            if hasattr(layer, name):
                delattr(layer, name)
        for sub_name in submodules_to_check or self.SUBMODULES_TO_CHECK:
            sub = getattr(impl, sub_name, None)
            if sub is None:
                continue
            for attr in self.SCALE_ATTRS:
                value = getattr(sub, attr, None)
                if value is not None and not isinstance(value, nn.Parameter):
                    value = torch.as_tensor(value).detach().clone().to(torch.float32)
                    setattr(sub, attr, nn.Parameter(value, requires_grad=False))


class HPUCompressedTensorsKVCacheMethodForMLA(HPUCompressedTensorsKVCacheMethod):
    SUBMODULES_TO_CHECK = ("latent_cache_k", "matmul_qk", "matmul_av")

    def _update_kv_cache_scales(self, layer, k_scale, v_scale) -> None:
        layer.impl.latent_cache_k.input_scale = k_scale
        layer.impl.latent_cache_k.output_scale = 1.0 / k_scale

    def process_weights_after_loading(self, layer: nn.Module, submodules_to_check=None) -> None:
        kv_max = max(layer._k_scale, layer._v_scale)
        layer._k_scale.data.copy_(kv_max)
        layer._v_scale.data.copy_(kv_max)
        super().process_weights_after_loading(layer, submodules_to_check=self.SUBMODULES_TO_CHECK)


def _ignored(prefix: str, ignore: list[str]) -> bool:
    for entry in ignore:
        if entry.startswith("re:"):
            if re.match(entry[3:], prefix):
                return True
        elif entry == prefix:
            return True
    return False


def _is_equal_or_regex_match(name: str, target: str) -> bool:
    return re.match(target[3:], name) is not None if target.startswith("re:") else name == target


class HPUCompressedTensorsConfig:
    def __init__(self, ignore: list[str], target_scheme_map: dict[str, dict]):
        self.ignore = list(ignore)
        self.target_scheme_map = target_scheme_map  # target -> {"weights", "input_activations"}, in group order
        self.kv_cache_scheme = None
        self.weight_block_size = None  # set by a block scheme's process_weights_after_loading

    @classmethod
    def _update_scale_adjustment_if_needed(cls, config: dict) -> None:
        # On Gaudi2 a model quantized for its own FP8 range (flavor float8_e4m3fnuz) turns the scale
        # adjustment off, in the process-global runtime config.
        if get_config().scale_adjustment is False or not hpu_ops.is_hpu_gaudi2:
            return
        if config.get("fp8_dtype_flavor") == GAUDI2_NATIVE_FP8_FORMAT:
            get_config().scale_adjustment = False

    @classmethod
    def from_config(cls, config: dict) -> HPUCompressedTensorsConfig:
        cls._update_scale_adjustment_if_needed(config)
        # Upstream's _quantization_scheme_map_from_config: every group's targets in order; a target
        # listed by two groups takes the later group's scheme.
        target_scheme_map = {}
        for group in config.get("config_groups", {}).values():
            for target in group.get("targets") or []:
                target_scheme_map[target] = {"weights": group.get("weights"),
                                             "input_activations": group.get("input_activations")}  # fmt: skip
        return cls(config.get("ignore", []), target_scheme_map)

    def _matched_target(self, prefix: str, layer: nn.Module) -> str | None:
        """Upstream's find_matched_target for an unfused layer: the first name or regex target,
        else the first target the layer's class name contains (case-insensitive, "Linear")."""
        for target in self.target_scheme_map:
            if _is_equal_or_regex_match(prefix, target):
                return target
        cls_name = type(layer).__name__.lower()
        return next((t for t in self.target_scheme_map if t.lower() in cls_name), None)

    def get_quant_method(self, layer: nn.Module, prefix: str):
        if isinstance(layer, MLAAttention):
            return HPUCompressedTensorsKVCacheMethodForMLA(self)
        if isinstance(layer, LinearBase):
            target = None if _ignored(prefix, self.ignore) else self._matched_target(prefix, layer)
            if target is None:
                return UnquantizedLinearMethod()
            scheme = self.target_scheme_map[target]
            w, a = scheme["weights"], scheme.get("input_activations") or {}
            if (w.get("type"), w.get("num_bits")) != ("float", 8):
                raise NotImplementedError(f"stand-in: weights {w} for {prefix}")
            layer.scheme = HPUCompressedTensorsW8A8Fp8(w.get("strategy"), not a.get("dynamic"), w)
            return HPUCompressedTensorsLinearMethod(self)
        return None
