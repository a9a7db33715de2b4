"""The arithmetic the transforms share (kernels.transforms builds each definition from it): pure
functions, tensor in, tensors out.

Block FP8 (DeepSeek): dequant[i, j] = fp32(weight[i, j]) * scale_inv[i // bn, j // bk], the scale
float32 or float8_e8m0fnu (decoded to float32 first); compressed-tensors FP8_BLOCK
is the same with a bfloat16 scale, widened to float32 exactly. A 16-bit source weight's exact value
is its float32 widening. Pack-quantized INT4: eight 4-bit codes per int32, the lowest nibble
the lowest column, code c meaning c - 8; dequant[i, j] = (c - 8) * scale[i, j // group], exact in
float32 (a 4-bit integer times a 16-bit float).

Every operation here is one IEEE operation per element (multiply, divide, cast) or exact (max,
compare, select, gather), so the bytes are the same on any device that rounds each operation
correctly; kernels.fastest checks a device (and each fast kernel) against CPU eager before use.
"""

from __future__ import annotations

import math
import sys

import torch

FP8_DTYPE = torch.float8_e4m3fn
NEGATIVE_ZERO_CODE = 0x80
E8M0_NAN = 0xFF


def decode_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """float8_e8m0fnu -> float32, exact: code v is 2^(v - 127). v = 0 is 2^-127, a float32
    subnormal; v = 255 is NaN (the caller refuses it first, conversion.scales.check_scale)."""
    v = scale.view(torch.uint8).to(torch.int32)
    out = (v << 23).view(torch.float32)  # the exponent field alone: 2^(v - 127) for v in 1..254
    out = torch.where(v == 0, torch.tensor(2.0**-127), out)
    return torch.where(v == E8M0_NAN, torch.tensor(float("nan")), out)


def block_scale_f32(scale: torch.Tensor) -> torch.Tensor:
    """A block scale as float32: float8_e8m0fnu decoded exactly (its NaN code to NaN), bfloat16
    (compressed-tensors FP8_BLOCK) widened exactly, float32 as it is."""
    if scale.dtype == torch.float8_e8m0fnu:
        return decode_e8m0(scale)
    return scale.float() if scale.dtype != torch.float32 else scale


def dequantize_block_fp8(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], decode=None
) -> torch.Tensor:
    """Exact fp32 dequant of a block-FP8 weight (the product of an e4m3 value and an fp32 scale).

    `decode` replaces `weight.float()` (verification.readers: the same values, faster)."""
    n, k = weight.shape
    bn, bk = block
    gn, gk = scale_inv.shape
    if (gn, gk) != (math.ceil(n / bn), math.ceil(k / bk)):
        raise ValueError(f"scale grid {(gn, gk)} does not fit weight {(n, k)} with block {block}")
    # Each element's scale by index (row // bn, col // bk): no padding or slicing, so
    # torch.compile keeps one graph for aligned and partial shapes and fuses the gather and the
    # multiply into one pass. That pass is still bound by the fp8 -> fp32 cast, which inductor
    # emits as scalar code on CPUs without AVX-512, as torch's eager cast is (kernels.native's C
    # kernels vectorize it). A padded-view formulation recompiled per alignment class; a
    # padded-always one compiled to slow code.
    rows = torch.arange(n, device=weight.device) // bn
    cols = torch.arange(k, device=weight.device) // bk
    return (decode(weight) if decode else weight.float()) * scale_inv.float()[rows][:, cols]


def to_bf16(dequant: torch.Tensor) -> torch.Tensor:
    """bf16(fp32 dequant): round-to-nearest-even, as DeepSeek's reference converter does."""
    return dequant.to(torch.bfloat16)


def channel_scales(dequant: torch.Tensor, fp8_max: float) -> torch.Tensor:
    """Per output row: max|row| / fp8_max; rows whose scale would be 0 (all zero) get 1.0."""
    amax = dequant.abs().amax(dim=1)
    # The divisor is a tensor on amax's device, not a Python number: torch on CUDA divides by a
    # Python number as a multiplication by its reciprocal, which is not correctly rounded.
    scale = amax / torch.tensor(fp8_max, dtype=amax.dtype, device=amax.device)
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def quantize_channel_fp8(
    dequant: torch.Tensor, fp8_max: float, signed_zero: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [N, K] -> (e4m3 weight [N, K], fp32 scale [N, 1]) with weight * scale ~= dequant.

    Division (not multiplication by a reciprocal) keeps the quotient correctly rounded; the
    clamp makes saturation explicit whatever torch's cast does out of range. Without
    `signed_zero` (the target's, formats.Target.signed_zero) a zero is written +0 whatever its sign: -0.0 in the
    source, or a negative quotient that rounds to zero.
    """
    scale = channel_scales(dequant, fp8_max).unsqueeze(1)
    q = (dequant / scale).clamp_(-fp8_max, fp8_max).to(FP8_DTYPE)
    if not signed_zero:
        codes = q.view(torch.uint8)
        q = codes.masked_fill(codes == NEGATIVE_ZERO_CODE, 0).view(FP8_DTYPE)
    return q, scale.contiguous()


def block_to_channel_fp8(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], fp8_max: float, signed_zero: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_channel_fp8(dequantize_block_fp8(weight, scale_inv, block), fp8_max, signed_zero)


def float_to_channel_fp8(
    weight: torch.Tensor, fp8_max: float, signed_zero: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """A bf16 / f16 / f32 weight -> channel FP8: the same per-row quantization, of its exact fp32 value."""
    return quantize_channel_fp8(weight.float(), fp8_max, signed_zero)


INT4_PER_WORD = 8  # 4-bit codes per int32 of a pack-quantized weight
INT4_OFFSET = 8  # a stored code c means c - 8 (values -8..7)
# The two values each byte of a packed word holds: its low nibble is the lower column. The int32
# words' bytes are read in memory order, lowest first: little-endian, as every platform torch runs
# on here (checked at import).
_BYTE = torch.arange(256, dtype=torch.int32)
INT4_BYTE_VALUES = torch.stack([(_BYTE & 0xF) - INT4_OFFSET, (_BYTE >> 4) - INT4_OFFSET], dim=1).float()
assert sys.byteorder == "little", "pack-quantized INT4 is read byte by byte, little-endian"


def unpack_int4(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """int32 [N, ceil(cols / 8)] -> the int32 values [N, cols] (-8..7): nibble b of word w is
    column 8w + b, stored as value + 8."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    codes = (packed.unsqueeze(-1) >> shifts) & 0xF  # the arithmetic shift's sign bits are masked off
    return codes.view(packed.shape[0], -1)[:, :cols] - INT4_OFFSET


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, cols: int, group_size: int) -> torch.Tensor:
    """Exact fp32 dequant of a symmetric pack-quantized INT4 weight: (code - 8) * scale[row, col //
    group_size], `scale` [N, cols / group_size] in any float dtype (group_size = cols: one scale per
    row). Each product of a 4-bit integer and a 16-bit float is exact in float32.

    The codes are read a byte (two columns) at a time from a 256-entry table of their values, and
    the product is taken in place: the same values as unpack_int4's, in far fewer passes over
    memory."""
    n = packed.shape[0]
    table = INT4_BYTE_VALUES.to(packed.device)
    byte_cols = packed.shape[1] * (INT4_PER_WORD // 2)
    codes = packed.contiguous().view(torch.uint8).view(n, byte_cols).to(torch.int32)
    values = torch.index_select(table, 0, codes.view(-1)).view(n, -1)[:, :cols]
    values = values.reshape(n, cols // group_size, group_size)
    return values.mul_(scale.float().unsqueeze(-1)).view(n, cols)


def int4_to_bf16(packed: torch.Tensor, scale: torch.Tensor, cols: int, group_size: int) -> torch.Tensor:
    """bf16 of the exact fp32 dequant: one round-to-nearest-even per element."""
    x = dequantize_int4(packed, scale, cols, group_size)
    return torch.empty(x.shape, dtype=torch.bfloat16, device=x.device).copy_(x)
