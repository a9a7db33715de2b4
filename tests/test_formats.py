"""A format is one unit (mla_convert.formats): the registry, nothing outside a format's module
comparing its name, and a third format (compressed-tensors per-tensor FP8, tests/support/tensor_fp8)
registered from the test suite alone that converts a demo checkpoint, loads as a valid
compressed-tensors config, matches a slow reference and verifies, with and without --source."""

from __future__ import annotations

import ast
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from mla_convert import formats
from mla_convert.conversion.pipeline import convert
from mla_convert.errors import ConvertError
from mla_convert.kernels.transforms import PLAN_TRANSFORMS
from mla_convert.settings import Options
from mla_convert.verification import verify
from mla_convert.verification.values import CHECKS
from support import tensor_fp8
from support.edits import rewrite_output_tensor
from support.reference import dequant_block

ROOT = Path(__file__).resolve().parent.parent


def test_the_registry_without_torch():
    code = "import sys; from mla_convert import formats; print(formats.names(), 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "('channel-fp8', 'bf16') False"


def test_every_format_names_registered_transforms_and_checks():
    for fmt in formats.all_formats():
        assert all(op in PLAN_TRANSFORMS for op in fmt.ops()), fmt.name
        assert set(fmt.value_checks) <= set(CHECKS.checks), fmt.name
        if fmt.quantizes:
            assert PLAN_TRANSFORMS[fmt.block_fp8.op].writes == fmt.block_fp8.dtype


# What a comparison of a format or a target by name looks like: a format's or a target's name (or
# a constant once spelling one) on one side, the output's format or target on the other.
_NAMED = {"CHANNEL_FP8", "BF16", "GAUDI2", "GAUDI3"}
_SUBJECT = ("format", "fmt", "target")


def _compared_names(path: Path, names: set[str]) -> list[str]:
    """`fmt == "NAME"`, `options.target != GAUDI3`, `format in (...)`: a format's or a target's name
    compared with an output's format or target."""
    found = []
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        named = any(
            (isinstance(v, ast.Constant) and v.value in names) or (isinstance(v, ast.Name) and v.id in _NAMED)
            for side in sides
            for v in (side.elts if isinstance(side, ast.Tuple | ast.List | ast.Set) else [side])
        )
        subject = any(word in ast.unparse(side) for side in sides for word in _SUBJECT)
        if named and subject:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def _product() -> list[Path]:
    return [p for p in sorted((ROOT / "mla_convert").rglob("*.py")) if p.relative_to(ROOT).parts[1] != "formats"]


def test_nothing_outside_the_format_modules_compares_a_formats_name():
    names = set(formats.names()) | set(formats.TARGETS)
    # (on 6a2a6d6: 19 comparisons in 8 modules: cli/console, output/card, output/card_text,
    # plan/output_config, plan/planner, settings, verification/expects, verification/structure)
    assert [f for p in _product() for f in _compared_names(p, names)] == []


# ---- the third format ------------------------------------------------------------------------


@pytest.fixture
def tensor_format():
    with tensor_fp8.registered() as fmt:
        yield fmt
    assert tensor_fp8.NAME not in formats.names() and tensor_fp8.BLOCK_OP not in PLAN_TRANSFORMS


def reference_per_tensor(x: torch.Tensor, fp8_max: float, signed_zero: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Slow and plain: the largest |x| found element by element over the rows; s = that / fp8_max
    (1 for an all-zero tensor); each row divided by s, clamped and rounded to e4m3."""
    amax = 0.0
    for row in x:
        amax = max(amax, float(row.abs().max()))
    s = torch.tensor(amax, dtype=torch.float32) / fp8_max
    if float(s) == 0.0:
        s = torch.tensor(1.0)
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    for i, row in enumerate(x):
        q[i] = torch.clamp(row / s, -fp8_max, fp8_max).to(torch.float8_e4m3fn)
        if not signed_zero:
            r = q[i].to(torch.float32)
            r[r == 0] = 0.0
            q[i] = r.to(torch.float8_e4m3fn)
    return q, s.reshape(1)


def _tensors(root: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(root.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            out |= {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    return out


@pytest.mark.parametrize("target", ["gaudi3", "gaudi2"])
def test_a_third_format_converts_loads_and_verifies(tensor_format, tiny_src, tmp_path, target):
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStrategy

    out = tmp_path / "out"
    ignore = r"model\.layers\.1\.mlp\.experts\.0\."
    result = convert(tiny_src, out, Options(format=tensor_fp8.NAME, target=target, ignore=(ignore,)))
    assert result.format == tensor_fp8.NAME and result.fp8_weights_converted > 0
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(qc)
    scheme = parsed.config_groups["group_0"]
    assert scheme.weights.strategy == QuantizationStrategy.TENSOR and not scheme.weights.dynamic
    assert scheme.weights.symmetric and scheme.weights.num_bits == 8 and scheme.weights.type == "float"
    assert scheme.input_activations.strategy == QuantizationStrategy.TOKEN and scheme.input_activations.dynamic
    assert f"re:{ignore}" in parsed.ignore and "lm_head" in parsed.ignore

    fp8_max, signed_zero = formats.TARGETS[target].fp8_max, formats.TARGETS[target].signed_zero
    src, got = _tensors(tiny_src), _tensors(out)
    checked = 0
    for name, w in src.items():
        if w.dtype != torch.float8_e4m3fn or got[name].dtype == torch.bfloat16:  # not FP8, or ignored
            continue
        q, s = reference_per_tensor(dequant_block(w, src[name + "_scale_inv"]), fp8_max, signed_zero)
        module = name.removesuffix(".weight")
        assert torch.equal(got[name].view(torch.uint8), q.view(torch.uint8)), name
        assert got[module + ".weight_scale"].shape == (1,) and torch.equal(got[module + ".weight_scale"], s), name
        checked += 1
    assert 0 < checked < result.fp8_weights_converted
    assert not any(n.endswith("_scale_inv") for n in got)

    card = (out / "README.md").read_text()
    assert "per-tensor FP8 (compressed-tensors)" in card and "tensor-fp8" in card
    for source in (None, tiny_src):
        report = verify(out, source)
        assert report.ok, [f.line() for f in report.failures()][:5]
        assert report.groups["values"].checked > 0 and report.groups["mla"].checked > 0
    assert report.groups["source"].checked >= 2 * checked

    # Tampered: one code of one weight moved by a step (a different value, still in range).
    name = next(n for n, t in got.items() if t.dtype == torch.float8_e4m3fn and "experts" in n)

    def bump(tensors):
        codes = tensors[name].view(torch.uint8).clone()
        codes[0, 0] = (codes[0, 0] & 0x80) | 0x30 if (codes[0, 0] & 0x7F) != 0x30 else 0x31
        tensors[name] = codes.view(torch.float8_e4m3fn)

    rewrite_output_tensor(out, name, bump)
    report = verify(out, tiny_src)
    failed = {(f.group, f.check, f.tensor) for f in report.failures()}
    assert not report.ok and ("source", "fp8-bound", name) in failed, failed

    # Its own value check: a weight whose largest code is not FP8_MAX's (every code 1.0).
    other = next(n for n, t in got.items() if t.dtype == torch.float8_e4m3fn and "self_attn" in n)

    def flatten(tensors):
        tensors[other] = torch.full_like(tensors[other].view(torch.uint8), 0x38).view(torch.float8_e4m3fn)

    rewrite_output_tensor(out, other, flatten)
    failed = {(f.group, f.check, f.tensor) for f in verify(out).failures()}
    assert ("values", tensor_fp8.VALUE_CHECK, other) in failed, failed


def test_a_third_format_quantizes_a_16_bit_source(tensor_format, family_checkpoints, tmp_path):
    src = family_checkpoints.source("deepseek-v2-lite")
    out = tmp_path / "out"
    result = convert(src, out, Options(format=tensor_fp8.NAME))
    assert result.bf16_linears_quantized > 0
    got, source = _tensors(out), _tensors(src)
    quantized = [n for n, t in got.items() if t.dtype == torch.float8_e4m3fn]
    assert len(quantized) == result.bf16_linears_quantized
    for name in quantized:
        q, s = reference_per_tensor(source[name].float(), 448.0, True)
        assert torch.equal(got[name].view(torch.uint8), q.view(torch.uint8)), name
        assert torch.equal(got[name.removesuffix(".weight") + ".weight_scale"], s), name
    for from_source in (None, src):
        report = verify(out, from_source)
        assert report.ok, [f.line() for f in report.failures()][:5]


def test_the_format_is_gone_after_its_block(tensor_format):
    assert tensor_fp8.NAME in formats.names()


def test_an_unregistered_format_is_refused():
    with pytest.raises(ConvertError, match="expected one of channel-fp8, bf16"):
        Options(format=tensor_fp8.NAME)
    assert math.isfinite(formats.TARGETS["gaudi2"].fp8_max)
