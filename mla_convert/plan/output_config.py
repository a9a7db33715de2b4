"""The converted model's config (config.json, or a member's own params.json), in the source's shape,
with the quantization_config the output format writes (formats.Format.quantization_config: none,
or compressed-tensors, next to an INT4 source's group it keeps) where the source had its own."""

from __future__ import annotations

from mla_convert.formats import Format
from mla_convert.source.model_config import ModelConfig
from mla_convert.source.quantization import Int4Scheme


def output_config(model: ModelConfig, fmt: Format, ignore: list[str], int4: Int4Scheme | None = None,
                  int4_targets: list[str] | None = None) -> dict:  # fmt: skip
    """The source's config (architectures, model_type, auto_map, nesting and all) with the source's
    own quantization_config replaced where it was by the format's (`int4`: the source's INT4
    group, kept by a format that copies INT4 weights)."""
    kept = int4 if fmt.int4 is None else None
    return model.output(fmt.quantization_config(ignore, kept, int4_targets))
