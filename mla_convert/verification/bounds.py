"""The numerical yardsticks of `verify`: its error bounds and tolerances.

The statistics verify reports against them are gathered by verification.error_stats; the reference
MLA decode the functional check runs is verification.reference_mla.

Channel-FP8 bound
-----------------
The converter stores q = e4m3(clamp(fl(x / s), +-M)) with s = fl(max|row| / M) and a reader
computes fl(q * s). Let y = fl(x / s) (one fp32 rounding, relative error <= 2^-24).

* e4m3 has 3 mantissa bits. In its normal range (|y| >= 2^-6) the spacing around y is at most
  |y| * 2^-3, so round-to-nearest is off by at most |y| * 2^-4. Below 2^-6 values are subnormal
  with a fixed spacing of 2^-9, so the error is at most 2^-10. Together: |q - y| <= |y| 2^-4 + 2^-10.
* Saturation: |y| <= fl(max|row| / s) = M (1 + O(2^-23)); clamping to M costs at most M 2^-22,
  which is already inside |y| 2^-4.
* Scaling back by s: |q s - x| <= s |q - y| + |y s - x| + fl-rounding of q s
  <= |x| 2^-4 + s 2^-10 + |x| (2^-4 2^-24 + 2^-24 + (1 + 2^-4) 2^-24) + tiny.

So verify requires, element by element,

    |fl(q * s) - x| <= |x| * (2^-4 + 2^-20) + s * 2^-10            (FP8 bound)

where 2^-20 |x| is a generous cover for the three fp32 roundings (about 2.1 * 2^-24 |x|). The
bound is tool-agnostic: any round-to-nearest per-channel e4m3 quantizer meets it. The absolute
term is only meaningful while s is about max|row| / M, so the stored scale must also satisfy

    s <= (max|row| + 1e-8) / M * (1 + 2^-10)                         (scale limit)

(the 1e-8 admits vllm-gaudi's `(amax + 1e-8) / FP8_MAX`; a larger scale would let a row of
zeros pass). Rows that are all zero must quantize to zeros (the bound then forces q = 0).

MLA artifacts against a channel-FP8 kv_b_proj (no --source)
-----------------------------------------------------------
An artifact a = bf16(x) (7 stored mantissa bits: |a - x| <= 2^-8 |x|, so |x| <= |a| / (1 - 2^-8));
the stored FP8 kv_b_proj gives d = fl(q s) within the FP8 bound of x. Hence

    |a - d| <= |a| * (2^-4 + 2^-8 + 2^-20) / (1 - 2^-8) + s * 2^-10   (artifact bound)

Functional check
----------------
Random decode inputs (B queries, T cached tokens, seeded by the layer index) go through the
absorbed path the Gaudi layer runs (q_nope @ W_UK_T, attention over the latent cache, @ W_UV) and
through the naive path (kv_b_proj up-projects the latent cache to per-head K and V, standard
attention), both in float32: its rounding (about 1e-6 relative over these sums) is four orders of
magnitude below the tolerances, while float64 would cast whole layers and make the check
several times slower. The softmax temperature is set from the naive logits so they have
unit spread whatever the weights' magnitude. The relative Frobenius error of the outputs must stay
within FUNCTIONAL_TOL_EXACT when the reference kv_b_proj is what the artifacts were split from (the
source dequant, or the stored bf16 kv_b_proj: only the artifacts' bf16 rounding, <= 2^-8 per
element, separates them), and within FUNCTIONAL_TOL_FP8 when the reference is the stored
channel-FP8 kv_b_proj (each weight then differs by up to 2^-4 relative). A swapped, transposed or stale
artifact is off by order 1.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

FP8_REL = 2.0**-4
FP8_SUBNORMAL_HALF_STEP = 2.0**-10
FP32_SLACK = 2.0**-20
SCALE_EPS = 1e-8
SCALE_REL = 2.0**-10
BF16_REL = 2.0**-8
ARTIFACT_REL = (FP8_REL + BF16_REL + FP32_SLACK) / (1 - BF16_REL)
FUNCTIONAL_TOL_EXACT = 2.0**-6
FUNCTIONAL_TOL_FP8 = 2.0**-3

TOLERANCES = {
    "channel_fp8": "|w*s - x| <= |x|*(2^-4 + 2^-20) + s*2^-10 per element; s <= (max|row| + 1e-8)/FP8_MAX*(1 + 2^-10)",
    "bf16": "bit-exact to bf16(fp32 dequant)",
    "copied": "bit-exact",
    "mla_artifacts": "bit-exact to split_kv_b_proj of the source dequant (or of a bf16 kv_b_proj); "
    "against a channel-FP8 kv_b_proj: |a - w*s| <= |a|*(2^-4 + 2^-8 + 2^-20)/(1 - 2^-8) + s*2^-10",
    "mla_functional": f"relative error of absorbed vs naive attention <= 2^-6 ({FUNCTIONAL_TOL_EXACT:g}) "
    f"against an exact reference, <= 2^-3 ({FUNCTIONAL_TOL_FP8:g}) against a channel-FP8 kv_b_proj",
}


def fp8_allowed_error(abs_x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Allowed |fl(q*s) - x| per element (FP8 bound), given |x|; `scale` broadcasts over rows ([N, 1])."""
    return abs_x * (FP8_REL + FP32_SLACK) + scale * FP8_SUBNORMAL_HALF_STEP


def scale_limit(row_amax: torch.Tensor, fp8_max: float) -> torch.Tensor:
    return (row_amax + SCALE_EPS) / fp8_max * (1 + SCALE_REL)


def artifact_allowed_error(artifact: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Allowed |artifact - fl(q*s)| (artifact bound); `scale` laid out like the artifact."""
    return artifact.abs() * ARTIFACT_REL + scale * FP8_SUBNORMAL_HALF_STEP
