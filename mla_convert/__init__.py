"""mla-convert: convert DeepSeek-V3/R1 block-FP8 checkpoints for vLLM on Gaudi, with precomputed MLA weights."""

__version__ = "0.1.0"
