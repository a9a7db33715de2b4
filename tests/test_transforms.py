"""The transforms (mla_convert.kernels.transforms), one module each: what each declares holds
together, its eager definition equals the slow reference, its C entry (on tensors and on raw rows)
equals its definition bit for bit on its probes, and the kernel state is the run's."""

import ast
import re
from pathlib import Path

import pytest
import torch

from mla_convert.demo.synthetic import quantize_block_fp8
from mla_convert.kernels import fastest, native
from mla_convert.kernels.bits import count_differing
from mla_convert.kernels.transforms import KERNEL_TRANSFORMS, PLAN_TRANSFORMS, SPLITS, Params
from mla_convert.kernels.transforms.transform import BF16_DTYPE, F32_DTYPE, FP8_DTYPE, SOURCE_DTYPE
from mla_convert.plan import ops
from mla_convert.process import resources
from mla_convert.verification.bounds import TOLERANCES
from mla_convert.verification.comparisons import comparison
from mla_runtime.format import MlaDims

ROOT = Path(__file__).resolve().parent.parent
PARAMS = [Params((128, 128), 448.0, True), Params((64, 32), 240.0, False)]
TRANSFORMS = {**PLAN_TRANSFORMS, **KERNEL_TRANSFORMS}


def test_every_op_of_a_plan_but_the_scale_is_a_transform_of_its_own_module():
    plan_ops = {v for k, v in vars(ops).items() if k.isupper() and isinstance(v, str)} - {ops.FP8_SCALE}
    assert plan_ops == set(PLAN_TRANSFORMS)
    modules = {}
    for op, t in TRANSFORMS.items():
        declared = re.compile(rf'^OP\w*( = |, .* = ).*"{op}"', re.MULTILINE)
        (owner,) = [m for m in (ROOT / "mla_convert/kernels/transforms").glob("*.py") if declared.search(m.read_text())]
        modules.setdefault(owner.name, []).append(op)
        assert t.op == op
    # one module per transform; the MLA splits (block FP8 and 16-bit) share one
    assert all(len(v) == 1 for k, v in modules.items() if k != "mla_split.py"), modules
    assert sorted(modules["mla_split.py"]) == sorted(SPLITS)


@pytest.mark.parametrize("op", sorted(TRANSFORMS))
def test_what_a_transform_declares_holds_together(op):
    t = TRANSFORMS[op]
    assert t.reads and t.writes in (FP8_DTYPE, BF16_DTYPE, F32_DTYPE, SOURCE_DTYPE)
    assert comparison(t.verify) is not None or t.verify == "mla", t.verify
    assert t.bound in TOLERANCES
    if t.rows is not None:
        assert t.native is not None and t.native_dtypes
    if t.split is not None:
        assert t.split in SPLITS and t.reads[0] == "weight"
    if t.exact_op is not None:
        assert t.exact_op in KERNEL_TRANSFORMS and KERNEL_TRANSFORMS[t.exact_op].reads == t.reads
    assert (t.exact is None) == (t.from_exact is None)
    if op in KERNEL_TRANSFORMS:  # a kernel set implements it: it must say what it is checked on
        assert t.probes is not None and len(t.outputs) >= 1


def _block(shape, block, seed=0):
    g = torch.Generator().manual_seed(seed)
    return quantize_block_fp8(torch.randn(shape, generator=g) * 3, block)


DIMS = MlaDims(num_heads=3, qk_nope_head_dim=5, v_head_dim=4, kv_lora_rank=70)


def _int4(rows, cols, group, seed=0):
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(-(2**31), 2**31 - 1, (rows, cols // 8), generator=g, dtype=torch.int32)
    scale = (torch.rand(rows, cols // group, generator=g) + 0.01).to(torch.bfloat16)
    return packed, scale


@pytest.mark.parametrize("p", PARAMS, ids=lambda p: f"{p.block}-{p.fp8_max:g}")
def test_each_definition_equals_the_slow_reference(p, reference):
    w, s = _block((150, 100), p.block)
    x = reference.dequant_block(w, s, p.block)
    same = reference.same_bits
    want_q, want_s = reference.channel_fp8(x, p.fp8_max, p.signed_zero)
    got_q, got_s = KERNEL_TRANSFORMS[ops.TO_FP8].eager(p)(w, s)
    assert same(got_q, want_q) and same(got_s, want_s)
    assert same(KERNEL_TRANSFORMS[ops.TO_BF16].eager(p)(w, s), x.to(torch.bfloat16))
    assert same(KERNEL_TRANSFORMS["dequant"].eager(p)(w, s), x)

    w16 = (torch.randn(40, 90, generator=torch.Generator().manual_seed(1)) * 7).to(torch.bfloat16)
    got = KERNEL_TRANSFORMS[ops.QUANT_FP8].eager(p)(w16)
    assert all(
        same(a, b) for a, b in zip(got, reference.channel_fp8(w16.float(), p.fp8_max, p.signed_zero), strict=True)
    )

    packed, scale = _int4(6, 64, 32)
    want = reference.int4_dequant(packed, scale, 64).to(torch.bfloat16)
    assert same(PLAN_TRANSFORMS[ops.INT4_TO_BF16].eager(p)(packed, scale, 64, 32), want)

    kv_b, kv_s = _block(DIMS.kv_b_shape(), p.block, seed=2)
    seed = (DIMS.num_heads, DIMS.qk_nope_head_dim, DIMS.v_head_dim, DIMS.kv_lora_rank)
    exact = reference.dequant_block(kv_b, kv_s, p.block).to(torch.bfloat16)
    got = SPLITS["mla"].eager(p)(kv_b, kv_s, DIMS)
    assert all(same(a, b) for a, b in zip(got, reference.seed_split(exact, *seed), strict=True))
    got = SPLITS["mla16"].eager(p)(exact, DIMS)
    assert all(same(a, b) for a, b in zip(got, reference.seed_split(exact, *seed), strict=True))
    assert PLAN_TRANSFORMS[ops.COPY].eager(p)(w16) is w16


@pytest.mark.parametrize("p", PARAMS, ids=lambda p: f"{p.block}-{p.fp8_max:g}")
@pytest.mark.parametrize("op", sorted(op for op, t in KERNEL_TRANSFORMS.items() if t.native is not None))
def test_each_c_entry_equals_its_definition_on_its_probes(op, p):
    t = KERNEL_TRANSFORMS[op]
    fast, eager = t.native(p), t.eager(p)
    probes = t.probes(p)
    assert probes
    for args in probes:
        got, want = fast(*args), eager(*args)
        got, want = (got if isinstance(got, tuple) else (got,)), (want if isinstance(want, tuple) else (want,))
        assert len(got) == len(want) == len(t.outputs)
        assert [count_differing(a, b) for a, b in zip(got, want, strict=True)] == [0] * len(want)


@pytest.mark.parametrize("p", PARAMS, ids=lambda p: f"{p.block}-{p.fp8_max:g}")
@pytest.mark.parametrize("op", sorted(op for op, t in PLAN_TRANSFORMS.items() if t.rows is not None))
def test_each_row_kernel_equals_its_definition(op, p):
    """Transform.rows, the shard job's hot path on raw addresses, over two row ranges."""
    t = PLAN_TRANSFORMS[op]
    if "block_scale" in t.reads:
        w, s = _block((130, 3 * p.block[1] + 5), p.block, seed=3)
        args, s_addr = (w, s), s.data_ptr()
    else:
        w = (torch.randn(130, 77, generator=torch.Generator().manual_seed(3)) * 5).to(torch.bfloat16)
        args, s_addr = (w,), 0
    want = t.eager(p)(*args)
    n, k = w.shape
    out = torch.empty(n, k, dtype=torch.float8_e4m3fn if t.writes == FP8_DTYPE else torch.bfloat16)
    scale = torch.empty(n, 1, dtype=torch.float32)
    kernel, row = t.rows(p), w.element_size() * k
    for r0, r1 in ((0, 61), (61, n)):
        kernel(w.data_ptr() + r0 * row, s_addr, k, out.data_ptr() + r0 * out.element_size() * k,
               scale.data_ptr() + 4 * r0 if t.writes == FP8_DTYPE else 0, r0, r1)  # fmt: skip
    got = (out, scale) if t.writes == FP8_DTYPE else (out,)
    want = want if isinstance(want, tuple) else (want,)
    assert [count_differing(a, b) for a, b in zip(got, want, strict=True)] == [0] * len(want)


@pytest.mark.parametrize("kind", sorted(SPLITS))
def test_each_split_row_kernel_takes_the_layers_own_dims(kind):
    """The MLA split on raw addresses at two layers' dims (a NoPE-like layer has a wider nope)."""
    p = PARAMS[0]
    t = SPLITS[kind]
    for dims in (DIMS, MlaDims(num_heads=2, qk_nope_head_dim=9, v_head_dim=4, kv_lora_rank=70)):
        w, s = _block(dims.kv_b_shape(), p.block, seed=4)
        args = (w, s) if kind == "mla" else (w.float().to(torch.bfloat16),)
        want = t.eager(p)(*args, dims)
        uk = torch.empty(dims.w_uk_t_shape(), dtype=torch.bfloat16)
        uv = torch.empty(dims.w_uv_shape(), dtype=torch.bfloat16)
        t.rows(p)(args[0].data_ptr(), s.data_ptr() if kind == "mla" else 0, dims, uk.data_ptr(), uv.data_ptr())
        assert [count_differing(a, b) for a, b in zip((uk, uv), want, strict=True)] == [0, 0]


def test_the_kernel_state_is_the_runs_and_closed_with_it(monkeypatch):
    """The library, the kernels' thread pool and the chosen kernel set belong to the run's owner:
    closed when the run scope ends, and a later run chooses again."""
    from mla_convert.process import threads

    monkeypatch.setattr(threads, "count", lambda: 2)
    with resources.run_scope() as owner:
        native.decode(torch.zeros(4 * 65536, dtype=torch.uint8).view(torch.float8_e4m3fn))  # two threads
        pool = owner.get("kernels.native.threads").pool
        first = fastest.select_kernels((128, 128), 448.0, "cpu", "eager", ("fp8",))
        assert native.is_loaded() and pool is not None
        assert fastest.select_kernels((128, 128), 448.0, "cpu", "eager", ("fp8",)) is first
    assert owner.get("kernels.native.library") is None and pool._shutdown
    with resources.run_scope():
        assert fastest.select_kernels((128, 128), 448.0, "cpu", "eager", ("fp8",)) is not first


OWNED = ["mla_convert/kernels", "mla_convert/conversion/compute.py", "mla_convert/conversion/shard_job.py",
         "mla_convert/verification/readers.py"]  # fmt: skip


def test_no_global_statements_in_the_kernels_or_their_callers():
    found = []
    for root in OWNED:
        for path in sorted((ROOT / root).rglob("*.py")) if (ROOT / root).is_dir() else [ROOT / root]:
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Global):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == []
