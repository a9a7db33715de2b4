"""vLLM general plugin: MLA attention layers take W_UK_T / W_UV from mla-convert's artifacts.

Declared in pyproject.toml under `vllm.general_plugins`; vLLM calls `register()` in every process,
possibly more than once. `register()` arranges for two methods to be wrapped (idempotently) when their modules are imported:

- upstream `MLAAttention.process_weights_after_loading` (vllm/model_executor/layers/attention/
  mla_attention.py): for the duration of the call, the module-level `split_kv_b_proj` it uses to
  dequantize and split kv_b_proj is replaced, for this layer only, by a read of the artifacts.
  Everything else the method does (backend weight packing, aiter/DCP variants, default quant
  scales, `replace_parameter`) runs unchanged on the artifact tensors.
- vllm-gaudi's `HPUMLAAttention.process_weights_after_loading`, when `vllm_gaudi` is installed:
  for an FP8 kv_b_proj with `weight_scale_inv` (the branch where vllm-gaudi dequantizes and splits
  itself) the wrapper sets W_UK_T / W_UV from the artifacts as that branch keeps its own (plain,
  contiguous attributes on kv_b_proj's device), and keeps the rest of the branch (default quant
  scales). Any other kv_b_proj goes to the original method, which calls the (wrapped) upstream
  method and re-registers contiguous copies.

Where the artifacts are: $MLA_RUNTIME_DIR, else `<served model dir>/mla` when it exists. Other
environment variables: MLA_RUNTIME_DISABLE=1 (do nothing), MLA_RUNTIME_FALLBACK=1 (on a mismatch,
warn and let vLLM recompute instead of failing), MLA_RUNTIME_VERIFY=sha256 (hash each layer file
before use), MLA_RUNTIME_CHECK=0 (skip the per-layer spot check against the served kv_b_proj,
spot_check.py).

One INFO line per process, starting with `mla_runtime:`, says how many layers were loaded from
where and how long it took. Imports only torch and the standard library (and vLLM's own modules,
which are already loaded when vLLM calls the plugin).
"""

from __future__ import annotations

import functools
import importlib.abc
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import envs
from .artifacts import MlaArtifacts, open_artifacts
from .format import MLA_DIR_NAME, ArtifactError, layer_index_of_attention
from .spot_check import spot_check

# A child of vLLM's logger, so the line goes wherever vLLM's own log lines go.
logger = logging.getLogger("vllm.mla_runtime")

ENV_DIR, ENV_FALLBACK = envs.DIR, envs.FALLBACK  # named in messages

UPSTREAM_MODULE = "vllm.model_executor.layers.attention.mla_attention"
GAUDI_MODULE = "vllm_gaudi.attention.oot_mla"
_WRAPPED = "__mla_runtime_wrapped__"


# --------------------------------------------------------------------------- registration


def register() -> None:
    """vLLM general-plugin entry point. Idempotent and cheap: imports nothing from vLLM.

    The two attention modules are wrapped as soon as they are imported (or now, if they already
    are), so a process that never builds an MLA model pays nothing.
    """
    if envs.disabled():
        return
    when_imported(UPSTREAM_MODULE, lambda mod: wrap_upstream(mod.MLAAttention, mod))
    when_imported(GAUDI_MODULE, lambda mod: wrap_gaudi(mod.HPUMLAAttention))


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
    """A hook that fails (say, a vLLM whose classes moved) must not break vLLM's own import."""
    try:
        hook(module)
    except Exception as e:
        logger.warning(
            "mla_runtime: cannot hook %s (%s: %s); vLLM computes W_UK_T/W_UV itself",
            module.__name__, type(e).__name__, e,
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


def wrap_upstream(cls: type, mla_mod) -> bool:
    """Wrap upstream MLAAttention.process_weights_after_loading (see the module docstring)."""
    original = cls.__dict__.get("process_weights_after_loading")
    if original is None or getattr(original, _WRAPPED, False):
        return False

    @functools.wraps(original)
    def process_weights_after_loading(self, act_dtype: torch.dtype):
        source = _source_for(self)
        if source is None:
            return original(self, act_dtype)
        real_split = mla_mod.split_kv_b_proj
        outcome: list[str] = []

        def split_from_artifacts(kv_b_proj, out_dtype, kv_lora_rank, num_heads, qk_nope_head_dim, v_head_dim):
            if kv_b_proj is not self.kv_b_proj:  # not this layer's call: leave it alone
                return real_split(kv_b_proj, out_dtype, kv_lora_rank, num_heads, qk_nope_head_dim, v_head_dim)
            w_uk_t, w_uv = source.fetch(self, out_dtype)
            if w_uk_t is None:  # fallback allowed and taken
                outcome.append("fallback")
                return real_split(kv_b_proj, out_dtype, kv_lora_rank, num_heads, qk_nope_head_dim, v_head_dim)
            outcome.append("loaded")
            # The caller turns these back with .permute(1, 2, 0) / .transpose(0, 1): the layer ends up
            # holding exactly the contiguous artifact tensors.
            return w_uk_t.permute(2, 0, 1), w_uv.transpose(0, 1)

        mla_mod.split_kv_b_proj = split_from_artifacts
        try:
            result = original(self, act_dtype)
        finally:
            mla_mod.split_kv_b_proj = real_split
        source.done(self, outcome[0] if outcome else "not-used")
        return result

    setattr(process_weights_after_loading, _WRAPPED, True)
    cls.process_weights_after_loading = process_weights_after_loading
    return True


def wrap_gaudi(cls: type) -> bool:
    """Wrap vllm-gaudi's HPUMLAAttention.process_weights_after_loading (see the module docstring)."""
    original = cls.__dict__.get("process_weights_after_loading")
    if original is None or getattr(original, _WRAPPED, False):
        return False

    @functools.wraps(original)
    def process_weights_after_loading(self, act_dtype: torch.dtype):
        kv_b_proj = self.kv_b_proj
        if not (
            kv_b_proj.weight.dtype == torch.float8_e4m3fn and getattr(kv_b_proj, "weight_scale_inv", None) is not None
        ):
            # vllm-gaudi hands this case to MLAAttention.process_weights_after_loading (wrapped above).
            return original(self, act_dtype)
        source = _source_for(self)
        if source is None:
            return original(self, act_dtype)
        w_uk_t, w_uv = source.fetch(self, act_dtype)
        if w_uk_t is None:
            result = original(self, act_dtype)
            source.done(self, "fallback")
            return result
        # What vllm-gaudi's FP8 branch does after its split: plain attributes, contiguous, on the
        # device of the layer's weights (fetch put them there), then the default quant scales.
        self.W_UV = w_uv.contiguous()
        self.W_UK_T = w_uk_t.contiguous()
        from vllm.model_executor.layers.attention.attention import (
            set_default_quant_scales,
            should_load_quant_weights,
        )

        quant_method = self.quant_config.get_quant_method(self, prefix=self.layer_name) if self.quant_config else None
        if not should_load_quant_weights(quant_method):
            set_default_quant_scales(self, register_buffer=False)
        source.done(self, "loaded")

    setattr(process_weights_after_loading, _WRAPPED, True)
    cls.process_weights_after_loading = process_weights_after_loading
    return True


# --------------------------------------------------------------------------- per-process state


@dataclass
class _Source:
    """The artifacts one process serves from, and what happened to each layer."""

    artifacts: MlaArtifacts | None
    where: str
    fallback: bool
    check: bool
    error: ArtifactError | None = None  # opening failed, fallback allowed
    outcomes: dict[str, str] = field(default_factory=dict)  # layer name -> loaded | fallback | not-used
    seconds: float = 0.0
    spot_checked: int = 0
    bound_use: float = 0.0  # the largest share of the spot check's allowance used
    tp: tuple[int, int] = (0, 1)
    expected: int | None = None
    logged: bool = False
    warned: bool = False

    def fetch(self, layer, dtype: torch.dtype) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(W_UK_T, W_UV) for `layer` on its kv_b_proj's device in `dtype`, or (None, None) to fall back."""
        t0 = time.perf_counter()
        try:
            if self.error is not None:
                raise self.error
            result = self._fetch(layer, dtype)
        except ArtifactError as e:
            if not self.fallback:
                raise
            if not self.warned:  # once per process, not once per layer
                self.warned = True
                logger.warning(
                    "mla_runtime: %s; %s=1: vLLM recomputes W_UK_T/W_UV where the artifacts fail", e, ENV_FALLBACK
                )
            return None, None
        finally:
            self.seconds += time.perf_counter() - t0
        return result

    def _fetch(self, layer, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        arts = self.artifacts
        assert arts is not None
        name = getattr(layer, "layer_name", "")
        index = layer_index_of_attention(name)
        if index is None:
            raise ArtifactError(f"attention layer {name!r}: cannot tell its decoder layer index from its name")
        tp_rank, tp_size = _tp_rank_size()
        self.tp = (tp_rank, tp_size)
        arts.check_served_dims(
            layer=index, num_heads=int(layer.num_heads), tp_size=tp_size, qk_nope_head_dim=int(layer.qk_nope_head_dim),
            v_head_dim=int(layer.v_head_dim), kv_lora_rank=int(layer.kv_lora_rank),
        )  # fmt: skip
        device = layer.kv_b_proj.weight.device
        w_uk_t, w_uv = arts.load_layer(index, tp_rank=tp_rank, tp_size=tp_size, device=device, dtype=dtype)
        if self.check:
            checked = spot_check(layer.kv_b_proj, w_uk_t, w_uv, where=f"layer {index} ({arts.layer_path(index)})")
            if checked is not None:
                self.spot_checked += 1
                self.bound_use = max(self.bound_use, checked.bound_use)
        return w_uk_t, w_uv

    def done(self, layer, outcome: str) -> None:
        self.outcomes[getattr(layer, "layer_name", str(id(layer)))] = outcome
        if self.expected is None:
            self.expected = _count_mla_layers(layer)
        if self.expected is None:  # layer count unknown (not built by vLLM): no single final line
            logger.debug("%s", self.summary_line())
        elif not self.logged and len(self.outcomes) >= self.expected:
            self.logged = True
            logger.info("%s", self.summary_line())

    def summary(self) -> dict:
        counts = {k: sum(1 for v in self.outcomes.values() if v == k) for k in ("loaded", "fallback", "not-used")}
        return {
            "where": self.where, "layers": len(self.outcomes), **counts, "seconds": self.seconds,
            "spot_checked": self.spot_checked, "bound_use": self.bound_use, "tp_rank": self.tp[0],
            "tp_size": self.tp[1],
        }  # fmt: skip

    def summary_line(self) -> str:
        s = self.summary()
        line = (
            f"mla_runtime: loaded W_UK_T/W_UV of {s['loaded']}/{s['layers']} MLA layers from {s['where']} "
            f"(TP rank {s['tp_rank']} of {s['tp_size']}; {s['spot_checked']} spot-checked against kv_b_proj) "
            f"in {s['seconds']:.3f} s"
        )
        if s["fallback"]:
            line += f"; {s['fallback']} recomputed by vLLM ({ENV_FALLBACK}=1)"
        if s["not-used"]:
            line += f"; {s['not-used']} computed by the attention backend itself (artifacts not used)"
        return line


_sources: dict[str, _Source | None] = {}  # served model (or $MLA_RUNTIME_DIR) -> source; None: no artifacts


def _vllm_config_of(layer):
    cfg = getattr(layer, "_vllm_config", None)
    if cfg is None and "vllm.config" in sys.modules:
        getter = getattr(sys.modules["vllm.config"], "get_current_vllm_config_or_none", None)
        cfg = getter() if getter else None
    return cfg


def _served_model_dir(layer) -> Path | None:
    cfg = _vllm_config_of(layer)
    model = getattr(getattr(cfg, "model_config", None), "model", None)
    if model and Path(str(model)).is_dir():
        return Path(str(model))
    return None


def _source_for(layer) -> _Source | None:
    """The artifacts for the model `layer` belongs to, opened and validated once per process."""
    if envs.disabled():
        return None
    model_dir = _served_model_dir(layer)
    env_dir = envs.artifacts_dir()
    key = f"{env_dir}|{model_dir}"
    if key in _sources:
        return _sources[key]
    fallback = envs.fallback()
    if env_dir:
        artifacts_dir = env_dir
    elif model_dir is not None and (model_dir / MLA_DIR_NAME).is_dir():
        artifacts_dir = model_dir / MLA_DIR_NAME
    else:
        logger.info(
            "mla_runtime: no MLA artifacts for %s (no %s/ directory, %s unset); vLLM computes W_UK_T/W_UV itself",
            model_dir or "the served model",
            MLA_DIR_NAME,
            ENV_DIR,
        )
        _sources[key] = None
        return None
    source = _Source(None, str(artifacts_dir), fallback=fallback, check=envs.spot_check())
    try:
        config = None
        if model_dir is None:  # served from a hub id: validate against vLLM's view of the config
            hf = getattr(getattr(_vllm_config_of(layer), "model_config", None), "hf_config", None)
            config = hf.to_dict() if hf is not None and hasattr(hf, "to_dict") else None
        source.artifacts = open_artifacts(artifacts_dir, model_dir=model_dir, model_config=config)
    except ArtifactError as e:
        if not fallback:
            raise
        source.error = e
    _sources[key] = source
    return source


def _tp_rank_size() -> tuple[int, int]:
    """This process's tensor-parallel rank and size (0, 1 when vLLM's TP group is not set up)."""
    try:
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        return int(get_tensor_model_parallel_rank()), int(get_tensor_model_parallel_world_size())
    except (ImportError, AssertionError, AttributeError):
        return 0, 1


def _count_mla_layers(layer) -> int | None:
    """MLA layers this process builds (vLLM's static forward context), or None when unknown."""
    cfg = _vllm_config_of(layer)
    ctx = getattr(getattr(cfg, "compilation_config", None), "static_forward_context", None)
    if not ctx:
        return None
    return sum(1 for m in ctx.values() if hasattr(m, "kv_b_proj") and hasattr(m, "kv_lora_rank"))


def summary() -> list[dict]:
    """What the plugin did in this process, per artifacts source (for tests and diagnostics)."""
    return [s.summary() for s in _sources.values() if s is not None]


def reset() -> None:
    """Forget the per-process state (tests)."""
    _sources.clear()


__all__ = ["register", "reset", "spot_check", "summary", "wrap_gaudi", "wrap_upstream"]
