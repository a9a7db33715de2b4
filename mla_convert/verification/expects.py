"""verify, expectations: every tensor a converted directory must hold (Expect), with its dtype,
shape and role in the conversion.

They come from the plan of `--source` when one is given (exact: names, dtypes, shapes, files), else
from what the family member's config implies for the recorded format (family.implied_tensors),
plus the known extra buffers of real checkpoints that are present.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from mla_convert.constants import BF16, CHANNEL_SCALE_SUFFIX, FLOAT_WEIGHT_DTYPES, FP8_E4M3
from mla_convert.plan.ops import COPY, FP8_SCALE, TO_BF16, TO_FP8
from mla_convert.plan.planner import Plan
from mla_convert.source.checkpoint import module_of
from mla_convert.source.family import FP8_LINEAR, OTHER, ModelLayout, extra_buffer_layer, implied_tensors
from mla_runtime.safetensors_file import ShardHeader, TensorInfo


@dataclass(frozen=True)
class Expect:
    """One tensor the converted model must hold."""

    name: str
    op: str  # the plan's op: COPY, TO_BF16, TO_FP8 / QUANT_FP8 (channel-FP8 weight) or FP8_SCALE
    dtype: str | None  # safetensors dtype; None: any of FLOAT_WEIGHT_DTYPES
    shape: tuple[int, ...]
    kind: str = OTHER  # FP8_LINEAR | LINEAR | OTHER
    source: str | None = None  # with --source: the source tensor it derives from
    file: str | None = None  # with --source: the output shard the plan puts it in

    def admits(self, info: TensorInfo) -> bool:
        """The header's dtype and shape are the expected ones."""
        dtype_ok = info.dtype in FLOAT_WEIGHT_DTYPES if self.dtype is None else info.dtype == self.dtype
        return dtype_ok and info.shape == self.shape

    def describe(self) -> str:
        return f"{self.dtype or '/'.join(FLOAT_WEIGHT_DTYPES)}{list(self.shape)}"


def ct_ignored(module: str, ignore: list[str]) -> bool:
    """compressed-tensors semantics: 're:PATTERN' entries match with re.match, others by exact name."""
    for entry in ignore:
        if entry.startswith("re:"):
            try:
                if re.match(entry[3:], module):
                    return True
            except re.error:
                continue
        elif entry == module:
            return True
    return False


def expects_from_config(cfg: dict, fmt: str, ignore: list[str]) -> dict[str, Expect]:
    out: dict[str, Expect] = {}
    for name, (shape, kind) in implied_tensors(cfg).items():
        module = module_of(name)
        if kind != FP8_LINEAR:
            out[name] = Expect(name, COPY, None, shape, kind)
        elif fmt == BF16 or ct_ignored(module, ignore):
            out[name] = Expect(name, TO_BF16, "BF16", shape, kind)
        else:
            out[name] = Expect(name, TO_FP8, FP8_E4M3, shape, kind)
            scale = module + CHANNEL_SCALE_SUFFIX
            out[scale] = Expect(scale, FP8_SCALE, "F32", (shape[0], 1), kind)
    return out


def extra_buffer_expects(cfg: dict, headers: dict[str, ShardHeader], expects: dict[str, Expect]) -> dict[str, Expect]:
    """Known extra buffers of real checkpoints (a layer's rotary inv_freq) that the shard `headers`
    hold and `expects` lacks: copied 1-D tensors of any length, for the layers the config has."""
    layers = ModelLayout.of(cfg).all_layers
    out: dict[str, Expect] = {}
    for hd in headers.values():
        for name, info in hd.tensors.items():
            layer = extra_buffer_layer(name)
            if layer is not None and layer < layers and len(info.shape) == 1 and name not in expects:
                out.setdefault(name, Expect(name, COPY, None, info.shape))
    return out


def expects_from_plan(plan: Plan) -> dict[str, Expect]:
    kinds = {n: k for n, (_, k) in implied_tensors(plan.source.config).items()}
    return {
        t.name: Expect(
            t.name, t.op, t.dtype, t.shape, kinds.get(f"{module_of(t.name)}.weight", OTHER), t.source, job.file
        )
        for job in plan.shards
        for t in job.tensors
    }
