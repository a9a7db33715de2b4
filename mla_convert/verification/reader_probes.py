"""The probes of the checks verify runs on raw buffers (verification.native_pass), each against
the torch formulation the torch path of verify uses: the first differing byte of a copy, the
channel-scale limit, the MLA artifact bound (bit for bit, as counts), the per-row dequant of a
channel-FP8 kv_b_proj, and the functional MLA check (the same inputs through torch's naive and
absorbed decode; its value within a relative 1e-3, as the C sums run in another order).

Run once per machine by readers.reader_backend (with torch), the pass remembered (kernels.verdict).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from mla_convert.kernels import native
from mla_convert.verification.bounds import (
    ARTIFACT_REL,
    FP8_SUBNORMAL_HALF_STEP,
    SCALE_EPS,
    SCALE_REL,
    artifact_allowed_error,
    scale_limit,
)
from mla_convert.verification.reference_mla import absorbed_mla_decode, naive_mla_decode
from mla_runtime.format import MlaDims

PROBE_DIMS = MlaDims(num_heads=3, qk_nope_head_dim=16, v_head_dim=8, kv_lora_rank=40)
PROBE_ROPE, PROBE_QUERIES, PROBE_CACHE = 5, 2, 7


def raw_checks() -> dict[str, Callable[[], bool]]:
    return {
        "first difference": _first_difference_agrees,
        "scale limit": _scale_limit_agrees,
        "artifact bound": _artifact_bound_agrees,
        "row dequant": _row_dequant_agrees,
        "functional MLA": _functional_agrees,
    }


def functional_inputs(dims: MlaDims, rope_dim: int, queries: int, cache: int, seed: int):
    """The functional check's inputs as native_pass makes them (mla_normal_fill, one stream in this
    order): q_nope [B, N, P], q_pe [B, N, R], latent [T, L], k_pe [T, R], as torch tensors."""
    import torch

    n, p, l = dims.num_heads, dims.qk_nope_head_dim, dims.kv_lora_rank
    shapes = [(queries, n, p), (queries, n, rope_dim), (cache, l), (cache, rope_dim)]
    sizes = [int(torch.Size(s).numel()) for s in shapes]
    flat = torch.empty(sum(sizes), dtype=torch.float32)
    native.normal_fill(seed, flat.data_ptr(), flat.numel())
    return [part.view(shape) for part, shape in zip(flat.split(sizes), shapes, strict=True)]


def torch_functional_error(uk, uv, kv_b, dims: MlaDims, inputs) -> float:
    """reference_mla.functional_error's formula in torch, on the given inputs."""
    q_nope, q_pe, latent, k_pe = inputs
    ref, temperature = naive_mla_decode(kv_b, dims, q_nope, q_pe, latent, k_pe)
    out = absorbed_mla_decode(uk, uv, q_nope, q_pe, latent, k_pe, temperature)
    denom = float(ref.norm())
    err = float((out - ref).norm())
    return err / denom if denom > 0 else (0.0 if err == 0 else float("inf"))


def native_functional_error(uk, uv, kv_b, dims: MlaDims, rope_dim: int, inputs) -> float:
    """native.functional_error on torch tensors (W_UK_T, W_UV bf16; kv_b fp32)."""
    uk, uv, kv_b = uk.contiguous(), uv.contiguous(), kv_b.float().contiguous()
    inputs = [t.contiguous() for t in inputs]  # kept alive across the call
    ptrs = tuple(t.data_ptr() for t in inputs)
    q, c = inputs[0].shape[0], inputs[2].shape[0]
    return native.functional_error(kv_b.data_ptr(), uk.data_ptr(), uv.data_ptr(), dims, rope_dim, q, c, ptrs)


def _first_difference_agrees() -> bool:
    import torch

    g = torch.Generator().manual_seed(1)
    a = torch.randint(0, 256, (3 * 2**20 + 11,), generator=g, dtype=torch.uint8)
    cases = []
    for at in (None, 0, 2**20 - 1, 2**20, 2 * 2**20 + 5, a.numel() - 1):
        b = a.clone()
        if at is not None:
            b[at] ^= 0x10
            b[-1] ^= 0x01 if at != a.numel() - 1 else 0
        want = -1 if at is None else int(torch.nonzero(a != b)[0])
        cases.append(native.first_difference(a.data_ptr(), b.data_ptr(), a.numel()) == want)
    return all(cases)


def _scale_limit_agrees() -> bool:
    import torch

    g = torch.Generator().manual_seed(2)
    amax = torch.rand(300, generator=g) * 400
    amax[:5] = torch.tensor([0.0, 1e-30, 448.0, float("inf"), 3.0])
    limit = scale_limit(amax, 448.0)
    sc = (amax / 448.0).clone()
    sc[10:20] = limit[10:20] * 1.01  # over
    sc[20:25] = limit[20:25]  # exactly at the limit: near, decided in torch
    sc[25] = float("nan")
    sc[0] = 5.0  # a zero row: any scale
    far = torch.ones(300, dtype=torch.bool)
    far[20:25] = False
    _, near = native.scale_over_limit(sc.data_ptr(), amax.data_ptr(), 300, SCALE_EPS, 448.0, SCALE_REL)
    sc_far, amax_far = sc[far].contiguous(), amax[far].contiguous()  # kept alive across the call
    over_far, near_far = native.scale_over_limit(
        sc_far.data_ptr(), amax_far.data_ptr(), sc_far.numel(), SCALE_EPS, 448.0, SCALE_REL
    )
    want_far = int((~(sc[far] <= limit[far]) & (amax[far] > 0)).sum())
    return near >= 5 and near_far == 0 and over_far == want_far == 11


def _channel_kv_b(dims: MlaDims, seed: int):
    import torch

    from mla_convert.kernels import numerics

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(dims.kv_b_shape(), generator=g) * 0.05
    x[1] = 0.0
    return numerics.float_to_channel_fp8(x, 448.0)


def _artifact_bound_agrees() -> bool:
    import torch

    from mla_runtime.layout import split_kv_b_proj

    dims = PROBE_DIMS
    q, s = _channel_kv_b(dims, 3)
    x = q.float() * s
    uk, uv = split_kv_b_proj(x, dims, torch.bfloat16)
    uk, uv = uk.clone(), uv.clone()
    uk[1, 2, 3] *= 1.5
    uv[2, 7, 1] = float("nan")
    uv[0, 0, 0] = uv[0, 0, 0] + 0.001
    ref = split_kv_b_proj(x, dims, torch.float32)
    sc = split_kv_b_proj(s, dataclasses.replace(dims, kv_lora_rank=1), torch.float32)
    want = sum(
        int((~((a.float() - r).abs() <= artifact_allowed_error(a.float(), c))).sum())
        for a, r, c in zip((uk, uv), ref, sc, strict=True)
    )
    codes, s = q.view(torch.uint8).contiguous(), s.contiguous()
    got = native.artifact_bound(codes.data_ptr(), s.data_ptr(), uk.data_ptr(), uv.data_ptr(), dims,
                                ARTIFACT_REL, FP8_SUBNORMAL_HALF_STEP)  # fmt: skip
    return got == want and want >= 2


def _row_dequant_agrees() -> bool:
    """decode(q) * s per row, as mla_dequant_rows with one block a row."""
    import torch

    from mla_convert.kernels.bits import same_values

    q, s = _channel_kv_b(PROBE_DIMS, 4)
    codes = (torch.arange(q.numel()) % 256).to(torch.uint8).reshape(q.shape).view(torch.float8_e4m3fn)
    n, k = codes.shape
    out = torch.empty(n, k, dtype=torch.float32)
    native.dequant_rows_at(codes.data_ptr(), s.data_ptr(), k, (1, k), out.data_ptr(), n)
    return same_values(out, codes.float() * s)


def _functional_agrees() -> bool:
    import torch

    from mla_runtime.layout import split_kv_b_proj

    dims = PROBE_DIMS
    q, s = _channel_kv_b(dims, 5)
    x = q.float() * s
    uk, uv = split_kv_b_proj(x, dims, torch.bfloat16)
    inputs = functional_inputs(dims, PROBE_ROPE, PROBE_QUERIES, PROBE_CACHE, seed=7)
    pairs = [(uk, uv), (uk, uv.flip(0).contiguous())]  # the artifacts as written, and two heads' W_UV swapped
    for a, b in pairs:
        want = torch_functional_error(a, b, x, dims, inputs)
        got = native_functional_error(a, b, x, dims, PROBE_ROPE, inputs)
        if not abs(got - want) <= 1e-3 * max(want, 1e-6):
            return False
    return True
