"""Stand-in for vllm_gaudi/envs.py: the one variable the FP8 weight path reads, evaluated on each
access as the real module's `__getattr__` does."""

import os


def __getattr__(name: str):
    if name == "VLLM_HPU_FORCE_CHANNEL_FP8":
        # On unless set to something else than 1/true, and off whenever INC's QUANT_CONFIG is set.
        on = os.environ.get("VLLM_HPU_FORCE_CHANNEL_FP8", "true").lower() in ("1", "true")
        return on and os.environ.get("QUANT_CONFIG") is None
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
