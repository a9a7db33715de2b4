"""The fast paths (native C kernels, torch.compile) give exactly what eager `numerics` gives, and
all of them equal the slow reference; each falls back cleanly, saying why."""

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mla_convert.conversion.pipeline import convert
from mla_convert.demo.synthetic import quantize_block_fp8
from mla_convert.errors import ConvertError
from mla_convert.kernels import fastest as kernels_mod
from mla_convert.kernels import native, native_build
from mla_convert.kernels.bits import same_values
from mla_convert.kernels.fastest import eager_kernels, resolve_mode, select_kernels
from mla_convert.kernels.transforms import block_fp8_to_channel_fp8
from mla_convert.process import threads
from mla_convert.settings import Options
from mla_convert.verification import readers as readers_mod


@pytest.fixture(scope="module")
def fast():
    """Both fast paths; a test host without a C compiler fails here, saying why."""
    found = {}
    for mode, name in (("native", "native"), ("compile", "torch.compile")):
        k = select_kernels((128, 128), 448.0, "cpu", mode, ("fp8", "bf16"))
        if k.name != name:
            pytest.fail(f"{name} unavailable on this test host: {k.reason}")
        found[mode] = k
    return found


@pytest.fixture
def fresh_readers():
    """verify's readers probed afresh in this test, and again by whoever asks after it."""
    readers_mod.reset()
    yield readers_mod
    readers_mod.reset()


@pytest.fixture
def fresh_native(monkeypatch, tmp_path):
    """No built library in memory or in a private cache, and no cached kernel choice."""
    monkeypatch.setenv("MLA_CONVERT_CACHE", str(tmp_path / "native-cache"))
    native.reset()
    kernels_mod.forget()
    yield tmp_path / "native-cache"
    native.reset()  # the next test loads the library of the default cache again
    kernels_mod.forget()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["native", "compile"])
@pytest.mark.parametrize("shape", [(576, 7168 // 8), (2048, 896), (300, 200), (129, 257), (1, 1), (3, 1000)])
def test_fast_equals_eager_equals_reference(fast, mode, shape, reference):
    w, s = quantize_block_fp8(torch.randn(shape) * 3)
    k, eager = fast[mode], eager_kernels((128, 128), 448.0)
    x = reference.dequant_block(w, s)
    ref_q, ref_s = reference.channel_fp8(x, 448.0)
    assert k.to_channel_fp8 is not eager.to_channel_fp8 and k.to_bf16 is not eager.to_bf16
    for kern in (k, eager):
        q, sc = kern.to_channel_fp8(w, s)
        assert reference.same_bits(q, ref_q) and reference.same_bits(sc, ref_s), kern.name
        assert reference.same_bits(kern.to_bf16(w, s), x.to(torch.bfloat16)), kern.name
        assert reference.same_bits(kern.dequant_fp32(w, s), x), kern.name


def _every_byte(rows: int, cols: int) -> torch.Tensor:
    return (torch.arange(rows * cols) % 256).to(torch.uint8).reshape(rows, cols).view(torch.float8_e4m3fn)


@pytest.mark.slow
@pytest.mark.parametrize(
    "scale",
    [1.0, 0.5, 3.0e-3, 1.7e-6, 2.0**-20, 7.5e4, -0.25],  # tiny scales push rows into e4m3's subnormals
)
def test_native_every_byte_every_rounding_case(fast, scale, reference):
    """All 256 e4m3 bytes (zeros, subnormals, NaN) under a range of block scales: native equals
    eager bit for bit, NaN handling included; without NaN bytes it equals the slow reference."""
    w = _every_byte(200, 300)
    s = torch.full((2, 3), scale) * (1 + torch.arange(6).reshape(2, 3) / 7)
    k, eager = fast["native"], eager_kernels((128, 128), 448.0)
    q, sc = k.to_channel_fp8(w, s)
    q_e, sc_e = eager.to_channel_fp8(w, s)
    assert same_values(q, q_e) and same_values(sc, sc_e)
    assert same_values(k.to_bf16(w, s), eager.to_bf16(w, s))
    finite = w.view(torch.uint8).clone()
    finite[(finite & 0x7F) == 0x7F] = 0x7E  # the reference has no NaN convention; numerics does
    w = finite.view(torch.float8_e4m3fn)
    x = reference.dequant_block(w, s)
    ref_q, ref_s = reference.channel_fp8(x, 448.0)
    q, sc = k.to_channel_fp8(w, s)
    assert reference.same_bits(q, ref_q) and reference.same_bits(sc, ref_s)
    assert reference.same_bits(k.to_bf16(w, s), x.to(torch.bfloat16))


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    rows=st.integers(1, 300),
    cols=st.integers(1, 300),
    block=st.sampled_from([(128, 128), (64, 32), (1, 7)]),
    fp8_max=st.sampled_from([448.0, 240.0]),
    exp=st.integers(-30, 30),
    seed=st.integers(0, 2**31 - 1),
    signed_zero=st.booleans(),
)
def test_native_matches_eager_on_random_inputs(rows, cols, block, fp8_max, exp, seed, signed_zero):
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(0, 256, (rows, cols), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    s = (torch.rand(grid, generator=g) + 0.01) * 2.0**exp
    k = select_kernels(block, fp8_max, "cpu", "native", ("fp8", "bf16"), signed_zero)
    assert k.name == "native", k.reason
    eager = eager_kernels(block, fp8_max, signed_zero=signed_zero)
    for a, b in zip(k.to_channel_fp8(w, s), eager.to_channel_fp8(w, s), strict=True):
        assert same_values(a, b)
    assert same_values(k.to_bf16(w, s), eager.to_bf16(w, s))


def _every_bf16(rows: int) -> torch.Tensor:
    """Every bf16 bit pattern (zeros, subnormals, Inf, NaN), `rows` rows."""
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(rows, -1)


@pytest.mark.slow
def test_native_bf16_quantize_every_pattern(fast, reference):
    """Every bf16 value, in rows of one exponent and shuffled across rows: native equals eager bit
    for bit (NaN and Inf rows included); rows without them equal the slow reference."""
    k, eager = select_kernels((128, 128), 448.0, "cpu", "native", ("quant",)), eager_kernels()
    assert k.name == "native", k.reason
    every = _every_bf16(256)
    for w in (every, every.flatten()[torch.randperm(every.numel())].reshape(512, 128)):
        for a, b in zip(k.quantize(w), eager.quantize(w), strict=True):
            assert same_values(a, b)
    finite = every[torch.isfinite(every.float()).all(dim=1)]
    q, s = k.quantize(finite)
    rq, rs = reference.channel_fp8(finite.float(), 448.0)
    assert len(finite) > 200 and reference.same_bits(q, rq) and reference.same_bits(s, rs)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 200),
    cols=st.integers(1, 300),
    fp8_max=st.sampled_from([448.0, 240.0]),
    exp=st.integers(-40, 40),
    seed=st.integers(0, 2**31 - 1),
    signed_zero=st.booleans(),
)
def test_native_bf16_quantize_matches_eager_on_random_inputs(rows, cols, fp8_max, exp, seed, signed_zero):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(rows, cols, generator=g) * 2.0**exp).to(torch.bfloat16)
    k = select_kernels((128, 128), fp8_max, "cpu", "native", ("quant",), signed_zero)
    assert k.name == "native", k.reason
    eager = eager_kernels(fp8_max=fp8_max, signed_zero=signed_zero)
    for a, b in zip(k.quantize(w), eager.quantize(w), strict=True):
        assert same_values(a, b)
    w32 = w.float()  # other float dtypes go to eager: the native kernel takes bf16 only
    assert all(same_values(a, b) for a, b in zip(k.quantize(w32), eager.quantize(w32), strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["native", "compile"])
def test_fast_kernels_write_gaudi2_zeros_as_eager(mode, reference):
    """gaudi2 (max 240, no -0): native and compiled kernels give eager's bytes, with no 0x80 code,
    on every e4m3 byte under block scales that send quotients to zero, and on every bf16 pattern;
    gaudi3 keeps the -0 codes the same inputs produce."""
    k = select_kernels((128, 128), 240.0, "cpu", mode, ("fp8", "quant"), signed_zero=False)
    assert k.name == {"native": "native", "compile": "torch.compile"}[mode], k.reason
    eager = eager_kernels((128, 128), 240.0, signed_zero=False)
    w = _every_byte(200, 300)
    s = torch.tensor([[1.0, 2.0**-30, 1e-3], [2.0**-20, 1.0, 0.5]])
    every = _every_bf16(256)
    for got, want in ((k.to_channel_fp8(w, s), eager.to_channel_fp8(w, s)), (k.quantize(every), eager.quantize(every))):
        assert all(same_values(a, b) for a, b in zip(got, want, strict=True))
        assert not (got[0].view(torch.uint8) == 0x80).any()
    assert (eager_kernels((128, 128), 240.0).to_channel_fp8(w, s)[0].view(torch.uint8) == 0x80).any()
    finite = every[torch.isfinite(every.float()).all(dim=1)]
    q, sc = k.quantize(finite)
    rq, rs = reference.channel_fp8(finite.float(), 240.0, signed_zero=False)
    assert reference.same_bits(q, rq) and reference.same_bits(sc, rs)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["native", "compile"])
def test_bf16_source_conversion_with_fast_kernels_is_byte_identical(
    family_checkpoints, tmp_path, monkeypatch, mode, tree_hashes
):
    monkeypatch.delenv("MLA_CONVERT_KERNELS")
    src = family_checkpoints.source("deepseek-v2-lite")
    summary = convert(src, tmp_path / "c", Options(), kernels=mode)
    assert summary.kernels == {"native": "native", "compile": "torch.compile"}[mode], summary.kernels_reason
    assert "quant" in summary.kernels_reason
    assert tree_hashes(tmp_path / "c") == tree_hashes(family_checkpoints.converted("deepseek-v2-lite", "channel-fp8"))


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["channel-fp8", "bf16"])
@pytest.mark.parametrize("mode", ["native", "compile"])
def test_conversion_with_fast_kernels_is_byte_identical(
    tiny_src, converted, tmp_path, monkeypatch, fmt, mode, tree_hashes
):
    monkeypatch.delenv("MLA_CONVERT_KERNELS")
    summary = convert(tiny_src, tmp_path / "c", Options(format=fmt), kernels=mode)
    assert summary.kernels == {"native": "native", "compile": "torch.compile"}[mode]
    assert tree_hashes(tmp_path / "c") == tree_hashes(converted[fmt])


def test_auto_mode_policy(monkeypatch):
    monkeypatch.delenv("MLA_CONVERT_KERNELS")
    chain, why = resolve_mode("auto", 10**6)
    assert chain == ("native", "eager") and "too little" in why
    assert resolve_mode("auto", 10**12) == (("native", "compile", "eager"), "auto")
    assert resolve_mode("eager", 10**12) == (("eager",), "requested")
    assert resolve_mode("compile", 1) == (("compile", "eager"), "requested")
    monkeypatch.setenv("MLA_CONVERT_KERNELS", "compile")
    assert resolve_mode("auto", 10**6)[0] == ("compile", "eager")
    with pytest.raises(ValueError):
        resolve_mode("fast", 1)
    monkeypatch.setenv("MLA_CONVERT_KERNELS", "fast")
    with pytest.raises(ConvertError, match="MLA_CONVERT_KERNELS='fast': expected one of auto, native, compile, eager"):
        resolve_mode("auto", 1)


def test_compile_failure_falls_back_to_eager(monkeypatch, reference):
    def broken(*a, **k):
        raise RuntimeError("no C compiler found")

    monkeypatch.setattr(torch, "compile", broken)
    k = select_kernels((64, 64), 123.0, "cpu", "compile", ("fp8",))
    assert k.name == "eager" and "no C compiler" in k.reason
    w, s = torch.randn(70, 70).to(torch.float8_e4m3fn), torch.rand(2, 2) + 0.5
    assert reference.same_bits(k.dequant_fp32(w, s), reference.dequant_block(w, s, (64, 64)))


def test_no_c_compiler_falls_back_with_the_reason(fresh_native, monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    k = select_kernels((128, 128), 448.0, "cpu", ("native", "eager"), ("fp8",))
    assert k.name == "eager" and "native kernels unavailable" in k.reason and "/nonexistent/cc" in k.reason
    assert not fresh_native.exists() or not any(fresh_native.iterdir())  # nothing half-built left


def test_a_native_build_that_disagrees_is_not_used(fresh_native, monkeypatch):
    real = block_fp8_to_channel_fp8.to_channel_fp8

    def off_by_one_bit(w, s, block, fp8_max, *signed_zero):
        q, sc = real(w, s, block, fp8_max, *signed_zero)
        q.view(torch.uint8)[0, 0] ^= 1
        return q, sc

    monkeypatch.setattr(block_fp8_to_channel_fp8, "to_channel_fp8", off_by_one_bit)
    k = select_kernels((128, 128), 448.0, "cpu", ("native", "eager"), ("fp8",))
    assert k.name == "eager" and "differed from eager" in k.reason


@pytest.mark.slow
def test_native_build_is_cached_per_source_and_cpu(fresh_native, monkeypatch):
    lib = native.build()
    assert lib.parent == fresh_native and lib.suffix == ".so"
    stamp = lib.stat().st_mtime_ns
    assert native.build() == lib and lib.stat().st_mtime_ns == stamp  # reused, not rebuilt
    assert [p.name for p in fresh_native.iterdir()] == [lib.name]  # no temporary files left
    monkeypatch.setattr(native_build, "cpu_id", lambda: "another CPU")
    assert native.build() != lib  # -march=native code is never served to another CPU


def test_summary_reports_kernels(tiny_src, tmp_path, load_json):
    summary = convert(tiny_src, tmp_path / "o", Options())
    assert summary.kernels == "eager" and summary.kernels_reason
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


@pytest.mark.slow
def test_native_kernels_split_rows_over_their_thread_count(fast, reference):
    """Rows are split over the process's share of threads; results do not depend on the split."""
    w, s = quantize_block_fp8(torch.randn(700, 300))
    before = torch.get_num_threads()
    try:
        threads.share_cores(1)
        one = fast["native"].to_channel_fp8(w, s)
        threads.share_cores(max(3, os.cpu_count() or 3))
        many = fast["native"].to_channel_fp8(w, s)
    finally:
        threads.share_cores(None)
        torch.set_num_threads(before)
    assert reference.same_bits(one[0], many[0]) and reference.same_bits(one[1], many[1])


def _near_midpoint_weight(fp8_max: float, block: tuple[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight whose quotients sit on and within a few fp32 ulps of e4m3 rounding midpoints, where a
    kernel that rounds one step differently (a reciprocal multiply, a table built from the wrong
    quotient) writes another code. Row r's first block holds the row maximum 2^8 under block scale
    fp8_max * s_r / 2^8, so its channel scale is s_r exactly; each other block scale is chosen so
    that one mantissa b of e4m3 puts (1 + b/8) * sb / s_r at a midpoint's relative position times
    (1 + k 2^-23), and the block holds that mantissa at every exponent, then random codes."""
    g = torch.Generator().manual_seed(seed)
    bn, bk = block
    mids = [1 + (2 * i + 1) / 16 for i in range(8)]  # the midpoints of [1, 2), relative positions
    targets = [(b, m * (1 + k * 2.0**-23)) for b in range(8) for m in mids for k in range(-4, 5)]
    channel = [(1 + j / 8) * 2.0**e for e in (-20, -3, 0, 5) for j in range(8)]  # s_r, one per row
    rows = len(channel)
    w = torch.randint(0, 256, (rows, bk * (1 + len(targets))), generator=g, dtype=torch.uint8)
    w[(w & 0x7F) == 0x7F] = 0  # NaN codes would send their rows element by element
    s = torch.empty(-(-rows // bn), 1 + len(targets), dtype=torch.float64)
    for r, s_r in enumerate(channel):
        w[r, :bk] = 0
        w[r, 0] = 0x78  # 2^8: the row maximum
        if r % bn == 0:  # block rows share their scales: every row of one block row has the same s_r
            s[r // bn, 0] = fp8_max * s_r / 256
            for c, (b, t) in enumerate(targets, start=1):
                s[r // bn, c] = t / (1 + b / 8) * s_r / 32  # x32: every exponent stays below the row max
        for c, (b, _) in enumerate(targets, start=1):
            exps = torch.arange(1, 14, dtype=torch.uint8)  # exponent fields 1..13, then the subnormal codes
            codes = torch.cat([exps * 8 + b, torch.arange(1, 8, dtype=torch.uint8)])
            w[r, c * bk : c * bk + len(codes)] = codes | (torch.randint(0, 2, codes.shape, generator=g) * 0x80).to(
                torch.uint8
            )
    return w.view(torch.float8_e4m3fn), s.to(torch.float32)


@pytest.mark.parametrize("fp8_max", [448.0, 240.0])
@pytest.mark.parametrize("block", [(1, 64), (2, 128), (1, 32)])
def test_native_channel_fp8_on_quotients_near_rounding_midpoints(fp8_max, block, reference):
    """The code tables (AVX-512 VBMI) and the element-by-element path give eager's bytes and the
    slow reference's on quotients on and a few ulps either side of every e4m3 midpoint, for every
    mantissa, at every exponent, both zero rules."""
    w, s = _near_midpoint_weight(fp8_max, block, seed=int(fp8_max) + block[1])
    for signed_zero in (True, False):
        q, sc = block_fp8_to_channel_fp8.to_channel_fp8(w, s, block, fp8_max, signed_zero)
        q_e, sc_e = eager_kernels(block, fp8_max, signed_zero=signed_zero).to_channel_fp8(w, s)
        assert same_values(sc, sc_e)
        assert reference.same_bits(q, q_e), f"{int((q.view(torch.uint8) != q_e.view(torch.uint8)).sum())} codes differ"
    ref_q, ref_s = reference.channel_fp8(reference.dequant_block(w, s, block), fp8_max)
    q, sc = block_fp8_to_channel_fp8.to_channel_fp8(w, s, block, fp8_max)
    assert reference.same_bits(q, ref_q) and reference.same_bits(sc, ref_s)


@pytest.mark.parametrize("fp8_max", [448.0, 240.0])
def test_native_channel_fp8_at_the_edges_of_the_code_tables(fp8_max):
    """Block scales just inside and outside the range where tables are exact (2^-117, 2^118),
    negative, zero; row scales that are fp32 subnormal, huge, or 1.0 for a zero row; rows with NaN:
    native equals eager."""
    g = torch.Generator().manual_seed(7)
    w = torch.randint(0, 256, (12, 64 * 8), generator=g, dtype=torch.uint8)
    w[1::3][(w[1::3] & 0x7F) == 0x7F] = 0x11
    w[2::3] = (w[2::3] & 0x80) | (w[2::3] & 0x3F)  # small codes only
    w[5] = 0x80 * (torch.arange(w.shape[1]) % 2)  # a row of +0 and -0
    edges = [2.0**-117, 2.0**-117 * 0.75, 2.0**118, 2.0**118 * 0.99, -(2.0**-40), 0.0, 2.0**-126, 2.0**100]
    s = torch.tensor(edges, dtype=torch.float32).repeat(12, 1)
    s[3] = 2.0**-140  # row scales far below fp32's normal range
    s[4] = torch.tensor(edges[::-1])
    w = w.view(torch.float8_e4m3fn)
    for signed_zero in (True, False):
        got = block_fp8_to_channel_fp8.to_channel_fp8(w, s, (1, 64), fp8_max, signed_zero)
        want = eager_kernels((1, 64), fp8_max, signed_zero=signed_zero).to_channel_fp8(w, s)
        assert all(same_values(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_native_nonfinite_count_equals_torch_on_every_bit_pattern(dtype):
    """verify's NaN/Inf check reads the exponent bits in C; torch.isfinite is the reference."""
    if dtype == torch.float32:  # every f32 pattern is too many: random bits, plus every exponent
        t = torch.randint(-(2**31), 2**31 - 1, (1 << 20,), dtype=torch.int32)
        t[:512] = (torch.arange(512, dtype=torch.int32) << 23) | 1  # both signs, every exponent
        t = t.view(torch.float32)
    else:
        t = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    assert native.count_nonfinite(t) == int((~torch.isfinite(t)).sum()) > 0


def test_native_nonfinite_count_across_thread_and_stretch_boundaries():
    t = torch.zeros(3 * 65536 + 17, dtype=torch.bfloat16)
    for i in (0, 65535, 65536, 2 * 65536 + 1, t.numel() - 1):
        t[i] = float("nan") if i % 2 else float("inf")
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            assert native.count_nonfinite(t) == 5
            assert native.count_nonfinite(t[1:]) == 4  # an odd start address
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(("shape", "block"), [((300, 1000), (128, 128)), ((70, 700), (64, 300)), ((5, 13), (4, 3))])
def test_native_fp8_bound_rows_equals_its_torch_formulation(shape, block):
    """verify --source's one-pass C check against the same formulas in torch, per row: the maxima,
    counts and first bad column exactly (they do not depend on summation order), the sums closely.
    Shapes cover whole segments, a block wider than a segment, and tails that fill only some lanes."""
    from mla_convert.kernels.numerics import dequantize_block_fp8

    torch.manual_seed(sum(shape) + block[1])
    w = (torch.randn(shape) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.rand(-(-shape[0] // block[0]), -(-shape[1] // block[1])) * 0.01 + 1e-3
    q, sc = block_fp8_to_channel_fp8.to_channel_fp8(w, s, block, 448.0)
    codes = q.view(torch.uint8).clone()
    codes[1, shape[1] // 2] ^= 0x21  # out of bound
    codes[-1, -1] = 0x7F  # NaN
    codes[2, :] = 0  # a zero row against a non-zero source row
    q = codes.view(torch.float8_e4m3fn)
    rel, half_step = 2.0**-4 + 2.0**-20, 2.0**-10
    got = native.fp8_bound_rows(q, sc, w, s, block, rel, half_step)

    x = dequantize_block_fp8(w, s, block)
    f = q.float() * sc
    d = f - x
    ratio = d.abs() / (x.abs() * rel + sc * half_step)
    bad = ~(ratio <= 1)
    first = torch.where(bad.any(1), bad.float().argmax(1), torch.full((shape[0],), -1))
    assert torch.equal(got["n_bad"], bad.sum(1)) and got["n_bad"].sum() >= 3
    assert torch.equal(got["first_bad"], first)
    for name, want in (("max_abs", d.abs().amax(1)), ("max_ratio", ratio.amax(1)), ("amax_x", x.abs().amax(1))):
        torch.testing.assert_close(got[name], want, rtol=0, atol=0, equal_nan=True, msg=name)
    for name, want in (("dd", d * d), ("xx", x * x), ("yy", f * f)):
        torch.testing.assert_close(got[name], want.double().sum(1), rtol=1e-5, atol=0, equal_nan=True)


@pytest.mark.parametrize("scale", [1e-3, 2.0**-130, 2.0**110])
def test_native_fp8_bound_rows_exact_on_every_code_pair_and_scale_range(scale):
    """The vector pass decodes through fp16 and folds 2^8 into the scales: every e4m3fn code (NaN
    too) in source and output, subnormal and huge scales (the scalar pass takes those), rows that
    pass and rows that fail, and a tail of 7 columns, all exactly as the torch formulation."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    w = codes.repeat(40)[: 40 * 199].reshape(40, 199).clone()  # every code in every lane position
    q = w.roll(1, dims=1).clone()
    nan = (w & 0x7F) == 0x7F
    w[::3] = torch.where(nan[::3], 0, w[::3])
    q[::3] = w[::3]  # rows where output == source, at the same scale: they pass (but in the block scaled 3x)
    w8, q8 = w.view(torch.float8_e4m3fn), q.view(torch.float8_e4m3fn)
    block = (8, 64)
    s = torch.full((5, 4), scale)
    s[1, 2] = scale * 3
    sc = torch.rand(40, 1) * scale + scale
    sc[::3] = scale
    rel, half_step = 2.0**-4 + 2.0**-20, 2.0**-10
    got = native.fp8_bound_rows(q8, sc, w8, s, block, rel, half_step)
    want = readers_mod.torch_bound_rows(q8, sc, w8, s, block, rel, half_step)
    for name in ("n_bad", "first_bad", "max_abs", "max_ratio", "amax_x"):
        torch.testing.assert_close(got[name], want[name].to(got[name].dtype), rtol=0, atol=0, equal_nan=True, msg=name)
    assert int((got["n_bad"] == 0).sum()) >= 10 and int((got["n_bad"] > 0).sum()) >= 20


def test_verify_falls_back_to_torch_when_the_native_bound_check_disagrees(monkeypatch, fresh_readers):
    """verify --source counts out-of-bound elements in C only if, on a probe, the C check finds
    exactly the rows, counts and maxima torch's formulation finds."""
    readers = readers_mod.reader_backend()
    assert readers.name == "native" and "bound check agree with torch" in readers.reason
    real = native.fp8_bound_rows

    def misses_one(*args):
        out = real(*args)
        out["n_bad"] = out["n_bad"].clamp(max=0)  # a check that never counts a bad element
        return out

    monkeypatch.setattr(native, "fp8_bound_rows", misses_one)
    fresh_readers.reset()
    readers = readers_mod.reader_backend()
    assert (readers.name, readers.reason) == ("torch", "native bound check disagreed with torch on the probe")


def test_verify_readers_fall_back_to_torch_without_a_c_compiler(fresh_native, monkeypatch, fresh_readers):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    readers = readers_mod.reader_backend()
    assert readers.name == "torch" and readers.decode is readers_mod.TORCH_BACKEND.decode
    assert readers.reason.startswith("native library unavailable (") and "/nonexistent/cc" in readers.reason


@pytest.mark.parametrize("how", ["disagrees", "raises"])
def test_verify_readers_fall_back_to_torch_naming_the_reader_that_failed(monkeypatch, fresh_readers, how):
    real = native.row_max_codes

    def broken(t):
        if how == "raises":
            raise ValueError("no such kernel\nmore detail")
        return real(t) ^ 1

    monkeypatch.setattr(native, "row_max_codes", broken)
    readers = readers_mod.reader_backend()
    assert readers.name == "torch" and readers.row_max_codes is not broken
    why = {
        "disagrees": "disagreed with torch on the probe",
        "raises": "failed on the probe (ValueError: no such kernel)",
    }
    assert readers.reason == f"native row max {why[how]}"


def test_native_code_count_equals_torch_across_threads_and_stretches():
    """verify's -0 count of a gaudi2 output: every byte value of every byte, and 0x80 at the
    edges of the 64K stretches and of the threads' shares, from an odd start too."""
    every = (torch.arange(256 * 5, dtype=torch.int32) % 256).to(torch.uint8).view(torch.float8_e4m3fn)
    assert all(native.count_code(every, c) == 5 for c in range(256))
    t = torch.zeros(3 * 65536 + 17, dtype=torch.uint8)
    t[[0, 65535, 65536, 2 * 65536 + 1, t.numel() - 1]] = 0x80
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            assert native.count_code(t.view(torch.float8_e4m3fn), 0x80) == 5
            assert native.count_code(t[1:].view(torch.float8_e4m3fn), 0x80) == 4
            assert native.count_code(t.view(torch.float8_e4m3fn).reshape(-1, 3 * 65536 + 17), 0) == t.numel() - 5
    finally:
        torch.set_num_threads(before)


def test_verify_readers_fall_back_to_torch_when_the_code_count_disagrees(monkeypatch, fresh_readers):
    real = native.count_code
    monkeypatch.setattr(native, "count_code", lambda t, code: max(0, real(t, code) - 1))
    readers = readers_mod.reader_backend()
    assert (readers.name, readers.reason) == ("torch", "native code count disagreed with torch on the probe")
    assert readers.count_code is readers_mod.TORCH_BACKEND.count_code


def test_verify_raw_buffer_checks_agree_with_their_torch_formulations():
    """The checks verify runs on raw buffers (verification.reader_probes): first difference, scale
    limit, artifact bound and row dequant exactly, the functional MLA error within 1e-3 of torch's
    on the same inputs, each on a probe that also has the failing case."""
    from mla_convert.verification import reader_probes

    results = {name: check() for name, check in reader_probes.raw_checks().items()}
    assert results == dict.fromkeys(results, True)


def test_native_functional_error_tracks_torch_on_r1_dims():
    """At R1's MLA dims the C functional check gives torch's value on the same inputs, for the
    artifacts as split and for two layers' W_UV swapped (order 1 off)."""
    from mla_convert.kernels.numerics import float_to_channel_fp8
    from mla_convert.verification import reader_probes
    from mla_runtime.format import MlaDims
    from mla_runtime.layout import split_kv_b_proj

    dims = MlaDims(num_heads=128, qk_nope_head_dim=128, v_head_dim=128, kv_lora_rank=512)
    g = torch.Generator().manual_seed(0)
    q, s = float_to_channel_fp8(torch.randn(dims.kv_b_shape(), generator=g) * 0.02, 448.0)
    x = q.float() * s
    uk, uv = split_kv_b_proj(x, dims, torch.bfloat16)
    other = split_kv_b_proj(x.roll(1, dims=0), dims, torch.bfloat16)[1]
    inputs = reader_probes.functional_inputs(dims, 64, 4, 16, seed=3)
    for a, b in ((uk, uv), (uk, other)):
        want = reader_probes.torch_functional_error(a, b, x, dims, inputs)
        got = reader_probes.native_functional_error(a, b, x, dims, 64, inputs)
        assert abs(got - want) <= 1e-3 * want, (got, want)


def test_verify_falls_back_to_torch_when_a_raw_buffer_check_disagrees(monkeypatch, fresh_readers):
    monkeypatch.setattr(native, "artifact_bound", lambda *args: 0)  # a check that never finds a bad element
    fresh_readers.reset()
    readers = readers_mod.reader_backend()
    assert (readers.name, readers.reason) == ("torch", "native artifact bound disagreed with torch on the probe")
