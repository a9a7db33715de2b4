"""verify, expectations: every tensor a converted directory must hold (Expect), with its dtype,
shape and role in the conversion.

They come from the plan of `--source` when one is given (exact: names, dtypes, shapes, files), else
from what the family member's config implies for the recorded format (family.implied_tensors; a
linear as the format makes it, formats.Format.block_fp8, where its quantization_config quantizes
it), plus the known extra buffers of real checkpoints that are present.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mla_convert.constants import (
    FLOAT_WEIGHT_DTYPES,
    INT4_PACKED,
    INT4_PACKED_DTYPE,
    INT4_SCALE,
    INT4_SHAPE_DTYPES,
    INT4_ZERO_POINT,
)
from mla_convert.constants import INT4_SHAPE as INT4_SHAPE_SUFFIX
from mla_convert.formats import INT4, QUANTIZED, Format
from mla_convert.formats.compressed_tensors import int4_group_size
from mla_convert.plan.ops import COPY, FP8_SCALE, INT4_SHAPE, TO_BF16
from mla_convert.plan.planner import Plan
from mla_convert.source.checkpoint import module_of
from mla_convert.source.family import FP8_LINEAR, OTHER, ModelLayout, extra_buffer_layer, implied_tensors
from mla_convert.source.naming import DEEPSEEK_NAMES, TensorNames
from mla_runtime.safetensors_file import ShardHeader, TensorInfo


@dataclass(frozen=True)
class Expect:
    """One tensor the converted model must hold."""

    name: str
    op: str  # the plan's op: COPY, TO_BF16, a format's quantizing op (TO_FP8, QUANT_FP8, ...), FP8_SCALE, the INT4 ops
    dtype: str | tuple[str, ...] | None  # safetensors dtype (or one of several); None: any of FLOAT_WEIGHT_DTYPES
    shape: tuple[int, ...]
    kind: str = OTHER  # FP8_LINEAR | LINEAR | OTHER
    source: str | None = None  # with --source: the source tensor it derives from
    file: str | None = None  # with --source: the output shard the plan puts it in

    def dtypes(self) -> tuple[str, ...]:
        if self.dtype is None:
            return FLOAT_WEIGHT_DTYPES
        return self.dtype if isinstance(self.dtype, tuple) else (self.dtype,)

    def admits(self, info: TensorInfo) -> bool:
        """The header's dtype and shape are the expected ones."""
        return info.dtype in self.dtypes() and info.shape == self.shape

    def describe(self) -> str:
        return f"{'/'.join(self.dtypes())}{list(self.shape)}"


def expects_from_config(
    cfg: dict, fmt: Format, qc: dict | None, names: TensorNames = DEEPSEEK_NAMES
) -> dict[str, Expect]:
    """What the family member's text config `cfg` implies for the output format `fmt`, by the
    checkpoint's own names; a linear as the output's quantization_config `qc` claims it (the
    format's reading, Format.claimed): quantized as the format quantizes a block-FP8 weight (with
    its scale), kept INT4, or 16-bit."""
    out: dict[str, Expect] = {}
    for deepseek, (shape, kind) in implied_tensors(cfg).items():
        name = names.from_deepseek(deepseek)
        module = module_of(name)
        scheme = fmt.claimed(names.config_module(module), qc) if kind == FP8_LINEAR and qc else None
        if kind != FP8_LINEAR:
            out[name] = Expect(name, COPY, None, shape, kind)
        elif scheme == INT4:
            out |= _int4_expects(module, shape, *(int4_group_size(qc) or (None, True)))
        elif scheme == QUANTIZED:
            b = fmt.block_fp8
            out[name] = Expect(name, b.op, b.dtype, shape, kind)
            if b.scale is not None:
                scale = b.scale.name(name)
                out[scale] = Expect(scale, FP8_SCALE, b.scale.dtype, b.scale.shape(shape), kind)
        else:
            out[name] = Expect(name, TO_BF16, "BF16", shape, kind)
    return out


def _int4_expects(module: str, shape: tuple[int, ...], group_size: int | None, symmetric: bool) -> dict[str, Expect]:
    """An INT4 linear kept as the source has it: its packed codes, scales, shape (zero points)."""
    (n, k), per = shape, group_size or shape[1]
    parts = [
        (INT4_PACKED, COPY, INT4_PACKED_DTYPE, (n, math.ceil(k / 8))),
        (INT4_SCALE, COPY, None, (n, k // per)),
        (INT4_SHAPE_SUFFIX, INT4_SHAPE, INT4_SHAPE_DTYPES, (2,)),
    ]
    if not symmetric:
        parts.append((INT4_ZERO_POINT, COPY, INT4_PACKED_DTYPE, (math.ceil(n / 8), k // per)))
    return {f"{module}.{p}": Expect(f"{module}.{p}", op, dtype, s, FP8_LINEAR) for p, op, dtype, s in parts}


def extra_buffer_expects(
    cfg: dict, headers: dict[str, ShardHeader], expects: dict[str, Expect], names: TensorNames = DEEPSEEK_NAMES
) -> dict[str, Expect]:
    """Known extra buffers of real checkpoints (a layer's rotary inv_freq) that the shard `headers`
    hold and `expects` lacks: copied 1-D tensors of any length, for the layers the config has."""
    layers = ModelLayout.of(cfg).all_layers
    out: dict[str, Expect] = {}
    for hd in headers.values():
        for name, info in hd.tensors.items():
            deepseek = names.to_deepseek(name)
            layer = extra_buffer_layer(deepseek) if deepseek else None
            if layer is not None and layer < layers and len(info.shape) == 1 and name not in expects:
                out.setdefault(name, Expect(name, COPY, None, info.shape))
    return out


def other_part_expects(names: TensorNames, headers: dict[str, ShardHeader], has_vision: bool) -> dict[str, Expect]:
    """The tensors of another part of the model (a vision tower or encoder) that the config
    declares: copies, each as its header says (their values are still checked)."""
    if not has_vision:
        return {}
    return {
        name: Expect(name, COPY, info.dtype, info.shape)
        for hd in headers.values()
        for name, info in hd.tensors.items()
        if names.is_extra(name)
    }


def expects_from_plan(plan: Plan) -> dict[str, Expect]:
    kinds = {n: k for n, (_, k) in implied_tensors(plan.source.config).items()}
    names = plan.source.names

    def kind(name: str) -> str:
        deepseek = names.to_deepseek(f"{module_of(name)}.weight")
        return kinds.get(deepseek, OTHER) if deepseek else OTHER

    return {
        t.name: Expect(t.name, t.op, t.dtype, t.shape, kind(t.name), t.source, job.file)
        for job in plan.shards
        for t in job.tensors
    }
