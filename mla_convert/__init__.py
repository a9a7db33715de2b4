"""mla-convert: convert DeepSeek-V3/R1 block-FP8 checkpoints for vLLM on Gaudi, with precomputed MLA weights."""

from mla_convert.version import __version__

__all__ = ["__version__"]
