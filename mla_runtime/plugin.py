"""vLLM general plugin: MLA attention layers take W_UK_T / W_UV from mla-convert's artifacts.

Registration only. Declared in pyproject.toml under `vllm.general_plugins`; vLLM calls `register()`
in every process, possibly more than once. It imports nothing but the standard library,
mla_runtime.envs and mla_runtime.vllm_names (the vLLM names hooked and read), and arranges for the two hooks to run when their modules are imported (or at
once, if they already are), so a process that never builds an MLA model pays nothing:

- upstream.py: vLLM's `MLAAttention.process_weights_after_loading`;
- gaudi.py: vllm-gaudi's `HPUMLAAttention.process_weights_after_loading`, when vllm_gaudi is used.

What the wrapped methods do is absorbed.py; the spot check is spot_check.py; the environment
variables (MLA_RUNTIME_DIR, _DISABLE, _FALLBACK, _VERIFY, _CHECK) are envs.py; the vLLM and
vllm-gaudi versions tested are versions.py.
"""

from __future__ import annotations

import importlib.abc
import logging
import sys
from collections.abc import Callable

from . import envs
from .vllm_names import GAUDI_MODULE, LOGGER, UPSTREAM_MODULE

logger = logging.getLogger(LOGGER)


def register() -> None:
    """vLLM general-plugin entry point. Idempotent and cheap: imports nothing from vLLM, nor torch."""
    if envs.disabled():
        return
    when_imported(UPSTREAM_MODULE, _hook_upstream)
    when_imported(GAUDI_MODULE, _hook_gaudi)


def _hook_upstream(module) -> None:
    from . import upstream

    upstream.hook(module)


def _hook_gaudi(module) -> None:
    from . import gaudi

    gaudi.hook(module)


class _PostImportHooks(importlib.abc.MetaPathFinder):
    """Runs a hook right after a named module has been executed (a post-import hook)."""

    def __init__(self):
        self.hooks: dict[str, Callable] = {}

    def find_spec(self, fullname, path, target=None):
        hook = self.hooks.get(fullname)
        if hook is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _HookedLoader(spec.loader, hook)
        return spec


class _HookedLoader(importlib.abc.Loader):
    def __init__(self, loader, hook: Callable):
        self._loader, self._hook = loader, hook

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _run_hook(self._hook, module)

    def __getattr__(self, name):  # get_source, get_filename, ... of the real loader
        return getattr(self._loader, name)


def _run_hook(hook: Callable, module) -> None:
    """A hook that fails must not break vLLM's own import: one warning, and vLLM computes the weights."""
    try:
        hook(module)
    except Exception as e:
        from . import versions

        logger.warning(
            "mla_runtime: cannot hook %s (%s: %s) in %s (tested: %s); vLLM computes W_UK_T/W_UV itself",
            module.__name__, type(e).__name__, e, versions.describe_vllm(), versions.TESTED_TEXT,
        )  # fmt: skip


def when_imported(module_name: str, hook: Callable) -> None:
    """Call `hook(module)` now if `module_name` is imported, else right after it is imported."""
    module = sys.modules.get(module_name)
    if module is not None:
        _run_hook(hook, module)
        return
    finder = next((f for f in sys.meta_path if isinstance(f, _PostImportHooks)), None)
    if finder is None:
        finder = _PostImportHooks()
        sys.meta_path.insert(0, finder)
    finder.hooks[module_name] = hook


def summary() -> list[dict]:
    """What the plugin did in this process, per artifacts source (for tests and diagnostics)."""
    from . import absorbed

    return absorbed.summary()


def reset() -> None:
    """Forget the per-process serving state (tests): serving.reset(), the one way."""
    from . import serving

    serving.reset()


__all__ = ["register", "reset", "summary", "when_imported"]
