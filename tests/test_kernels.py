"""The compiled fast path is the eager path fused: bit-identical, and both equal the reference."""

import pytest
import torch
from conftest import load_json
from reference import ref_channel_fp8, ref_dequant_block, same_bits
from test_convert import tree_hashes

from mla_convert.convert import convert
from mla_convert.kernels import eager_kernels, resolve_mode, select_kernels
from mla_convert.plan import Options
from mla_convert.synthetic import quantize_block_fp8


@pytest.fixture(scope="module")
def compiled():
    k = select_kernels((128, 128), 448.0, "cpu", "compile", ("fp8", "bf16"))
    if k.name != "torch.compile":  # a host without a C compiler: the fallback must say why
        pytest.fail(f"torch.compile unavailable on this test host: {k.reason}")
    return k


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(576, 7168 // 8), (2048, 896), (300, 200), (129, 257), (1, 1)])
def test_compiled_equals_eager_equals_reference(compiled, shape):
    w, s = quantize_block_fp8(torch.randn(shape) * 3)
    eager = eager_kernels((128, 128), 448.0)
    x = ref_dequant_block(w, s)
    ref_q, ref_s = ref_channel_fp8(x, 448.0)
    assert compiled.to_channel_fp8 is not eager.to_channel_fp8 and compiled.to_bf16 is not eager.to_bf16
    for k in (compiled, eager):
        q, sc = k.to_channel_fp8(w, s)
        assert same_bits(q, ref_q) and same_bits(sc, ref_s), k.name
        assert same_bits(k.to_bf16(w, s), x.to(torch.bfloat16)), k.name
        assert same_bits(k.dequant_fp32(w, s), x), k.name


@pytest.mark.slow
def test_conversion_with_compiled_kernels_is_byte_identical(tiny_src, converted, tmp_path, monkeypatch):
    monkeypatch.delenv("MLA_CONVERT_KERNELS")
    summary = convert(tiny_src, tmp_path / "c", Options(), kernels="compile")
    assert summary["kernels"] == "torch.compile"
    assert tree_hashes(tmp_path / "c") == tree_hashes(converted["channel-fp8"])


def test_auto_mode_policy(monkeypatch):
    monkeypatch.delenv("MLA_CONVERT_KERNELS")
    assert resolve_mode("auto", 10**6)[0] == "eager" and "too little" in resolve_mode("auto", 10**6)[1]
    assert resolve_mode("auto", 10**12) == ("compile", "auto")
    assert resolve_mode("eager", 10**12) == ("eager", "requested")
    monkeypatch.setenv("MLA_CONVERT_KERNELS", "compile")
    assert resolve_mode("auto", 10**6)[0] == "compile"
    with pytest.raises(ValueError):
        resolve_mode("fast", 1)


def test_compile_failure_falls_back_to_eager(monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("no C compiler found")

    monkeypatch.setattr(torch, "compile", broken)
    k = select_kernels((64, 64), 123.0, "cpu", "compile", ("fp8",))
    assert k.name == "eager" and "no C compiler" in k.reason
    w, s = torch.randn(70, 70).to(torch.float8_e4m3fn), torch.rand(2, 2) + 0.5
    assert same_bits(k.dequant_fp32(w, s), ref_dequant_block(w, s, (64, 64)))


def test_summary_reports_kernels(tiny_src, tmp_path):
    summary = convert(tiny_src, tmp_path / "o", Options())
    assert summary["kernels"] == "eager" and summary["kernels_reason"]
    assert load_json(tmp_path / "o" / "mla-convert-manifest.json")["status"] == "complete"


@pytest.mark.slow
def test_one_compiled_graph_serves_every_shape():
    """After the probe, aligned, partial, square and tall shapes reuse its graph: no recompiles
    (each costs seconds per process, more than a small conversion itself)."""
    import torch._dynamo

    fresh = select_kernels((128, 128), 300.0, "cpu", "compile", ("fp8", "bf16"))  # own cache key
    assert fresh.name == "torch.compile", fresh.reason
    graphs = torch._dynamo.utils.counters["stats"]
    before = graphs["unique_graphs"]
    for shape in [(256, 256), (576, 384), (384, 1536), (1024, 256), (300, 200), (129, 257)]:
        w, s = quantize_block_fp8(torch.randn(shape))
        fresh.to_channel_fp8(w, s)
        fresh.to_bf16(w, s)
    assert graphs["unique_graphs"] == before
