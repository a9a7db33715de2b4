"""Slow, obviously correct reference implementations, written independently of mla_convert.

Loops over blocks and rows, no padding or view tricks: slow on purpose, easy to check by eye.
"""

from __future__ import annotations

import math

import torch


def decode_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """float8_e8m0fnu -> float32 element by element: code v is 2^(v - 127), 255 is NaN."""
    codes = scale.view(torch.uint8).flatten().tolist()
    values = [math.nan if v == 255 else math.ldexp(1.0, v - 127) for v in codes]
    return torch.tensor(values, dtype=torch.float32).reshape(scale.shape)


def dequant_block(weight: torch.Tensor, scale_inv: torch.Tensor, block=(128, 128)) -> torch.Tensor:
    """dequant[i, j] = float(weight[i, j]) * scale_inv[i // bn, j // bk], block by block (an E8M0
    scale decoded first)."""
    if scale_inv.dtype == torch.float8_e8m0fnu:
        scale_inv = decode_e8m0(scale_inv)
    n, k = weight.shape
    bn, bk = block
    out = torch.empty(n, k, dtype=torch.float32)
    for bi in range(math.ceil(n / bn)):
        for bj in range(math.ceil(k / bk)):
            rows = slice(bi * bn, min((bi + 1) * bn, n))
            cols = slice(bj * bk, min((bj + 1) * bk, k))
            out[rows, cols] = weight[rows, cols].to(torch.float32) * scale_inv[bi, bj].item()
    return out


def channel_fp8(x: torch.Tensor, fp8_max: float, signed_zero: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Row by row: scale = max|row| / fp8_max (1.0 for an all-zero row); q = e4m3(clamp(row / scale)).
    Without `signed_zero` (gaudi2) an element whose quantized value is zero, of either sign, is +0."""
    n, k = x.shape
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    scales = torch.empty(n, 1, dtype=torch.float32)
    for i in range(n):
        amax = x[i].abs().max().item()
        s = torch.tensor(amax, dtype=torch.float32) / fp8_max
        if s.item() == 0.0:
            s = torch.tensor(1.0)
        scales[i, 0] = s
        q[i] = torch.clamp(x[i] / s, -fp8_max, fp8_max).to(torch.float8_e4m3fn)
        if not signed_zero:
            rounded = q[i].to(torch.float32)  # exact: every e4m3 value is a float32
            rounded[rounded == 0] = 0.0  # -0.0 == 0 too: both zeros become +0.0
            q[i] = rounded.to(torch.float8_e4m3fn)
    return q, scales


def gaudi_load_time_channel_fp8(weight, scale_inv, fp8_max: float, block=(128, 128)):
    """vllm-gaudi's load-time block->channel conversion as documented (domain-facts §3): dequantize
    in bf16 (bf16(w) * bf16(scale)), per row scale = (max|row| + 1e-8) / FP8_MAX, round-to-nearest."""
    n, k = weight.shape
    s = scale_inv.to(torch.bfloat16).repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    deq = weight.to(torch.bfloat16) * s
    scale = (deq.abs().max(dim=1).values.float() + 1e-8) / fp8_max
    q = torch.clamp(deq.float() / scale[:, None], -fp8_max, fp8_max).to(torch.float8_e4m3fn)
    return q, scale[:, None]


def seed_split(kv_b_proj_weight: torch.Tensor, num_heads, qk_nope_head_dim, v_head_dim, kv_lora_rank):
    """The seed's HPUMLAAttention.process_weights_after_loading layout, literally:
    transpose -> view [L, N, P+V] -> split -> W_UV.transpose(0, 1), W_UK.permute(1, 2, 0)."""
    w = kv_b_proj_weight.T
    assert w.shape == (kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim))
    w = w.reshape(kv_lora_rank, num_heads, qk_nope_head_dim + v_head_dim)
    W_UK, W_UV = w.split([qk_nope_head_dim, v_head_dim], dim=-1)
    return W_UK.permute(1, 2, 0).contiguous(), W_UV.transpose(0, 1).contiguous()


def e4m3_error_bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Max |q * scale - x| for round-to-nearest e4m3 (3 mantissa bits): half an ulp, i.e.
    |x| * 2^-4 for normal values and scale * 2^-10 (half the 2^-9 subnormal step) below them;
    plus fp32 rounding slack of the final product."""
    return x.abs() * 2.0**-4 + scale * 2.0**-10 + x.abs() * 2.0**-22


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def int4_dequant(packed: torch.Tensor, scale: torch.Tensor, cols: int) -> torch.Tensor:
    """Pack-quantized INT4 element by element, from the format's definition: column j of row i is
    nibble j % 8 of int32 word j // 8 (the lowest nibble the lowest column), stored as value + 8;
    its value times scale[i, j // (cols / scale columns)], in float64 (exact), returned in float32."""
    rows, groups = scale.shape[0], scale.shape[1]
    per = cols // groups
    words = packed.tolist()
    scales = scale.double().tolist()
    out = []
    for i in range(rows):
        row = []
        for j in range(cols):
            word = words[i][j // 8] & 0xFFFFFFFF  # as an unsigned 32-bit pattern
            code = (word >> (4 * (j % 8))) & 0xF
            row.append((code - 8) * scales[i][j // per])
        out.append(row)
    return torch.tensor(out, dtype=torch.float64).to(torch.float32)
