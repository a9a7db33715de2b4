"""The probe set: inputs on which a kernel set must give exactly what eager `numerics` gives on the CPU.

kernels.fastest runs every candidate (the native C kernels, a torch.compile graph, eager numerics on
another device) on them before it converts anything. Random tensors alone miss the cases where
implementations part: a quotient that lands exactly on an e4m3 rounding midpoint rounds one way or
the other on a one-ulp difference in the channel scale or in the division (a reciprocal multiply
instead of a divide), so the midpoint probes put every element of a row on one, under per-row
scales that are not powers of two. The rest: every e4m3 byte (zeros, -0, subnormals, NaN) under
every power-of-two scale E8M0 can encode (V3.1's ue8m0; products that underflow to float32
subnormals and overflow to Inf), partial blocks, zero and -0 rows, negative values that round to
zero, every bf16 bit pattern, and a kv_b_proj through the MLA split.
"""

from __future__ import annotations

import itertools

import torch

from mla_convert.kernels import numerics
from mla_runtime.format import MlaDims

ROWS = 4  # rows per block probe: fewer than a block's rows, so the block row is partial
# Values here are Python floats: each is a short binary fraction, exact in float64, and so are the
# sums, halves and products of a few of them.
# Channel scales of the midpoint probes: every 3-bit mantissa, at a small and a large exponent.
# Whether fl(max|row| * fl(1 / fp8_max)) misses fl(max|row| / fp8_max) depends on the mantissa.
SCALE_TARGETS = tuple((1 + j / 8) * 2.0**e for e in (-14, 3) for j in range(8))
# Block scales of the midpoint probes as multiples of the channel scale: quotients are then
# e4m3 value x ratio, exactly. 2^-6 puts them among e4m3's subnormals and below (-0 results).
RATIOS = (1.0, 1.5, 1.25, 0.875, 0.625, 2.0**-6)
TOP_CODE = 0x78  # e4m3 256 (2^8): the largest power of two; it sets each midpoint row's max


def e4m3_values() -> list[float]:
    """Every finite non-negative e4m3fn value, ascending (codes 0x00..0x7E)."""
    return torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float().tolist()


def e4m3_midpoints(limit: float) -> list[float]:
    """Each point halfway between two adjacent e4m3 values, up to `limit`."""
    return [(a + b) / 2 for a, b in itertools.pairwise(e4m3_values()) if (a + b) / 2 <= limit]


def _exact(x: float, dtype: torch.dtype) -> bool:
    return torch.tensor(x, dtype=torch.float64).to(dtype).item() == x


def _codes(values: list[float]) -> torch.Tensor:
    """e4m3fn tensor of exactly these values (each must be one)."""
    t = torch.tensor(values, dtype=torch.float32).to(torch.float8_e4m3fn)
    assert t.float().tolist() == values
    return t


def _signs(row: int, n: int) -> torch.Tensor:
    """Per probe row: all +, all -, alternating, and alternating the other way."""
    alt = 1 - 2 * (torch.arange(n) % 2).float()
    return [torch.ones(n), -torch.ones(n), alt, -alt][row % 4]


def _block_tensor(segments, block, rows: int = ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight of `rows` rows and its block scales from segments [(block scale, e4m3 values)]:
    each segment fills whole blocks (zeros after its values), the last block ends 3 short; row r
    takes the values with the signs of _signs(r)."""
    bn, bk = block
    cols, scales = [], []
    for scale, values in segments:
        n = -(-max(len(values), 1) // bk) * bk
        cols.append(torch.cat([_codes(values).float(), torch.zeros(n - len(values))]))
        scales += [scale] * (n // bk)
    line = torch.cat(cols)[: -3 if bk > 3 else None]
    w = torch.stack([line * _signs(r, line.numel()) for r in range(rows)]).to(torch.float8_e4m3fn)
    grid = torch.tensor(scales, dtype=torch.float32)[: -(-w.shape[1] // bk)]
    return w, grid.expand(-(-rows // bn), -1).contiguous()


def midpoint_block_probes(block, fp8_max: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One weight per channel scale s of SCALE_TARGETS: its first block holds 2^8 under block scale
    fp8_max * s / 2^8, so max|row| / fp8_max is s exactly; every other element, under a block scale
    ratio * s, quotients to a midpoint (e4m3 value x ratio). Scales that cannot be exact in float32
    for this fp8_max are left out."""
    out = []
    values, midpoints = e4m3_values(), set(e4m3_midpoints(fp8_max))
    top = values[TOP_CODE]
    for s in SCALE_TARGETS:
        head = fp8_max * s / top
        if _exact(head, torch.float32) and _exact(head * top, torch.float32):
            segments = [(head, [top])]
            segments += [(ratio * s, [v for v in values if v * ratio in midpoints]) for ratio in RATIOS]
            out.append(_block_tensor(segments, block))
    return out


def midpoint_float_probes(fp8_max: float) -> list[tuple[torch.Tensor]]:
    """bf16 rows for the 16-bit quantize: rows 2i and 2i + 1 (opposite signs) hold fp8_max * s (the
    row max, so the channel scale is s) and then every midpoint m with m * s exact in bf16, for s
    in SCALE_TARGETS (those for which fp8_max * s is exact in bf16; none: no probe)."""
    rows, midpoints = [], e4m3_midpoints(fp8_max)
    for s in SCALE_TARGETS:
        if _exact(fp8_max * s, torch.bfloat16):
            values = [fp8_max * s] + [m * s for m in midpoints if _exact(m * s, torch.bfloat16)]
            rows.append(torch.tensor(values, dtype=torch.float64))
    if not rows:
        return []
    width = max(len(r) for r in rows)
    line = torch.stack([torch.cat([r, torch.zeros(width - len(r), dtype=r.dtype)]) for r in rows])
    signs = torch.stack([_signs(i, width).double() for i in range(2)])
    return [((line[:, None, :] * signs[None]).reshape(-1, width).to(torch.bfloat16),)]


def e8m0_block_probes(block) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every e4m3 byte under every power-of-two block scale E8M0 encodes (2^-127..2^127), in weights
    of a quarter of the exponents each so that one Inf does not take every row, and 2^-127 alone
    (float32 subnormal scales, dequants and channel scales): row 0 holds the NaN bytes, the other
    rows hold zeros in their place."""
    bn, bk = block
    out = []
    codes = torch.arange(255, dtype=torch.uint8)
    for part in (codes[:1], *codes[1:].chunk(4)):
        scales = numerics.decode_e8m0(part.view(torch.float8_e8m0fnu))
        k = part.numel() * bk - 3 if bk > 3 else part.numel() * bk
        rows = []
        for r in range(ROWS):
            b = (torch.arange(k) * 7 + r * 37) % 256
            if r:
                b[(b & 0x7F) == 0x7F] = 0
            rows.append(b)
        w = torch.stack(rows).to(torch.uint8).view(torch.float8_e4m3fn)
        out.append((w, scales[: -(-k // bk)].expand(-(-ROWS // bn), -1).contiguous()))
    return out


def zero_block_probe(block) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of +0, of -0, of both, and one whose largest value (in the first block) dwarfs the
    negative and positive values of the next block so that they quotient to -0 and +0."""
    bn, bk = block
    k = 2 * bk
    w = torch.zeros(ROWS, k, dtype=torch.uint8)
    w[1] = 0x80
    w[2, ::2] = 0x80
    w[3, 0] = 0x7E  # 448
    w[3, bk:] = (torch.arange(bk) % 0x7F).to(torch.uint8) | 0x80 * (torch.arange(bk) % 2).to(torch.uint8)
    s = torch.tensor([[1.0, 2.0**-30]]).expand(-(-ROWS // bn), -1).contiguous()
    return w.view(torch.float8_e4m3fn), s


def zero_float_probe() -> tuple[torch.Tensor]:
    """bf16 rows of +0, of -0, of both, and of one large value with tiny ones of both signs."""
    w = torch.zeros(ROWS, 64)
    w[1] = -0.0
    w[2, ::2] = -0.0
    w[3] = torch.linspace(-1e-30, 1e-30, 64)
    w[3, 5] = 3.0e4
    return (w.to(torch.bfloat16),)


def mla_probe(block) -> tuple[torch.Tensor, torch.Tensor, MlaDims]:
    """A small kv_b_proj of every byte (one partial block row, its second block partial), block
    scales 1 and 2^-120 (a bf16 split of float32 subnormals), and its MLA dims."""
    dims = MlaDims(num_heads=2, qk_nope_head_dim=3, v_head_dim=2, kv_lora_rank=block[1] + 5)
    n, k = dims.kv_b_shape()
    w = ((torch.arange(n * k) * 5) % 256).to(torch.uint8).reshape(n, k).view(torch.float8_e4m3fn)
    s = torch.tensor([[1.0, 2.0**-120]]).expand(-(-n // block[0]), -1).contiguous()
    return w, s, dims


def _random_block_probes(block) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Aligned and partial blocks, grid dims that differ and exceed 1, and every byte value."""
    g = torch.Generator().manual_seed(0)
    bn, bk = block
    every_byte = (torch.arange((bn + 3) * 512) % 256).to(torch.uint8).reshape(bn + 3, 512)
    weights = [
        torch.randn(2 * bn + 5, 3 * bk + 7, generator=g).to(torch.float8_e4m3fn),
        torch.randn(4 * bn, 5 * bk + 1, generator=g).to(torch.float8_e4m3fn),
        every_byte.view(torch.float8_e4m3fn),
    ]
    return [(w, torch.rand(-(-w.shape[0] // bn), -(-w.shape[1] // bk), generator=g) + 0.5) for w in weights]


def _random_float_probes() -> list[tuple[torch.Tensor]]:
    """Every bf16 bit pattern, in rows of one exponent and shuffled across rows, and rows of
    magnitudes far apart (e4m3 subnormal results)."""
    g = torch.Generator().manual_seed(0)
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    spread = torch.randn(64, 300, generator=g) * torch.pow(2.0, torch.randint(-30, 30, (64, 300), generator=g))
    return [
        (every.reshape(256, 256),),
        (every[torch.randperm(every.numel(), generator=g)].reshape(512, 128),),
        (spread.to(torch.bfloat16),),
    ]


def mla16_probe(block) -> tuple[torch.Tensor]:
    """A bf16 kv_b_proj of mla_probe's dims holding distinct bf16 bit patterns drawn from all of
    them (its split only moves values: any value must come out where it belongs)."""
    n, k = mla_probe(block)[2].kv_b_shape()
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    picked = every[torch.randperm(every.numel(), generator=torch.Generator().manual_seed(0))[: n * k]]
    return (picked.view(torch.bfloat16).reshape(n, k),)


def float_inputs(fp8_max: float) -> list[tuple]:
    """The probe inputs of a transform of a 16-bit weight (kernels.transforms.float_to_channel_fp8)."""
    return [*_random_float_probes(), *midpoint_float_probes(fp8_max), zero_float_probe()]


def block_inputs(block, fp8_max: float) -> list[tuple]:
    """The probe inputs of a transform of a block-FP8 weight and its scales (kernels.transforms:
    block_fp8_*); the MLA splits take mla_probe's kv_b_proj and mla16_probe's."""
    return [
        *_random_block_probes(block),
        *midpoint_block_probes(block, fp8_max),
        *e8m0_block_probes(block),
        zero_block_probe(block),
    ]
