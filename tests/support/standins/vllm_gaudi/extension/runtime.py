"""Stand-in for vllm_gaudi/extension/runtime.py, with the `Config` of extension/config.py and the
`scale_adjustment` feature of extension/features.py.

`get_config()` builds the process-global runtime config on first use and returns the same object
until `clear_config()`. Of the features only `scale_adjustment` is stood in: default True,
overridden by $VLLM_SCALE_ADJUSTMENT (parsed as the real `boolean`). As with the real `Config`,
assigning an attribute on the returned object (what HPUCompressedTensorsConfig does with
`scale_adjustment`) shadows the computed value on that object only: `clear_config()` forgets it.
"""

from __future__ import annotations

import os

_runtime_config: Config | None = None


def boolean(text: str) -> bool:
    return text.lower() in ("true", "t", "1", "yes", "y", "on")


class Config:
    def __init__(self, values: dict):
        self._data = dict(values)

    def __getattr__(self, key: str):  # only for names not set on the object itself
        if key.startswith("__") or key == "_data":
            raise AttributeError(key)
        assert key in self._data, f"Unknown run-time configuration parameter: {key}!"
        return self._data[key]

    def finalize(self) -> None:
        pass  # every stood-in value is computed when the config is built


def _features() -> dict:
    env = os.environ.get("VLLM_SCALE_ADJUSTMENT")
    return {"scale_adjustment": True if env is None else boolean(env)}


def get_config() -> Config:
    global _runtime_config
    if _runtime_config is None:
        _runtime_config = Config(_features())
    return _runtime_config


def finalize_config() -> Config:
    config = get_config()
    config.finalize()
    return config


def clear_config() -> None:
    global _runtime_config
    _runtime_config = None
