"""The source's quantization_config: which of the quantized sources this tool reads it describes.

- none: a BF16 source;
- DeepSeek's block FP8 (`quant_method: fp8`, `fmt: e4m3`, `weight_block_size`): F8_E4M3 weights,
  each with an F32 or E8M0 `weight_scale_inv` multiplier per block;
- compressed-tensors FP8_BLOCK: one float-quantized group of 8-bit float weights
  with `strategy: block` and a `block_structure`: the same arithmetic, the multiplier named
  `weight_scale`, stored BF16 (or F32);
- compressed-tensors pack-quantized INT4 (routed experts, the rest BF16): one group of 4-bit int
  weights, `strategy: group` (or `channel`), symmetric or not: `weight_packed` I32, `weight_scale`,
  `weight_shape`, and for an asymmetric scheme `weight_zero_point`.

Anything else is refused in one line: this tool's own channel-FP8 output (with a hint that it looks
like a converted checkpoint), NVFP4 (source.nonmembers), other schemes naming what they are.
Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass

from mla_convert.constants import (
    BLOCK_SCALE_DTYPES,
    BLOCK_SCALE_SUFFIX,
    CHANNEL_SCALE_SUFFIX,
    CT_BLOCK_SCALE_DTYPES,
)
from mla_convert.source.nonmembers import nvfp4_release

BF16_SOURCE, BLOCK_FP8, INT4 = "bf16", "block-fp8", "int4"
CT = "compressed-tensors"
PACK_QUANTIZED, FLOAT_QUANTIZED = "pack-quantized", "float-quantized"


class QuantizationError(ValueError):
    """A quantization_config this tool does not read; the message is one line saying why."""


@dataclass(frozen=True)
class Int4Scheme:
    """A compressed-tensors pack-quantized INT4 group, as the source states it."""

    group_name: str  # its key in config_groups
    group: dict  # the group as the source has it (weights, targets, format, ...): kept in the output
    group_size: int | None  # columns per scale; None: strategy channel (one scale per row)
    symmetric: bool  # False: zero points (weight_zero_point)

    def columns_per_scale(self, k: int) -> int:
        return k if self.group_size is None else self.group_size


@dataclass(frozen=True)
class SourceQuantization:
    kind: str  # BF16_SOURCE, BLOCK_FP8 or INT4
    config: dict | None = None  # the source's quantization_config
    block: tuple[int, int] | None = None  # BLOCK_FP8: the scale block (rows, columns)
    scale_suffix: str = BLOCK_SCALE_SUFFIX  # BLOCK_FP8: the block scale's suffix (after the module)
    scale_dtypes: tuple[str, ...] = BLOCK_SCALE_DTYPES  # BLOCK_FP8: the scale dtypes accepted
    int4: Int4Scheme | None = None


def read_quantization(q) -> SourceQuantization:
    """What the source's quantization_config (None: a BF16 source) describes; QuantizationError."""
    if q is None:
        return SourceQuantization(BF16_SOURCE)
    if not isinstance(q, dict):
        raise QuantizationError(f"quantization_config {q!r} is not an object")
    fp4 = nvfp4_release(q)
    if fp4:
        raise QuantizationError(fp4)
    method = q.get("quant_method")
    if method == "fp8":
        return _deepseek_block_fp8(q)
    if method == CT:
        return _compressed_tensors(q)
    raise QuantizationError(
        f"quant_method {method!r} is not supported; expected block FP8 ('fp8'), compressed-tensors FP8_BLOCK "
        "or pack-quantized INT4, or no quantization_config (BF16)"
    )


def _deepseek_block_fp8(q: dict) -> SourceQuantization:
    fmt, block = q.get("fmt", "e4m3"), q.get("weight_block_size")
    if fmt != "e4m3":
        raise QuantizationError(f"FP8 format {fmt!r} is not supported; expected 'e4m3'")
    return SourceQuantization(BLOCK_FP8, q, _block(block, "weight_block_size"))


def _block(block, what: str) -> tuple[int, int]:
    if (
        not isinstance(block, list)
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise QuantizationError(f"{what} {block!r} is not supported; expected two positive ints like [128, 128]")
    return block[0], block[1]


def _compressed_tensors(q: dict) -> SourceQuantization:
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups or not all(isinstance(g, dict) for g in groups.values()):
        raise QuantizationError(f"compressed-tensors config_groups {str(groups)[:120]} must be a non-empty object")
    kinds = {name: _group_kind(g, q.get("format")) for name, g in groups.items()}
    if all(k == "channel-fp8" for k in kinds.values()) or set(kinds.values()) == {"channel-fp8", INT4}:
        raise QuantizationError(
            "quant_method 'compressed-tensors' with channel-FP8 weights is not supported as a source; expected "
            "FP8_BLOCK or pack-quantized INT4 (this looks like a converted checkpoint)"
        )
    if len(groups) != 1:
        raise QuantizationError(
            f"compressed-tensors config with {len(groups)} groups ({', '.join(f'{n}: {k}' for n, k in kinds.items())}) "
            "is not supported; expected one FP8_BLOCK or one pack-quantized INT4 group"
        )
    (name, group), kind = next(iter(groups.items())), next(iter(kinds.values()))
    if kind == BLOCK_FP8:
        block = _block(group["weights"].get("block_structure"), f"config_groups.{name}.weights.block_structure")
        return SourceQuantization(BLOCK_FP8, q, block, CHANNEL_SCALE_SUFFIX, CT_BLOCK_SCALE_DTYPES)
    if kind == INT4:
        return SourceQuantization(INT4, q, int4=_int4_scheme(name, group))
    raise QuantizationError(f"compressed-tensors group {name!r}: {kind}")


def _group_kind(g: dict, top_format) -> str:
    """BLOCK_FP8, INT4, 'channel-fp8', or a sentence saying what is not supported."""
    w = g.get("weights")
    if not isinstance(w, dict):
        return f"weights {w!r} is not an object"
    fmt = g.get("format") or top_format
    kind = (w.get("type"), w.get("num_bits"), w.get("strategy"))
    if kind == ("float", 8, "block"):
        return BLOCK_FP8
    if kind == ("float", 8, "channel"):
        return "channel-fp8"
    if kind[:2] == ("int", 4) and fmt == PACK_QUANTIZED:
        return INT4
    return (
        f"weights of type {w.get('type')!r}, {w.get('num_bits')!r} bits, strategy {w.get('strategy')!r} "
        f"(format {fmt!r}) are not supported; expected 8-bit float block (FP8_BLOCK) or 4-bit int pack-quantized"
    )


def _int4_scheme(name: str, group: dict) -> Int4Scheme:
    w = group["weights"]
    where = f"compressed-tensors group {name!r}"
    if w.get("strategy") not in ("group", "channel"):
        raise QuantizationError(
            f"{where}: INT4 strategy {w.get('strategy')!r} is not supported; expected group or channel"
        )
    if w.get("actorder") not in (None, False):
        raise QuantizationError(f"{where}: activation ordering (actorder {w['actorder']!r}) is not supported")
    if w.get("dynamic"):
        raise QuantizationError(f"{where}: dynamic INT4 weights are not supported")
    size = w.get("group_size")
    if w["strategy"] == "group" and not (isinstance(size, int) and not isinstance(size, bool) and size > 0):
        raise QuantizationError(f"{where}: group strategy with group_size {size!r}; expected a positive int")
    if group.get("input_activations") not in (None, {}):
        raise QuantizationError(f"{where}: INT4 weights with quantized activations (W4A8) are not supported")
    symmetric = w.get("symmetric", True) is not False
    return Int4Scheme(name, group, size if w["strategy"] == "group" else None, symmetric)
