"""Stand-in for vllm_gaudi/extension/ops.py: the FP8 weight helpers that kv_b_proj's linear method and
HPUMLAAttention call.

Plain torch replaces the two HPU ops:
- `torch.ops.hpu.cast_to_fp8_v2(x, scale, ...)`: `x * scale` in fp32, rounded to nearest even and
  saturated to the e4m3 range (`_cast_to_fp8`);
- `torch.ops.hpu.fp8_gemm_v2(A, trans_A, B, trans_B, ..., A_scale_inv, B_scale_inv)`: the fp32
  product of the fp8 operands times both scales, in `out_dtype` (`_fp8_gemm`).
The device type, which the real module asks the HPU for when imported, comes from
$VLLM_GAUDI_STANDIN_DEVICE ("gaudi2"; anything else is Gaudi3), also read at import.
"""

from __future__ import annotations

import os
import types

import torch

from vllm_gaudi.extension.runtime import get_config

DEVICE_ENV = "VLLM_GAUDI_STANDIN_DEVICE"
is_hpu_gaudi2 = os.environ.get(DEVICE_ENV, "gaudi3").lower() == "gaudi2"
is_hpu_gaudi3 = not is_hpu_gaudi2
# Gaudi2's FP8 range is e4m3fnuz's (240); the tensors stay torch.float8_e4m3fn.
FP8_MAX = torch.finfo(torch.float8_e4m3fnuz if is_hpu_gaudi2 else torch.float8_e4m3fn).max


def _cast_to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    e4m3_max = torch.finfo(torch.float8_e4m3fn).max
    return (x.float() * scale.float()).clamp(-e4m3_max, e4m3_max).to(torch.float8_e4m3fn)


def _fp8_gemm(a, b, *, trans_a=False, trans_b=False, out_dtype, a_scale_inv, b_scale_inv, bias=None):
    a = a.float().T if trans_a else a.float()
    b = b.float().T if trans_b else b.float()
    out = (a @ b) * a_scale_inv.float() * b_scale_inv.float()
    if bias is not None:
        out = out + bias
    return out.to(out_dtype)


def pad_weight(weight: torch.Tensor, block_size):
    """Zero-pad the last two dims up to whole blocks; returns (weight, original M, original N)."""
    m, n = weight.shape[-2:]
    pad_m, pad_n = (-m) % block_size[0], (-n) % block_size[1]
    if pad_m or pad_n:
        weight = torch.nn.functional.pad(weight, (0, pad_n, 0, pad_m), mode="constant", value=0)
    return weight, m, n


def unpad_weight(weight: torch.Tensor, original_m, original_n, keep_first_dim=False):
    if weight.shape[-2] == original_m and weight.shape[-1] == original_n:
        return weight
    return weight[:, :original_m, :original_n] if keep_first_dim else weight[:original_m, :original_n]


def pad_block_fp8_weight_naive(weight, weight_scale, block_size):
    assert len(block_size) == 2
    weight, orig_m, orig_n = pad_weight(weight, block_size)
    m, n = weight.shape[-2:]
    assert tuple(weight_scale.shape[-2:]) == (m // block_size[0], n // block_size[1])
    return weight, orig_m, orig_n


def dequant_block_fp8_weight_naive(weight, weight_scale, block_size, dtype=torch.bfloat16, original_M=None,
                                   original_N=None, do_unpad=False):  # fmt: skip
    """Each [bm, bn] tile of the (padded) 2-D weight times its scale, both cast to `dtype` first."""
    if weight_scale is None:
        return weight
    weight_scale = weight_scale.to(weight.device)
    assert len(block_size) == 2 and weight.dim() == 2, "stand-in: 2-D weights only"
    bm, bn = block_size
    gm, gn = weight_scale.shape
    tiles = weight.view(gm, bm, gn, bn).to(dtype) * weight_scale.view(gm, 1, gn, 1).to(dtype)
    out = tiles.view(gm * bm, gn * bn)
    return unpad_weight(out, original_M, original_N) if do_unpad else out


def dynamic_quant(data: torch.Tensor, single_scale: bool = False):
    """Per row (or whole-tensor) FP8 quantization with scale (max|x| + 1e-8) / FP8_MAX, computed in
    the data's own dtype; returns (fp8 data, fp32 scale)."""
    if single_scale:
        scale = (data.abs().max() + 1e-8) / FP8_MAX
    else:
        scale = ((data.abs().max(dim=-1).values + 1e-8) / FP8_MAX).unsqueeze(-1)
    return _cast_to_fp8(data, 1.0 / scale), scale.float()


def apply_fp8_linear_hpu(input, weight, weight_scale, input_scale=None, bias=None, trans_B=True):
    if input_scale is None:
        x_fp8, x_scale = dynamic_quant(input)
    else:
        x_fp8, x_scale = _cast_to_fp8(input, 1.0 / input_scale), input_scale
    return _fp8_gemm(x_fp8, weight, trans_b=trans_B, out_dtype=input.dtype, a_scale_inv=x_scale,
                     b_scale_inv=weight_scale, bias=bias)  # fmt: skip


def gaudi_weight_wrapper(weight_loader):
    """Gaudi2 loaders: with scale adjustment on (looked up at load time), FP8 codes are stored x0.5
    (re-rounded to e4m3) and every other loaded tensor (the scales) x2."""

    def wrapper(*args, **kwargs):
        if get_config().scale_adjustment:
            by_name = "loaded_weight" in kwargs
            loaded = kwargs["loaded_weight"] if by_name else args[1]
            if loaded.dtype == torch.float8_e4m3fn:
                loaded = (loaded.float() * 0.5).to(torch.float8_e4m3fn)
            else:
                loaded = loaded.data * 2.0
            if by_name:
                kwargs["loaded_weight"] = loaded
            else:
                args = (args[0], loaded, *args[2:])
        return weight_loader(*args, **kwargs)

    return wrapper


def _get_dequant_weights_func(self):
    method = self.quant_method
    return getattr(method, "dequant_fp8_weight", None) if method is not None else None


def fp8_perchannel_linear_postprocess_weights(layer):
    if os.getenv("QUANT_CONFIG"):
        layer.get_dequant_weights_func = types.MethodType(_get_dequant_weights_func, layer)
    return layer


def fp8_block_linear_postprocess_weights(layer, force_channel_fp8=False):
    """Block-FP8 linear after loading. With `force_channel_fp8`: dequantize (bf16), requantize per
    output row (`dynamic_quant`), store the codes in place, a 1-D fp32 `weight_scale_inv` [N] and
    `weight_block_size = None`. Without: pad to whole blocks and record the original M, N."""
    block = layer.quant_config.weight_block_size
    weight, orig_m, orig_n = pad_block_fp8_weight_naive(layer.weight.data, layer.weight_scale_inv.data, block)
    if force_channel_fp8:
        dequant = dequant_block_fp8_weight_naive(weight, layer.weight_scale_inv.data, block, original_M=orig_m,
                                                 original_N=orig_n, do_unpad=True)  # fmt: skip
        codes, scale = dynamic_quant(dequant)
        layer.weight.data.copy_(codes)
        layer.weight_scale_inv = torch.nn.Parameter(scale.squeeze(-1), requires_grad=False)
        layer.weight_block_size = None
        return layer
    layer.get_dequant_weights_func = types.MethodType(_get_dequant_weights_func, layer)
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    for name, value in (("orig_M", orig_m), ("orig_N", orig_n)):
        param = torch.nn.Parameter(torch.tensor(value, dtype=torch.int32, device=weight.device), requires_grad=False)
        layer.register_parameter(name, param)
    return layer
