"""mla_convert.kernels.numerics against the slow reference in tests/support/reference.py."""

import pytest
import torch

from mla_convert.demo.synthetic import quantize_block_fp8
from mla_convert.formats import TARGETS
from mla_convert.kernels.numerics import (
    block_to_channel_fp8,
    dequantize_block_fp8,
    float_to_channel_fp8,
    quantize_channel_fp8,
    to_bf16,
)

# Full blocks, partial edge blocks in either dimension (576 rows = 4.5 blocks, like kv_a_proj_with_mqa).
SHAPES = [(128, 128), (576, 384), (300, 200), (129, 257), (1, 1), (5, 130)]


def block_fp8(shape, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return quantize_block_fp8(scale * torch.randn(shape, generator=g) / shape[1] ** 0.5)


@pytest.mark.parametrize("shape", SHAPES)
def test_block_dequant_matches_reference_bit_exact(shape, reference):
    w, s = block_fp8(shape)
    assert reference.same_bits(dequantize_block_fp8(w, s, (128, 128)), reference.dequant_block(w, s))


def test_block_dequant_other_block_sizes(reference):
    w = torch.randn(70, 45).to(torch.float8_e4m3fn)
    s = torch.rand(5, 3) + 0.5
    assert reference.same_bits(dequantize_block_fp8(w, s, (16, 16)), reference.dequant_block(w, s, (16, 16)))


def test_block_dequant_rejects_wrong_grid():
    w, s = block_fp8((300, 200))
    with pytest.raises(ValueError, match="scale grid"):
        dequantize_block_fp8(w, s[:2], (128, 128))


@pytest.mark.parametrize("shape", SHAPES)
def test_bf16_is_rounded_fp32_product_bit_exact(shape, reference):
    w, s = block_fp8(shape, seed=1)
    expected = reference.dequant_block(w, s).to(torch.bfloat16)
    assert reference.same_bits(to_bf16(dequantize_block_fp8(w, s, (128, 128))), expected)


@pytest.mark.parametrize("target", ["gaudi3", "gaudi2"])
@pytest.mark.parametrize("shape", SHAPES)
def test_channel_fp8_matches_reference_and_bound(shape, target, reference):
    fp8_max = TARGETS[target].fp8_max
    w, s = block_fp8(shape, seed=2)
    x = reference.dequant_block(w, s)
    q, scale = quantize_channel_fp8(dequantize_block_fp8(w, s, (128, 128)), fp8_max, TARGETS[target].signed_zero)
    ref_q, ref_scale = reference.channel_fp8(x, fp8_max, TARGETS[target].signed_zero)
    assert reference.same_bits(scale, ref_scale) and reference.same_bits(q, ref_q)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (shape[0], 1) and scale.dtype == torch.float32
    assert q.float().abs().max() <= fp8_max
    err = (q.float() * scale - x).abs()
    assert bool((err <= reference.e4m3_error_bound(x, scale)).all()), float(
        (err - reference.e4m3_error_bound(x, scale)).max()
    )


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("target", ["gaudi3", "gaudi2"])
def test_channel_fp8_never_worse_than_vllm_gaudi_load_time(seed, target, reference):
    """The offline fp32 path is at least as accurate as vllm-gaudi's bf16 load-time conversion on
    the same tensor: lower mean squared and mean absolute error against the exact fp32 dequant.
    (The single worst element can fall either way: the two round on different grids.)"""
    fp8_max = TARGETS[target].fp8_max
    w, s = block_fp8((576, 512), seed=seed, scale=3.0)
    x = reference.dequant_block(w, s)
    q, scale = quantize_channel_fp8(dequantize_block_fp8(w, s, (128, 128)), fp8_max)
    gq, gscale = reference.gaudi_load_time_channel_fp8(w, s, fp8_max)
    ours = (q.float() * scale - x).abs()
    theirs = (gq.float() * gscale - x).abs()
    assert ours.pow(2).mean() <= theirs.pow(2).mean()
    assert ours.mean() <= theirs.mean()
    assert bool((ours <= reference.e4m3_error_bound(x, scale)).all())


def test_zero_rows_give_finite_scales_and_zero_weights():
    x = torch.randn(6, 300)
    x[0] = 0
    x[3] = 0
    q, scale = quantize_channel_fp8(x, 448.0)
    assert torch.isfinite(scale).all() and (scale > 0).all()
    assert scale[0, 0] == 1.0 and scale[3, 0] == 1.0
    assert not torch.isnan(q.float()).any()
    assert (q[0].float() == 0).all() and (q[3].float() == 0).all()


@pytest.mark.parametrize("fp8_max", [448.0, 240.0])
def test_saturation_never_exceeds_range_or_makes_nan(fp8_max):
    # The row maximum maps exactly to +-fp8_max; values that round up past it stay saturated.
    x = torch.tensor([[1.0, -1.0, 0.5, 1.0 - 1e-7], [3e38, -3e38, 1.0, 0.0]])
    q, _scale = quantize_channel_fp8(x, fp8_max)
    qf = q.float()
    assert not torch.isnan(qf).any()
    assert qf.abs().max() == fp8_max
    assert qf[0, 0] == fp8_max and qf[0, 1] == -fp8_max and qf[1, 1] == -fp8_max


def test_inputs_are_not_mutated(reference):
    w, s = block_fp8((300, 200))
    w0, s0 = w.clone(), s.clone()
    x = dequantize_block_fp8(w, s, (128, 128))
    x0 = x.clone()
    quantize_channel_fp8(x, 448.0)
    assert reference.same_bits(w, w0) and reference.same_bits(s, s0) and reference.same_bits(x, x0)


def test_e8m0_decode_every_code(reference):
    """Every float8_e8m0fnu code: 2^(v - 127) (v = 0 a float32 subnormal), 255 NaN; torch agrees."""
    from mla_convert.kernels.numerics import decode_e8m0

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e8m0fnu)
    got, want = decode_e8m0(codes), reference.decode_e8m0(codes)
    assert torch.isnan(got[255]) and torch.isnan(want[255])
    assert reference.same_bits(got[:255], want[:255]) and reference.same_bits(got[:255], codes[:255].float())
    assert got[0].item() == 2.0**-127 and got[254].item() == 2.0**127


@pytest.mark.parametrize("target", ["gaudi3", "gaudi2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_16_bit_weight_to_channel_fp8_matches_reference(target, dtype, reference):
    """A BF16 source's linear: the same per-row quantization of its exact (widened) value."""
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(300, 200, generator=g) * torch.logspace(-8, 2, 300).unsqueeze(1)).to(dtype)
    w[7] = 0
    q, s = float_to_channel_fp8(w, TARGETS[target].fp8_max, TARGETS[target].signed_zero)
    rq, rs = reference.channel_fp8(w.float(), TARGETS[target].fp8_max, TARGETS[target].signed_zero)
    assert reference.same_bits(q, rq) and reference.same_bits(s, rs)
    assert s[7, 0] == 1.0 and not q[7].float().any()


def _negative_zero_sources() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A block-FP8 weight whose rows hold -0.0 codes and negative values that quotient to -0 (a
    row max of 448 under block scale 1 next to block scale 2^-30), and its 16-bit twin."""
    codes = torch.zeros(4, 256, dtype=torch.uint8)
    codes[:, 0] = 0x7E  # 448: the row max
    codes[:, 1:128:2] = 0x80  # -0.0
    codes[:, 2:128:2] = 0x00
    codes[:, 128:] = (torch.arange(128) % 0x7F).to(torch.uint8) | 0x80  # negative, tiny once scaled
    codes[1] = 0x80  # a row of -0.0 only: scale 1.0
    w = codes.view(torch.float8_e4m3fn)
    s = torch.tensor([[1.0, 2.0**-30]])
    return w, s, dequantize_block_fp8(w, s, (128, 128))


@pytest.mark.parametrize("target", ["gaudi3", "gaudi2"])
def test_gaudi2_writes_every_zero_as_plus_zero(target, reference):
    """Gaudi2's nominal float8_e4m3fnuz reads 0x80 as NaN: its outputs have none, from -0.0 in the
    source or from a negative value that rounds to zero; gaudi3 keeps e4m3fn's -0. Either way the
    rest of the bytes are the same, and equal the reference."""
    w, s, x = _negative_zero_sources()
    fp8_max, signed = TARGETS[target].fp8_max, TARGETS[target].signed_zero
    for q, scale in (
        block_to_channel_fp8(w, s, (128, 128), fp8_max, signed),
        float_to_channel_fp8(x, fp8_max, signed),
        float_to_channel_fp8(x.to(torch.bfloat16), fp8_max, signed),
    ):
        rq, rs = reference.channel_fp8(x, fp8_max, signed)
        assert reference.same_bits(q, rq) and reference.same_bits(scale, rs)
        codes, signed_codes = q.view(torch.uint8), quantize_channel_fp8(x, fp8_max)[0].view(torch.uint8)
        assert int((signed_codes == 0x80).sum()) > 3 * 128  # the source does produce -0
        if signed:
            assert torch.equal(codes, signed_codes)
        else:
            assert not (codes == 0x80).any()
            assert torch.equal(codes, signed_codes.masked_fill(signed_codes == 0x80, 0))


def test_plus_zero_reference_turns_only_zeros(reference):
    """The reference's gaudi2 rule on its own: zeros of either sign (-0.0, a negative value that
    rounds to zero) become +0; the smallest subnormal and the saturated values keep their sign."""
    x = torch.tensor([[448.0, -0.0, 0.0, -1e-9, -(2.0**-9), -448.0]])
    assert reference.channel_fp8(x, 448.0)[0].view(torch.uint8).tolist() == [[0x7E, 0x80, 0, 0x80, 0x81, 0xFE]]
    assert reference.channel_fp8(x, 448.0, signed_zero=False)[0].view(torch.uint8).tolist() == [
        [0x7E, 0, 0, 0, 0x81, 0xFE]
    ]
