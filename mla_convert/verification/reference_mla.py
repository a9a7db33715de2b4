"""The reference MLA decode of verify's functional check, float32, written apart from the runtime.

Seeded random decode inputs go through the naive path (kv_b_proj up-projects the latent cache to
per-head K and V) and the absorbed path the Gaudi layer runs (W_UK_T, attention over the latent
cache, W_UV); `functional_error` is the relative Frobenius error between the two outputs, held to
the tolerances of verification.bounds ("Functional check")."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from mla_runtime.format import MlaDims

if TYPE_CHECKING:
    import torch

FUNCTIONAL_QUERIES = 4  # B decode queries
FUNCTIONAL_CACHE = 16  # T cached tokens


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
