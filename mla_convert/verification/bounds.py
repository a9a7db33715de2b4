"""The numerical yardsticks of `verify`: error bounds, error statistics, and a reference MLA attention.

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

import math
from typing import TYPE_CHECKING

from mla_runtime.format import MlaDims

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
FUNCTIONAL_QUERIES = 4
FUNCTIONAL_CACHE = 16

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


class ErrorStats:
    """Accumulates error statistics of `found` against `exact` over row chunks of one tensor."""

    def __init__(self) -> None:
        self.dd = self.xx = self.yy = 0.0
        self.max_abs = 0.0
        self.bound_use = 0.0
        self.chunk_bound_use = 0.0  # of the last chunk added: <= 1 means every element passed

    def add(self, found: torch.Tensor, exact: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """Add one chunk (fp32); returns |found - exact| / allowed per element (> 1 or NaN: fails)."""
        import torch

        f, x = found.reshape(-1), exact.reshape(-1)
        d = f - x
        self.dd += float(torch.dot(d, d))
        self.xx += float(torch.dot(x, x))
        self.yy += float(torch.dot(f, f))
        d.abs_()
        ratio = d / allowed.reshape(-1)
        if d.numel():
            self.max_abs = _nan_max(self.max_abs, float(d.max()))
            self.chunk_bound_use = _nan_max(0.0, float(ratio.max()))
            self.bound_use = max(self.bound_use, self.chunk_bound_use)
        return ratio.view(found.shape)

    def add_sums(self, dd: float, xx: float, yy: float, max_abs: float, bound_use: float) -> None:
        """Add one chunk already reduced elsewhere (the native verify pass)."""
        self.dd, self.xx, self.yy = self.dd + dd, self.xx + xx, self.yy + yy
        self.max_abs = _nan_max(self.max_abs, max_abs)
        self.chunk_bound_use = _nan_max(0.0, bound_use)
        self.bound_use = max(self.bound_use, self.chunk_bound_use)

    @property
    def rel_err(self) -> float:
        return math.sqrt(self.dd / self.xx) if self.xx > 0 else (0.0 if self.dd == 0 else math.inf)

    @property
    def cosine(self) -> float:
        xy = (self.xx + self.yy - self.dd) / 2  # <f, x>, from |f - x|^2 = |f|^2 - 2<f, x> + |x|^2
        return xy / math.sqrt(self.xx * self.yy) if self.xx > 0 and self.yy > 0 else float(self.dd == 0)


def _nan_max(a: float, b: float) -> float:
    return math.inf if math.isnan(a) or math.isnan(b) else max(a, b)


class Mismatches:
    """Counts elements flagged bad over row chunks of one tensor and remembers the first one."""

    def __init__(self) -> None:
        self.count = 0
        self.first: str | None = None

    def add(self, found: torch.Tensor, expected: torch.Tensor, bad: torch.Tensor, row_offset: int = 0) -> None:
        import torch

        n = int(bad.sum())
        if not n:
            return
        self.count += n
        if self.first is None:
            at = tuple(int(i) for i in torch.nonzero(bad)[0])
            where = [at[0] + row_offset, *at[1:]]
            self.first = f"first at {where}: {float(found[at]):.6g} vs expected {float(expected[at]):.6g}"

    def add_counted(self, count: int, where: list[int], found: float, expected: float) -> None:
        """Add `count` bad elements counted elsewhere, the first of them at `where`."""
        self.count += count
        if self.first is None and count:
            self.first = f"first at {where}: {found:.6g} vs expected {expected:.6g}"

    def text(self, total: int) -> str:
        return f"{self.count} of {total} elements; {self.first}"


# --- reference MLA attention (float32), written independently of the runtime -----------------


def _inputs(dims: MlaDims, rope_dim: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    n, p, l = dims.num_heads, dims.qk_nope_head_dim, dims.kv_lora_rank
    b, t = FUNCTIONAL_QUERIES, FUNCTIONAL_CACHE
    q_nope = torch.randn(b, n, p, generator=g, dtype=torch.float32)
    q_pe = torch.randn(b, n, rope_dim, generator=g, dtype=torch.float32)
    latent = torch.randn(t, l, generator=g, dtype=torch.float32)  # the kv_c_normed cache
    k_pe = torch.randn(t, rope_dim, generator=g, dtype=torch.float32)
    return q_nope, q_pe, latent, k_pe


def naive_mla_decode(kv_b: torch.Tensor, dims: MlaDims, q_nope, q_pe, latent, k_pe, temperature=None):
    """kv_b_proj up-projects every cached latent to per-head K_nope and V; standard attention.

    Returns (output [B, N, V], latent logits before temperature [N, B, T]).
    """
    import torch

    n, p, v = dims.num_heads, dims.qk_nope_head_dim, dims.v_head_dim
    kv = (latent @ kv_b.float().T).view(latent.shape[0], n, p + v)  # [T, N, P+V]
    k_nope, values = kv[..., :p], kv[..., p:]
    logits_nope = torch.einsum("bnp,tnp->nbt", q_nope, k_nope)
    logits = logits_nope + torch.einsum("bnr,tr->nbt", q_pe, k_pe)
    if temperature is None:
        temperature = _temperature(logits)
    attn = torch.softmax(logits / temperature, dim=-1)  # [N, B, T]
    return torch.einsum("nbt,tnv->bnv", attn, values), temperature


def absorbed_mla_decode(w_uk_t: torch.Tensor, w_uv: torch.Tensor, q_nope, q_pe, latent, k_pe, temperature):
    """The Gaudi decode path: bmm(q_nope [N,B,P], W_UK_T [N,P,L]) -> attention over the latent
    cache -> bmm(x [N,B,L], W_UV [N,L,V]). Returns [B, N, V]."""
    import torch

    ql = torch.bmm(q_nope.transpose(0, 1), w_uk_t.float())  # [N, B, L]
    logits = ql @ latent.T + torch.einsum("bnr,tr->nbt", q_pe, k_pe)  # [N, B, T]
    attn = torch.softmax(logits / temperature, dim=-1)
    x = attn @ latent  # [N, B, L]
    return torch.bmm(x, w_uv.float()).transpose(0, 1)  # [B, N, V]


def _temperature(logits: torch.Tensor) -> float:
    spread = float(logits.std())
    return spread if spread > 0 else 1.0


def functional_error(w_uk_t, w_uv, kv_b_ref: torch.Tensor, dims: MlaDims, rope_dim: int, seed: int) -> float:
    """Relative Frobenius error of the absorbed decode output against the naive one."""
    q_nope, q_pe, latent, k_pe = _inputs(dims, rope_dim, seed)
    ref, temperature = naive_mla_decode(kv_b_ref, dims, q_nope, q_pe, latent, k_pe)
    out = absorbed_mla_decode(w_uk_t, w_uv, q_nope, q_pe, latent, k_pe, temperature)
    denom = float(ref.norm())
    err = float((out - ref).norm())
    return err / denom if denom > 0 else (0.0 if err == 0 else math.inf)
