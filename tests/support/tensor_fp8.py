"""A third output format, declared and registered from the test suite alone, through the product's
public seams (docs/adding-a-format.md), with no product file edited for it: compressed-tensors
per-tensor FP8 (the `tensor` strategy), a format vLLM loads. Each quantized linear is an e4m3fn
weight with one float32 `weight_scale` of shape [1], `max|w| / FP8_MAX` of its exact value;
activations dynamic per token.

`registered()` adds, for the time of a `with` block:
- two transforms (kernels.transforms.register): block FP8 -> per-tensor FP8 and 16-bit -> per-tensor
  FP8, each with its eager definition;
- their comparison with the source (verification.comparisons.register): the FP8 bound of
  verification.bounds element by element, and a scale no larger than max|w| / FP8_MAX allows;
- a value check of its own (verification.values.register): every non-zero FP8 tensor reaches FP8_MAX
  (channel FP8's row-max rule does not hold here);
- the format (formats.register).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from mla_convert import formats
from mla_convert.formats import Becomes, ScaleLayout
from mla_convert.formats.compressed_tensors import CompressedTensorsFp8, static_fp8_weights
from mla_convert.kernels import numerics
from mla_convert.kernels import transforms as transforms_registry
from mla_convert.kernels.transforms import Params, Transform
from mla_convert.kernels.transforms.transform import FP8_DTYPE
from mla_convert.verification import comparisons, values
from mla_convert.verification.bounds import fp8_allowed_error, scale_limit
from mla_convert.verification.error_stats import Mismatches
from mla_convert.verification.report import SOURCE, VALUES
from mla_convert.verification.rows import row_chunks

NAME = "tensor-fp8"
BLOCK_OP, FLOAT_OP = "tensor_fp8", "tensor_fp8_quant"
COMPARISON, VALUE_CHECK = "tensor_fp8", "fp8-tensor-max"
SCALE = ScaleLayout(".weight_scale", "F32", lambda shape: (1,))


def quantize_per_tensor(x: torch.Tensor, fp8_max: float, signed_zero: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition: s = fl(max|x| / fp8_max) (1.0 for an all-zero tensor), q = e4m3(clamp(x / s));
    without a signed zero, every zero code +0."""
    amax = x.abs().amax() if x.numel() else torch.zeros((), dtype=torch.float32)
    scale = (amax / torch.tensor(fp8_max, dtype=torch.float32)).reshape(1)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (x / scale).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn)
    if not signed_zero:
        codes = q.view(torch.uint8)
        q = codes.masked_fill(codes == 0x80, 0).view(torch.float8_e4m3fn)
    return q, scale


def _block_eager(p: Params):
    return lambda w, s: quantize_per_tensor(numerics.dequantize_block_fp8(w, s, p.block), p.fp8_max, p.signed_zero)


def _float_eager(p: Params):
    return lambda w: quantize_per_tensor(w.float(), p.fp8_max, p.signed_zero)


BLOCK_TRANSFORM = Transform(
    op=BLOCK_OP, reads=("weight", "block_scale"), writes=FP8_DTYPE, eager=_block_eager,
    outputs=("weights", "scales"), split="mla", exact_op="dequant", verify=COMPARISON, bound=COMPARISON,
)  # fmt: skip
FLOAT_TRANSFORM = Transform(
    op=FLOAT_OP, reads=("weight",), writes=FP8_DTYPE, eager=_float_eager, outputs=("weights", "scales"),
    split="mla16", verify=COMPARISON, bound=COMPARISON,
)  # fmt: skip


def _compare(source, info, q: torch.Tensor, s: torch.Tensor, job) -> None:
    """A per-tensor FP8 weight against the exact value of its source, row chunk by row chunk: the
    FP8 bound element by element, and one scale no larger than max|x| / FP8_MAX allows."""
    bad, big_scale = Mismatches(), Mismatches()
    scale = s.reshape(1, 1)
    amax = torch.zeros(())
    for r0, r1 in row_chunks(q.shape[0], q.shape[1], source.row_align(job)):
        x = source.source_values(job, r0, r1)
        found = q[r0:r1].float() * scale
        bad.add(found, x, ~((found - x).abs() <= fp8_allowed_error(x.abs(), scale)), r0)
        amax = torch.maximum(amax, x.abs().amax())
    limit = scale_limit(amax.reshape(1), source.fp8_max)
    big_scale.add(s, limit, ~(s <= limit) & (amax > 0))
    source.out.verdict(bad, SOURCE, "fp8-bound", info.name, "|w*s - x| within the FP8 bound", q.numel(), "out: ")
    source.out.verdict(big_scale, SOURCE, "fp8-scale", job.scale_name, "s <= (max|w| + 1e-8)/FP8_MAX*(1 + 2^-10)", 1)


COMPARE = comparisons.Comparison(COMPARISON, ("fp8-bound", "fp8-scale"), _compare, partners_scale=True)


def _tensor_max_torch(v) -> None:
    top = v.top
    m = Mismatches()
    most = v.row_max.amax()
    if int(most) not in (top, 0):
        found = v.flat.float().abs().amax().reshape(1)
        m.add(found, torch.full((1,), v.fp8_max), torch.ones(1, dtype=torch.bool))
    v.out.verdict(m, VALUES, VALUE_CHECK, v.info.name, f"max|w| = {v.fp8_max:g} (or an all-zero tensor)", 1)


def _tensor_max_native(v) -> bool:
    top = v.checks.top
    return top is not None and max(v.row_max) in (top, 0)


TENSOR_MAX = values.ValueCheck(
    VALUE_CHECK,
    lambda info, is_scale: info.dtype == "F8_E4M3" and len(info.shape) == 2 and info.shape[0] * info.shape[1] > 0,
    _tensor_max_torch,
    _tensor_max_native,
)


class TensorFp8(CompressedTensorsFp8):
    name = NAME
    rank = 50
    help = "tensor-fp8 (compressed-tensors per-tensor FP8)"
    words = "per-tensor FP8"
    block_fp8 = Becomes(BLOCK_OP, "F8_E4M3", SCALE)
    float_linear = Becomes(FLOAT_OP, "F8_E4M3", SCALE)
    weights = static_fp8_weights("tensor")
    value_checks = ("nan-inf", "fp8-range", "fp8-negative-zero", "fp8-scale", VALUE_CHECK)

    def card_words(self, target: str, fp8_max: float) -> str:
        return f"per-tensor FP8 (compressed-tensors) for {target} (FP8 max {fp8_max:g})"

    def card_weights(self, facts) -> str:
        return (
            "## The weights\n\n"
            "Each linear the source holds in block FP8 is `X.weight` float8_e4m3fn with one `X.weight_scale` "
            f"float32 [1], `max|w| / {facts.fp8_max:g}`; `{facts.config_name}` carries a compressed-tensors "
            f"`quantization_config` whose `ignore` list names the {facts.ignored_modules} modules left in 16 bits."
        )


@contextlib.contextmanager
def registered() -> Iterator[TensorFp8]:
    """The format and everything it needs, registered for the block's time."""
    fmt = TensorFp8()
    with (
        transforms_registry.registered(BLOCK_TRANSFORM, FLOAT_TRANSFORM),
        comparisons.registered(COMPARE),
        values.registered(TENSOR_MAX),
        formats.registered(fmt),
    ):
        yield fmt
