"""Stand-in for the parts of upstream vLLM that vllm-gaudi's MLA weight loading runs through (tests
only; see README.md in this folder).

The default test group has no vLLM, so these follow vLLM 0.32.0's source (the CPU build the `vllm`
test group installs), function by function:

- `model_executor/utils.py`: `replace_parameter`;
- `model_executor/layers/attention/attention.py`: `should_load_quant_weights`,
  `set_default_quant_scales`, `_init_kv_cache_quant`;
- `model_executor/layers/attention/mla_attention.py`: `split_kv_b_proj`, and of `MLAAttention` what
  `__init__` sets up for loading and its `process_weights_after_loading` (lines 1220-1345: the AMX
  branch, the DCP query-replication check and its `W_UK_T_dcp_qrep`, the default branch);
- `distributed/parallel_state.py`: `get_dcp_group`, for a group of one rank (its all_gather returns
  its input);
- `model_executor/layers/quantization/utils/quant_utils.py`: `get_and_maybe_dequant_weights`;
- `model_executor/layers/quantization/kv_cache.py`: `BaseKVCacheMethod`;
- `model_executor/layers/quantization/fp8.py`: `Fp8Config` and the `create_weights` of
  `Fp8LinearMethod` for block-FP8 checkpoints;
- `model_executor/layers/linear.py`: `UnquantizedLinearMethod`, and `ColumnParallelLinear`'s
  split of the output rows between tensor-parallel ranks;
- `model_executor/model_loader/utils.py`: `process_weights_after_loading` (every quant method first,
  then the attention layers).

Left out: the ROCm aiter branches (FP4/FP8 BMM), marlin/DeepGEMM dequant, DCP with more than one
rank. The AMX branch runs with an impl whose `uses_amx_bmm` is set (the tests bring one: AMXMLAImpl
itself needs the CPU build's packing kernels). The `vllm` test group checks the functions here
against the real ones (tests/test_vllm_standin_conformance.py). The stand-ins of vllm 0.33.0 and of
vLLM at commit 2fdb4ed (vllm_033/, vllm_2fdb4ed/) reuse what did not change from here.
"""

from __future__ import annotations

import math

import torch
from torch import nn

# --------------------------------------------------------------------------- model_executor/utils.py


def replace_parameter(layer: nn.Module, param_name: str, new_tensor: torch.Tensor | None, prefer_copy: bool = False):
    """Register `new_tensor` as the parameter `param_name` (a new nn.Parameter, keeping the old one's
    weight_loader), or with `prefer_copy` copy it into a compatible existing parameter in place."""
    if new_tensor is None:
        setattr(layer, param_name, None)
        return
    old = getattr(layer, param_name, None)
    extra = {k: v for k, v in new_tensor.__dict__.items() if k not in ("weight_loader", "_weight_loader")}
    data = new_tensor.data if isinstance(new_tensor, nn.Parameter) else new_tensor
    compatible = old is not None and old.shape == data.shape and old.dtype == data.dtype and old.device == data.device
    if prefer_copy and compatible:
        old.copy_(data)
        for k, v in extra.items():
            setattr(old, k, v)
        return
    param = nn.Parameter(data, requires_grad=False)
    for k, v in extra.items():
        setattr(param, k, v)
    if old is not None and hasattr(old, "weight_loader"):
        param.weight_loader = old.weight_loader
    setattr(layer, param_name, param)


# --------------------------------------------------------------------------- quantization base classes


class QuantizeMethodBase:
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        return None


class UnquantizedLinearMethod(QuantizeMethodBase):
    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, **extra_weight_attrs):  # fmt: skip
        weight = nn.Parameter(
            torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype),
            requires_grad=False,
        )
        weight.output_dim = 0
        weight.weight_loader = extra_weight_attrs["weight_loader"]
        layer.register_parameter("weight", weight)

    def apply(self, layer, x, bias=None):
        return nn.functional.linear(x, layer.weight, bias)


class LinearBase(nn.Module):
    """Marker base of the linear layers, as quant configs test `isinstance(layer, LinearBase)`."""


class ColumnParallelLinear(LinearBase):
    """A linear layer whose output rows are split between tensor-parallel ranks; each loaded tensor
    with an `output_dim` is narrowed to this rank's rows (scale grids by their own row count)."""

    def __init__(self, input_size: int, output_size: int, *, quant_config=None, prefix: str = "",
                 params_dtype: torch.dtype = torch.bfloat16, tp_rank: int = 0, tp_size: int = 1):  # fmt: skip
        super().__init__()
        if output_size % tp_size:
            raise ValueError(f"{output_size} output rows do not split between {tp_size} ranks")
        self.prefix = prefix
        self.quant_config = quant_config
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.input_size_per_partition = input_size
        self.output_size_per_partition = output_size // tp_size
        method = quant_config.get_quant_method(self, prefix=prefix) if quant_config is not None else None
        self.quant_method = method if method is not None else UnquantizedLinearMethod()
        self.quant_method.create_weights(
            self, input_size, [self.output_size_per_partition], input_size, output_size, params_dtype,
            weight_loader=self.weight_loader,
        )  # fmt: skip

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        if getattr(param, "output_dim", None) is not None and loaded_weight.dim() > 0:
            rows = param.shape[param.output_dim]
            loaded_weight = loaded_weight.narrow(param.output_dim, self.tp_rank * rows, rows)
        if tuple(param.shape) != tuple(loaded_weight.shape):
            raise ValueError(f"{self.prefix}: parameter {tuple(param.shape)} vs loaded {tuple(loaded_weight.shape)}")
        param.data.copy_(loaded_weight)


class Fp8Config:
    """Block-FP8 checkpoints (DeepSeek's `quant_method: fp8` with `weight_block_size`)."""

    def __init__(self, weight_block_size=None, activation_scheme="dynamic"):
        self.weight_block_size = list(weight_block_size) if weight_block_size else None
        self.activation_scheme = activation_scheme
        self.is_checkpoint_fp8_serialized = True

    @classmethod
    def from_config(cls, config: dict) -> Fp8Config:
        return cls(config.get("weight_block_size"), config.get("activation_scheme", "dynamic"))

    def get_quant_method(self, layer: nn.Module, prefix: str):
        import vllm_gaudi.ops.hpu_fp8 as hpu_fp8  # vllm-gaudi replaces fp8.Fp8LinearMethod with its own

        if isinstance(layer, LinearBase):
            return hpu_fp8.Fp8LinearMethod(self)
        # MLAAttention is not an `Attention`: no KV-cache method for it.
        return None


class Fp8LinearMethod(QuantizeMethodBase):
    """Upstream's Fp8LinearMethod, for what vllm-gaudi inherits from it: the block-FP8 parameters."""

    def __init__(self, quant_config: Fp8Config):
        self.quant_config = quant_config
        self.weight_block_size = quant_config.weight_block_size
        self.block_quant = self.weight_block_size is not None

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, **extra_weight_attrs):  # fmt: skip
        if not self.block_quant:
            raise NotImplementedError("stand-in: only block-FP8 checkpoints")
        rows = sum(output_partition_sizes)
        weight_loader = extra_weight_attrs["weight_loader"]
        layer.logical_widths = output_partition_sizes
        layer.input_size_per_partition = input_size_per_partition
        layer.output_size_per_partition = rows
        layer.orig_dtype = params_dtype
        layer.weight_block_size = self.weight_block_size
        weight = nn.Parameter(torch.empty(rows, input_size_per_partition, dtype=torch.float8_e4m3fn),
                              requires_grad=False)  # fmt: skip
        weight.output_dim, weight.weight_loader = 0, weight_loader
        layer.register_parameter("weight", weight)
        bn, bk = self.weight_block_size
        grid = torch.empty(math.ceil(rows / bn), math.ceil(input_size_per_partition / bk), dtype=torch.float32)
        scale = nn.Parameter(grid, requires_grad=False)
        scale.output_dim, scale.weight_loader = 0, weight_loader
        layer.register_parameter("weight_scale_inv", scale)


# --------------------------------------------------------------------------- kv_cache.py


class BaseKVCacheMethod(QuantizeMethodBase):
    """Adds loadable q/k/v/prob scales to an attention layer; after loading, moves them into the
    layer's `_q_scale` ... buffers and deletes the loadable ones."""

    def __init__(self, quant_config):
        self.quant_config = quant_config

    def create_weights(self, layer: nn.Module) -> None:
        for name in ("q_scale", "k_scale", "v_scale", "prob_scale"):
            setattr(layer, name, nn.Parameter(torch.tensor(-1.0), requires_grad=False))  # -1: not loaded

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not hasattr(layer, "q_scale"):
            return
        if layer.kv_cache_dtype not in ("auto", None):
            raise NotImplementedError("stand-in: only an unquantized KV cache")
        q_scale = layer.q_scale if layer.q_scale > 0.0 else 1.0
        prob_scale = layer.prob_scale if layer.prob_scale > 0.0 else 1.0
        layer._q_scale.copy_(q_scale)
        layer._q_scale_float = q_scale.item() if isinstance(q_scale, torch.Tensor) else q_scale
        layer._prob_scale.copy_(prob_scale)
        for name in ("k_scale", "v_scale", "q_scale", "prob_scale"):
            delattr(layer, name)


# --------------------------------------------------------------------------- attention.py


def should_load_quant_weights(quant_method) -> bool:
    return quant_method is not None and not isinstance(quant_method, UnquantizedLinearMethod)


def set_default_quant_scales(layer: nn.Module, register_buffer: bool = False) -> None:
    names = ("_k_scale", "_v_scale", "_q_scale", "_prob_scale")
    if register_buffer:
        for name in names:
            layer.register_buffer(name, torch.tensor(1.0, dtype=torch.float32))
    else:
        for name in names:
            getattr(layer, name).fill_(1.0)
    layer._q_scale_float = layer._k_scale_float = layer._v_scale_float = layer._prob_scale_float = 1.0
    layer._k_scale_cpu = torch.tensor(1.0, dtype=torch.float32)
    layer._v_scale_cpu = torch.tensor(1.0, dtype=torch.float32)


def _init_kv_cache_quant(layer: nn.Module, quant_config, prefix: str) -> None:
    set_default_quant_scales(layer, register_buffer=True)
    layer._o_scale_float = None
    method = quant_config.get_quant_method(layer, prefix=prefix) if quant_config else None
    if should_load_quant_weights(method):
        assert isinstance(method, BaseKVCacheMethod)
        layer.quant_method = method
        method.create_weights(layer)


# --------------------------------------------------------------------------- quant_utils.py


def get_and_maybe_dequant_weights(layer: nn.Module, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The layer's weight unquantized, [out, in]."""
    weight = layer.weight
    if layer.quant_method is None or isinstance(layer.quant_method, UnquantizedLinearMethod):
        return weight.to(out_dtype)
    if isinstance(layer.quant_method, Fp8LinearMethod):
        # vllm-gaudi's MLA layer handles every FP8 weight with weight_scale_inv itself.
        raise NotImplementedError("stand-in: scaled_dequantize of an Fp8LinearMethod weight")
    # Any other method: push an identity matrix through the layer's own matmul.
    eye = torch.eye(layer.input_size_per_partition, dtype=out_dtype, device=weight.device)
    return layer.quant_method.apply(layer, eye, bias=None).to(out_dtype).T


# --------------------------------------------------------------------------- parallel_state.py


class _OneRankGroup:
    """`GroupCoordinator` of a DCP group of one rank."""

    world_size = 1

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return input_  # "Bypass the function if we are using only 1 GPU"


def get_dcp_group() -> _OneRankGroup:
    return _OneRankGroup()


# --------------------------------------------------------------------------- mla_attention.py


def split_kv_b_proj(kv_b_proj, out_dtype, kv_lora_rank, num_heads, qk_nope_head_dim, v_head_dim):
    """Dequantized kv_b_proj -> (W_UK [L, N, P], W_UV [L, N, V]), views of its transpose."""
    weight = get_and_maybe_dequant_weights(kv_b_proj, out_dtype=out_dtype).T
    assert weight.shape == (kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim)), tuple(weight.shape)
    weight = weight.view(kv_lora_rank, num_heads, qk_nope_head_dim + v_head_dim)
    return weight.split([qk_nope_head_dim, v_head_dim], dim=-1)


class AttentionImplBase:
    """A backend impl that does nothing after loading (CPU_MLA's, and the base of every MLA impl)."""

    def __init__(self, **impl_args):
        pass

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        return None


class AttentionLayerBase:
    """Marker base: model_loader's second pass calls process_weights_after_loading on these."""


class MLAAttention(nn.Module, AttentionLayerBase):
    """What MLAAttention.__init__ sets up that weight loading reads, and process_weights_after_loading.

    The attention backend's impl class is `impl_cls` (the real one asks get_attn_backend)."""

    impl_cls: type = AttentionImplBase

    def __init__(self, num_heads: int, scale: float, qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int,
                 q_lora_rank: int | None, kv_lora_rank: int, kv_b_proj: nn.Module, dcp_q_replicate: bool = False,
                 cache_config=None, quant_config=None, prefix: str = "", vllm_config=None, **extra):  # fmt: skip
        super().__init__()
        self.num_heads = num_heads
        self.scale = scale
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.kv_b_proj = kv_b_proj
        self.dcp_q_replicate = dcp_q_replicate
        self.W_UK_T_dcp_qrep = None
        self.head_size = kv_lora_rank + qk_rope_head_dim
        self.layer_name = prefix
        self.quant_config = quant_config
        self.kv_cache_dtype = getattr(cache_config, "cache_dtype", "auto") if cache_config is not None else "auto"
        _init_kv_cache_quant(self, quant_config, prefix)
        self.impl = self.impl_cls(
            num_heads=num_heads, head_size=self.head_size, scale=scale, kv_cache_dtype=self.kv_cache_dtype,
            kv_lora_rank=kv_lora_rank, qk_nope_head_dim=qk_nope_head_dim, qk_rope_head_dim=qk_rope_head_dim,
            v_head_dim=v_head_dim, kv_b_proj=kv_b_proj,
        )  # fmt: skip
        self.q_pad_num_heads = getattr(self.impl, "q_pad_num_heads", None)
        self.is_amx_bmm_enabled = getattr(self.impl, "uses_amx_bmm", False)
        self.is_aiter_triton_fp8_bmm_enabled = False
        self.is_aiter_triton_fp4_bmm_enabled = False
        if vllm_config is not None:
            ctx = vllm_config.compilation_config.static_forward_context
            if prefix in ctx:
                raise ValueError(f"Duplicate layer name: {prefix}")
            ctx[prefix] = self
        self._vllm_config = vllm_config

    def process_weights_after_loading(self, act_dtype: torch.dtype):
        self.impl.process_weights_after_loading(act_dtype)
        if self.is_amx_bmm_enabled:  # the impl packed its own copies: release the raw weight
            self.kv_b_proj.weight = nn.Parameter(torch.empty(0), requires_grad=False)
            return
        if self.dcp_q_replicate:
            assert self.q_pad_num_heads in (None, self.num_heads)
        if self.is_aiter_triton_fp4_bmm_enabled or self.is_aiter_triton_fp8_bmm_enabled:
            raise NotImplementedError("stand-in: the ROCm aiter BMM branches")
        w_uk, w_uv = split_kv_b_proj(
            self.kv_b_proj, act_dtype, self.kv_lora_rank, self.num_heads, self.qk_nope_head_dim, self.v_head_dim
        )
        replace_parameter(self, "W_UV", w_uv.transpose(0, 1), prefer_copy=True)  # [N, L, V]
        replace_parameter(self, "W_UK_T", w_uk.permute(1, 2, 0), prefer_copy=True)  # [N, P, L]
        if self.dcp_q_replicate:
            replace_parameter(
                self, "W_UK_T_dcp_qrep", get_dcp_group().all_gather(self.W_UK_T.contiguous(), dim=0), prefer_copy=True
            )
        method = self.quant_config.get_quant_method(self, prefix=self.layer_name) if self.quant_config else None
        if not should_load_quant_weights(method):
            set_default_quant_scales(self, register_buffer=False)


# --------------------------------------------------------------------------- model_loader/utils.py


def process_weights_after_loading(model: nn.Module, act_dtype: torch.dtype) -> None:
    """Every module's quant method first, then every attention layer (which may read what the
    quant methods left, e.g. a requantized kv_b_proj)."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, QuantizeMethodBase):
            method.process_weights_after_loading(module)
    for module in model.modules():
        if isinstance(module, AttentionLayerBase):
            module.process_weights_after_loading(act_dtype)
