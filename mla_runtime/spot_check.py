"""The spot check: does the served kv_b_proj belong to the checkpoint the artifacts were made from?

One head of the served `kv_b_proj` (the first head of this TP rank, its first SPOT_CHECK_COLUMNS
columns: 256 x 64 values for DeepSeek) is compared, value by value, with the same values of the
artifacts. Every value must lie within the rounding that serving can have put between the two;
one value outside is a refusal. Torch only.

The bound
---------
Per compared value: x is the exact value the artifacts were computed from (the fp32 dequant of the
source checkpoint), a = bf16(x) the artifact, d the served weight as this check reads it (the fp32
product of its FP8 code and scale, or its bf16 / fp32 value), and s the scale that multiplies that
code (0 for an unquantized weight). u = 2^-8 is bf16's unit roundoff; e = 2^-4 half the relative
spacing of e4m3 in its normal range; h = 2^-10 half its subnormal spacing (2^-9), in code units.

* The artifact: |a - x| <= u |x|, so |x| <= |a| / (1 - u).
* The served weight is one of:
  - bf16 (mla-convert `--format bf16`): |d - x| <= u |x|;
  - one round-to-nearest FP8 quantization of x, per channel, block or tensor (mla-convert's
    channel FP8): |d - x| <= e |x| + h s + 2^-20 |x| (mla_convert/verification/bounds.py; the
    2^-20 covers the fp32 roundings);
  - DeepSeek's block FP8 as shipped: d = x;
  - vllm-gaudi's VLLM_HPU_FORCE_CHANNEL_FP8 (its default): the block FP8 dequantized in bf16,
    y = bf16(q * bf16(sigma)), so |y - x| <= (2u + u^2) |x|, then requantized per channel with one
    round-to-nearest: |d - y| <= (e + 2^-20) |y| + h s. Together
    |d - x| <= E |x| + h s with E = e + 2u + u^2 + (e + 2^-20)(2u + u^2) + 2^-20 = 0.07083;
  - any of these on Gaudi2, whose loader halves the FP8 codes and doubles the scales: halving is
    exact except for codes that become subnormal, which move by at most h (of the halved code,
    so h s in value): + h s.
  So |d - x| <= E |x| + 2 h s in every case (E covers the others).
* Hence |d - a| <= (E + u) |x| + 2 h s <= |a| (E + u) / (1 - u) + 2 h s = 0.0750 |a| + 2^-9 s.

The check allows |d - a| <= SPOT_REL |a| + SPOT_ABS s, with SPOT_REL = 2^-3 and SPOT_ABS = 2^-7:
a margin of 1.67x on the relative term and 4x on the absolute one, for roundings in serving paths
not derived above, and for Gaudi2 halving a block-FP8 source's codes before force-channel
requantizes them (an error of 2^-9 sigma in units of the source block's scale sigma, not of s,
covered by the absolute margin while the block's largest value is at most about 6 times the row's).
Real serving paths use at most 0.6 of the allowance (the tests measure it).

Why value by value and not a relative (Frobenius) norm of the head: the norm bound that follows
from the same derivation is about 7.5 %, and vllm-gaudi's force-channel requantization alone
measures 2.6 %. Artifacts of a sibling fine-tune whose kv_b_proj differs by 1 % then land near
2.8 %, inside it. Per value the sibling is plain: wherever |x| is small, a 1 % (of the head's
scale) difference is many times 2^-3 |x|, and thousands of values are compared. What no check that
admits FP8 rounding can see is a difference smaller than the rounding at every value (a copy of
the checkpoint scaled by a few percent, say); the source fingerprint (headers) is the other check.

Cost: 16,384 values of kv_b_proj (and its scales) and of the artifacts, few enough that torch runs
the arithmetic on one thread (its parallel grain is 32,768 elements).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import envs
from .format import MLA_DIR_NAME, ArtifactError

SPOT_CHECK_COLUMNS = 64

BF16_U = 2.0**-8
FP8_E = 2.0**-4
FP8_H = 2.0**-10
FP32_SLACK = 2.0**-20
# The derivation of the module docstring, term by term.
_TWO_BF16 = 2 * BF16_U + BF16_U**2
DERIVED_E = FP8_E + _TWO_BF16 + (FP8_E + FP32_SLACK) * _TWO_BF16 + FP32_SLACK
DERIVED_REL = (DERIVED_E + BF16_U) / (1 - BF16_U)  # 0.0750
DERIVED_ABS = 2 * FP8_H  # 2^-9
# What the check allows (margin: module docstring).
SPOT_REL = 2.0**-3
SPOT_ABS = 2.0**-7
BOUND_TEXT = "|kv_b_proj - artifact| <= 2^-3 |artifact| + 2^-7 scale"

_FP8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


@dataclass(frozen=True)
class SpotCheck:
    """The outcome of one comparison (raised as an ArtifactError when `outside` > 0)."""

    compared: int  # values compared
    outside: int  # values outside the bound
    bound_use: float  # max |d - a| / allowed (<= 1 passes)
    relative_difference: float  # ||d - a|| / ||a|| over the compared values


def served_values(kv_b_proj, rows: slice, num_cols: int, num_rows: int,
                  cols: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None] | None:  # fmt: skip
    """(values, scales) of rows `rows` and the first `cols` columns of kv_b_proj's weight
    [num_rows, num_cols], both fp32 on the CPU; scales broadcast to the values (None: unquantized).

    Known layouts: bf16 / fp16 / fp32, or FP8 codes with a per-channel ([N], [N, 1]), per-tensor
    or block (with weight_block_size) `weight_scale` / `weight_scale_inv`, as the checkpoint's
    [N, K] or a transposed [K, N] view (vLLM's FP8 linears may keep that). None for any other."""
    cols = num_cols if cols is None else min(cols, num_cols)
    w = getattr(kv_b_proj, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.device.type == "meta":
        return None
    # A transposed view is recognised by its strides first: a rank with as many rows as kv_lora_rank
    # (2 heads of 256 against L=512) has a square weight, whose shape says nothing.
    transposed_view = not w.is_contiguous() and w.T.is_contiguous()
    if transposed_view or (tuple(w.shape) == (num_cols, num_rows) and num_rows != num_cols):
        w = w.T
    if tuple(w.shape) != (num_rows, num_cols):
        return None
    if w.dtype in (torch.bfloat16, torch.float16, torch.float32):
        return w[rows, :cols].float().cpu(), None
    if w.dtype not in _FP8:
        return None
    scale = _current_scale(kv_b_proj, w.shape[0])
    if scale is None:
        return None
    part = w[rows, :cols].float().cpu()
    scale = scale.detach().float().cpu()
    if scale.numel() == 1:  # per tensor
        grid = scale.reshape(1, 1).expand_as(part)
    elif scale.numel() == w.shape[0]:  # per output channel: [N], [N, 1]
        grid = scale.reshape(-1)[rows].unsqueeze(1).expand_as(part)
    else:
        block = getattr(kv_b_proj, "weight_block_size", None)
        if not (scale.dim() == 2 and block):
            return None
        bn, bk = int(block[0]), int(block[1])
        if scale.shape[0] * bn < w.shape[0] or scale.shape[1] * bk < w.shape[1]:
            return None
        row_blocks = torch.arange(rows.start, rows.start + part.shape[0]) // bn
        col_blocks = torch.arange(cols) // bk
        # index_select: repeat_interleave and fancy indexing on dim 1 go through torch's parallel
        # regions, which on a busy host wait for a core (milliseconds for 16,384 values)
        grid = scale.index_select(0, row_blocks).index_select(1, col_blocks)
    return part * grid, grid


def _current_scale(kv_b_proj, num_rows: int) -> torch.Tensor | None:
    """The scale the served FP8 codes go with. A layer may hold two: vllm-gaudi requantizes a block
    FP8 weight to channel FP8 into `weight_scale_inv` and leaves `weight_scale` as the old block
    grid. Requantization only ever goes from block to channel, so a per-channel or per-tensor scale
    is the current one; a block grid only where there is no other."""
    scales = [getattr(kv_b_proj, n, None) for n in ("weight_scale", "weight_scale_inv")]
    scales = [t for t in scales if isinstance(t, torch.Tensor)]
    return next((t for t in scales if t.numel() in (1, num_rows)), scales[0] if scales else None)


def compare(served: torch.Tensor, scale: torch.Tensor | None, ours: torch.Tensor) -> SpotCheck:
    """Value-by-value comparison of served weights with artifact values (all fp32, same shape)."""
    diff = (served - ours).abs()
    allowed = ours.abs() * SPOT_REL
    if scale is not None:
        allowed = allowed + scale.abs() * SPOT_ABS
    bad = ~(diff <= allowed)  # NaN is outside
    ratio = torch.where(allowed > 0, diff / allowed.clamp_min(1e-38), torch.where(diff > 0, torch.inf, 0.0))
    ratio = torch.where(torch.isnan(diff), torch.inf, ratio)
    norm = float(ours.norm())
    rel = float((served - ours).norm()) / norm if norm > 0 else float(diff.max() > 0) * float("inf")
    return SpotCheck(int(ours.numel()), int(bad.sum()), float(ratio.max()) if ratio.numel() else 0.0, rel)


def spot_check(kv_b_proj, w_uk_t: torch.Tensor, w_uv: torch.Tensor, *, where: str) -> SpotCheck | None:
    """Compare the first local head of the served kv_b_proj (its first SPOT_CHECK_COLUMNS columns)
    with this rank's artifacts W_UK_T [heads, P, L] / W_UV [heads, L, V].

    Returns the comparison, or None when the weight's layout is not one this check knows (nothing
    compared); raises ArtifactError when a value lies outside the bound (module docstring)."""
    heads, p, l = w_uk_t.shape
    v = w_uv.shape[2]
    c = min(SPOT_CHECK_COLUMNS, l)
    got = served_values(kv_b_proj, slice(0, p + v), l, heads * (p + v), cols=c)
    if got is None:
        return None
    served, scale = got
    ours = torch.cat([w_uk_t[0, :, :c].float().cpu(), w_uv[0, :c, :].float().cpu().T], dim=0)
    result = compare(served, scale, ours)
    if result.outside:
        raise ArtifactError(
            f"{where}: W_UK_T/W_UV do not match the served kv_b_proj: {result.outside} of {result.compared} "
            f"values of this rank's first head lie outside the rounding serving allows ({BOUND_TEXT}; "
            f"relative difference {result.relative_difference:.4f}): the artifacts were computed from another "
            f"checkpoint; use the {MLA_DIR_NAME}/ directory written with this model (or {envs.FALLBACK}=1 to "
            "let vLLM compute them)"
        )
    return result
