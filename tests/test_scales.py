"""conversion.scales, the torch-free checks of a source's block scales and INT4 weight_shape
tensors, held to torch's reading of the same bytes: every BF16 and every E8M0 code, F32 specials."""

import struct

import pytest
import torch

from mla_convert.conversion.scales import check_int4_shape, check_scale_bytes, int_values
from mla_convert.errors import SourceError


def as_bytes(t: torch.Tensor) -> bytearray:
    return bytearray(t.contiguous().view(torch.uint8).numpy().tobytes())


def as_f32(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.float32)


def test_every_finite_bf16_scale_widens_exactly_and_every_other_is_refused():
    codes = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    finite = torch.isfinite(codes.float())
    out = check_scale_bytes(as_bytes(codes[finite]), "BF16", "shard", "s")
    assert torch.equal(as_f32(out).view(torch.int32), codes[finite].float().view(torch.int32))  # bit for bit
    for code in codes[~finite]:  # 256 NaN and Inf codes
        with pytest.raises(SourceError, match="contains NaN or Inf"):
            check_scale_bytes(as_bytes(torch.stack([torch.tensor(1.0, dtype=torch.bfloat16), code])), "BF16", "p", "s")


def test_every_e8m0_code_decodes_to_its_power_of_two_and_the_nan_code_is_refused():
    codes = torch.arange(255, dtype=torch.uint8)
    out = check_scale_bytes(as_bytes(codes), "F8_E8M0", "shard", "s")
    assert torch.equal(as_f32(out), codes.view(torch.float8_e8m0fnu).float())
    with pytest.raises(SourceError, match="NaN code 0xFF"):
        check_scale_bytes(bytearray([3, 0xFF]), "F8_E8M0", "shard", "s")


@pytest.mark.parametrize("special", [float("nan"), float("inf"), float("-inf")])
def test_f32_specials_are_refused_and_other_values_kept(special):
    values = torch.tensor([1.0, -2.5e-38, 3.4e38, 1e-45, 0.0], dtype=torch.float32)  # normal, subnormal, max
    assert check_scale_bytes(as_bytes(values), "F32", "shard", "s") == bytes(as_bytes(values))
    with pytest.raises(SourceError, match="contains NaN or Inf"):
        check_scale_bytes(as_bytes(torch.cat([values, torch.tensor([special])])), "F32", "shard", "s")


def test_weight_shape_values_are_read_as_i32_or_i64_and_held_to_the_packed_shape():
    assert int_values(struct.pack("<2i", 2048, 7168), "I32") == [2048, 7168]
    assert int_values(struct.pack("<2q", 7, -3), "I64") == [7, -3]
    check_int4_shape([2048, 7168], (2048, 7168), "shard", "w.weight_shape", "w.weight_packed")
    with pytest.raises(SourceError, match=r"weight_shape 'w.weight_shape' is \[2048, 7000\].*\[2048, 7168\]"):
        check_int4_shape([2048, 7000], (2048, 7168), "shard", "w.weight_shape", "w.weight_packed")
