"""mla_runtime: read precomputed MLA weights (W_UK_T / W_UV) written by mla-convert.

Depends on torch and the standard library only; the vLLM plugin lives in mla_runtime.plugin.
The names that need torch (`open_artifacts`, `split_kv_b_proj`, ...) are imported when first used,
so `mla_runtime.format` and `mla_runtime.safetensors_file` can be imported without torch.
"""

from __future__ import annotations

import importlib

from .format import ArtifactError, MlaDims, MlaManifest, read_manifest

_TORCH_NAMES = {
    "MlaArtifacts": ".artifacts",
    "head_range": ".artifacts",
    "open_artifacts": ".artifacts",
    "split_kv_b_proj": ".layout",
}

__all__ = ["ArtifactError", "MlaDims", "MlaManifest", "read_manifest", *_TORCH_NAMES]


def __getattr__(name: str):
    module = _TORCH_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
