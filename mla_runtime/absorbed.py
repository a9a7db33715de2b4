"""What the plugin does to one MLA attention layer: after vLLM's own process_weights_after_loading
has stored W_UK_T / W_UV, those tensors take the artifacts' values. Shared by both hooks
(upstream.py for vLLM's MLAAttention, gaudi.py for vllm-gaudi's HPUMLAAttention).

`wrap(cls)` replaces `cls.process_weights_after_loading` with a wrapper that

1. runs the original method, whatever it does and however it computes the weights (module-level
   `split_kv_b_proj` in vLLM 0.32 and 0.33, a processing policy in later vLLM, vllm-gaudi's own
   dequant): the plugin depends only on what it leaves on the layer;
2. steps aside when the layer holds no W_UK_T / W_UV tensors (AMX_MLA and ROCm aiter pack their
   own) or derives more from them inside vLLM's method (DCP's W_UK_T_dcp_qrep, and from vLLM 0.34
   W_UV_dcp, an all-gather over the DCP ranks that the A2A combine applies instead of W_UV: the
   plugin would have to join that collective on every rank alike), saying so once;
3. reads this rank's heads of the layer's artifacts, spot-checks them against the served
   kv_b_proj (spot_check.py), and puts their values into the tensors vLLM stored, keeping their
   registration (parameter or attribute), shape, dtype, device and strides. It copies in place, as
   vLLM does on a reload (CUDA and HPU graphs may hold those tensors), unless what vLLM stored
   shares storage with kv_b_proj itself (vLLM 0.32/0.33 with an unquantized kv_b_proj in the
   activation dtype: W_UK_T / W_UV are views of its weight). Then the layer keeps vLLM's views when
   their values already are the artifacts' (a bf16 conversion), and otherwise gets new storage laid
   out as those views, so kv_b_proj is never written.

A layer's second call in one process (vLLM's weight reload runs post-load processing again) is
left to vLLM: the new weights are used, not the artifacts, which were computed for the first ones;
one INFO line says so. When vllm-gaudi's method calls upstream's (both wrapped), the outer wrapper
alone acts.

What the plugin learns in a process (each served model's artifacts, each layer's first call, the
lines said once) is serving.py's, one owner reset in one way.

Errors: an ArtifactError (artifacts missing, corrupt, for another checkpoint) fails the start with
a message naming the layer and file, or with MLA_RUNTIME_FALLBACK=1 is one warning and vLLM's
values stay. Any other exception in the plugin's own code is one warning naming the vLLM version,
and vLLM's values stay: the plugin never breaks a start through its own fault.
"""

from __future__ import annotations

import functools
import importlib
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import envs, hub_cache, serving, versions, vllm_names
from .artifacts import MlaArtifacts, open_artifacts
from .format import MLA_DIR_NAME, ArtifactError, layer_index_of_attention
from .spot_check import spot_check

logger = logging.getLogger(vllm_names.LOGGER)

NAMES = ("W_UK_T", "W_UV")
WRAPPED = "__mla_runtime_wrapped__"


def wrap(cls: type) -> bool:
    """Wrap `cls.process_weights_after_loading` (once: False if it already is)."""
    original = cls.process_weights_after_loading
    if getattr(original, WRAPPED, False):
        return False

    @functools.wraps(original)
    def process_weights_after_loading(self, *args, **kwargs):
        return _run(self, original, args, kwargs)

    setattr(process_weights_after_loading, WRAPPED, True)
    cls.process_weights_after_loading = process_weights_after_loading
    return True


# --------------------------------------------------------------------------- one call


def _run(layer, original, args, kwargs):
    if envs.disabled():
        return original(layer, *args, **kwargs)
    state = serving.current()
    key = id(layer)
    if key in state.active:  # the outer wrapper acts for this layer
        return original(layer, *args, **kwargs)
    first = state.first_call(layer)
    state.active.add(key)
    try:
        result = original(layer, *args, **kwargs)
    finally:
        state.active.discard(key)
    if first is not None:
        _reloaded(layer, *first)
    else:
        state.remember(layer, _take_over(layer))
    return result


def say_once(key: str, level: int, message: str, *args, **kwargs) -> None:
    said = serving.current().said
    if key not in said:
        said.add(key)
        logger.log(level, message, *args, **kwargs)


def _take_over(layer) -> tuple[_Source | None, str]:
    source = None
    try:
        source = _source_for(layer)
        if source is None:
            return None, "none"
        return source, source.take_over(layer)
    except ArtifactError:
        raise
    except Exception as e:  # the plugin's own fault: vLLM's values stay
        say_once(
            "fault", logging.WARNING,
            "mla_runtime: %s: %s: %s, with %s (tested: %s); vLLM's own W_UK_T/W_UV are used",
            _name(layer), type(e).__name__, e, versions.describe_vllm(), versions.TESTED_TEXT, exc_info=True,
        )  # fmt: skip
        if source is not None:
            source.record(layer, "fault")
        return source, "fault"


def _reloaded(layer, source: _Source | None, outcome: str) -> None:
    if source is None or outcome != "loaded":
        return
    source.reloads += 1
    say_once(
        "reload", logging.INFO,
        "mla_runtime: weights reloaded into the running engine (%s first): W_UK_T/W_UV are vLLM's, computed "
        "from the new kv_b_proj; the artifacts in %s, computed for the weights first loaded, are not put back",
        _name(layer), source.where,
    )  # fmt: skip


def _name(layer) -> str:
    return str(getattr(layer, "layer_name", "") or type(layer).__name__)


# --------------------------------------------------------------------------- placing the values


def _storage_key(t: torch.Tensor):
    if t.device.type == "meta" or t.numel() == 0:
        return None
    return t.device, t.untyped_storage().data_ptr()


def _shares_storage(layer, current: list[torch.Tensor]) -> bool:
    """Whether what vLLM stored shares storage with another tensor of the layer (kv_b_proj's weight)."""
    mine = {_storage_key(t) for t in current} - {None}
    if not mine:
        return False
    ours = {id(t) for t in current}
    others = [*layer.parameters(), *layer.buffers()]
    kv_b_proj = getattr(layer, "kv_b_proj", None)
    if isinstance(kv_b_proj, torch.nn.Module):
        others += [*kv_b_proj.parameters(), *kv_b_proj.buffers()]
    return any(id(o) not in ours and _storage_key(o) in mine for o in others)


def _laid_out_like(current: list[torch.Tensor]) -> list[torch.Tensor]:
    """New tensors with the shapes and strides of `current`, views of one new buffer per storage
    they share (so two views of one buffer stay two views of one buffer, at the same distance)."""
    groups: dict = {}
    for i, t in enumerate(current):
        groups.setdefault((_storage_key(t), t.dtype), []).append(i)
    out: list[torch.Tensor | None] = [None] * len(current)
    for members in groups.values():
        ts = [current[i] for i in members]
        start = min(t.storage_offset() for t in ts)
        end = max(
            t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) + 1 for t in ts
        )
        buf = torch.empty(end - start, dtype=ts[0].dtype, device=ts[0].device)
        for i, t in zip(members, ts, strict=True):
            out[i] = buf.as_strided(t.shape, t.stride(), t.storage_offset() - start)
    return out  # type: ignore[return-value]


def place(layer, values: list[torch.Tensor]) -> str:
    """Put `values` (W_UK_T, W_UV) into the tensors the layer holds under NAMES (module docstring).

    Returns how: "in place", "equal" (vLLM's views already hold them) or "new storage"."""
    current = [getattr(layer, n) for n in NAMES]
    with torch.no_grad():
        if not _shares_storage(layer, current):
            for t, v in zip(current, values, strict=True):
                t.copy_(v)
            return "in place"
        wanted = [v.to(device=t.device, dtype=t.dtype) for t, v in zip(current, values, strict=True)]
        if all(torch.equal(t, w) for t, w in zip(current, wanted, strict=True)):
            return "equal"
        fresh = _laid_out_like(current)
        for f, w in zip(fresh, wanted, strict=True):
            f.copy_(w)
        if not all(torch.equal(f, w) for f, w in zip(fresh, wanted, strict=True)):  # overlapping views
            raise RuntimeError("W_UK_T and W_UV overlap in storage; cannot lay new values out like them")
        for name, t, f in zip(NAMES, current, fresh, strict=True):
            if isinstance(t, torch.nn.Parameter):
                t.data = f  # the same Parameter object stays registered
            else:
                setattr(layer, name, f)
    return "new storage"


# --------------------------------------------------------------------------- one served model's artifacts


@dataclass
class _Source:
    """Where one process's artifacts are, opened on first use, and what happened to each layer."""

    where: Path
    model_dir: Path | None
    model_config: dict | None
    fallback: bool
    check: bool
    artifacts: MlaArtifacts | None = None
    error: ArtifactError | None = None
    opened: bool = False
    outcomes: dict[str, str] = field(default_factory=dict)  # layer name -> loaded | fallback | not-used | fault
    seconds: float = 0.0
    spot_checked: int = 0
    bound_use: float = 0.0  # the largest share of the spot check's allowance used
    placed: dict[str, int] = field(default_factory=dict)  # "in place" / "equal" / "new storage" -> layers
    reloads: int = 0
    tp: tuple[int, int] = (0, 1)
    expected: int | None = None
    logged: bool = False

    def open(self) -> MlaArtifacts:
        if not self.opened:
            self.opened = True
            try:
                self.artifacts = open_artifacts(self.where, model_dir=self.model_dir, model_config=self.model_config)
            except ArtifactError as e:
                self.error = e
        if self.error is not None:
            raise self.error
        assert self.artifacts is not None
        return self.artifacts

    def take_over(self, layer) -> str:
        current = [getattr(layer, n, None) for n in NAMES]
        if not all(isinstance(t, torch.Tensor) for t in current):
            impl = type(getattr(layer, "impl", None)).__name__
            return self.step_aside(layer, f"the attention backend ({impl}) keeps no W_UK_T/W_UV: it computes its own")
        if getattr(layer, "W_UK_T_dcp_qrep", None) is not None:
            return self.step_aside(layer, "DCP query replication gathers W_UK_T_dcp_qrep from vLLM's own W_UK_T")
        if getattr(layer, "W_UV_dcp", None) is not None:
            return self.step_aside(
                layer, "DCP's all-to-all combine applies W_UV_dcp, gathered from vLLM's own W_UV of every DCP rank"
            )
        t0 = time.perf_counter()
        try:
            values = self.fetch(layer)
            shapes = [tuple(t.shape) for t in current]
            if [tuple(v.shape) for v in values] != shapes:
                return self.step_aside(
                    layer, f"vLLM stores W_UK_T/W_UV with shapes {shapes}, a layout this plugin does not know",
                    level=logging.WARNING,
                )  # fmt: skip
            how = place(layer, values)
            self.placed[how] = self.placed.get(how, 0) + 1
        except ArtifactError as e:
            if not self.fallback:
                raise
            say_once(
                "fallback", logging.WARNING, "mla_runtime: %s; %s=1: vLLM's own W_UK_T/W_UV are used where the "
                "artifacts fail", e, envs.FALLBACK,
            )  # fmt: skip
            return self.record(layer, "fallback")
        finally:
            self.seconds += time.perf_counter() - t0
        return self.record(layer, "loaded")

    def step_aside(self, layer, why: str, level: int = logging.INFO) -> str:
        say_once(f"aside:{why}", level, "mla_runtime: %s: %s; the artifacts are not used there", _name(layer), why)
        return self.record(layer, "not-used")

    def fetch(self, layer) -> list[torch.Tensor]:
        """This rank's W_UK_T / W_UV of `layer` from the artifacts (bf16, on the CPU), spot-checked."""
        arts = self.open()
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
        w_uk_t, w_uv = arts.load_layer(index, tp_rank=tp_rank, tp_size=tp_size, device="cpu", dtype=torch.bfloat16)
        if self.check:
            checked = spot_check(layer.kv_b_proj, w_uk_t, w_uv, where=f"layer {index} ({arts.layer_path(index)})")
            if checked is not None:
                self.spot_checked += 1
                self.bound_use = max(self.bound_use, checked.bound_use)
        return [w_uk_t, w_uv]

    def record(self, layer, outcome: str) -> str:
        self.outcomes[getattr(layer, "layer_name", str(id(layer)))] = outcome
        if self.expected is None:
            self.expected = _count_mla_layers(layer)
        if self.expected is None:  # layer count unknown (not built by vLLM): no single final line
            logger.debug("%s", self.summary_line())
        elif not self.logged and len(self.outcomes) >= self.expected:
            self.logged = True
            logger.info("%s", self.summary_line())
        return outcome

    def summary(self) -> dict:
        kinds = ("loaded", "fallback", "not-used", "fault")
        counts = {k: sum(1 for v in self.outcomes.values() if v == k) for k in kinds}
        return {
            "where": str(self.where), "layers": len(self.outcomes), **counts, "seconds": self.seconds,
            "spot_checked": self.spot_checked, "bound_use": self.bound_use, "placed": dict(self.placed),
            "reloads": self.reloads, "tp_rank": self.tp[0], "tp_size": self.tp[1],
        }  # fmt: skip

    def summary_line(self) -> str:
        s = self.summary()
        line = (
            f"mla_runtime: loaded W_UK_T/W_UV of {s['loaded']}/{s['layers']} MLA layers from {s['where']} "
            f"(TP rank {s['tp_rank']} of {s['tp_size']}; {s['spot_checked']} spot-checked against kv_b_proj) "
            f"in {s['seconds']:.3f} s"
        )
        if s["fallback"]:
            line += f"; {s['fallback']} computed by vLLM ({envs.FALLBACK}=1)"
        if s["not-used"]:
            line += f"; {s['not-used']} computed by the attention backend itself (artifacts not used)"
        if s["fault"]:
            line += f"; {s['fault']} left to vLLM after an error of this plugin"
        return line


def _vllm_config_of(layer):
    cfg = getattr(layer, "_vllm_config", None)
    if cfg is None and vllm_names.CONFIG_MODULE in sys.modules:
        getter = getattr(sys.modules[vllm_names.CONFIG_MODULE], vllm_names.CONFIG_GETTER, None)
        cfg = getter() if getter else None
    return cfg


def _served_model_dir(layer) -> Path | None:
    model = getattr(getattr(_vllm_config_of(layer), "model_config", None), "model", None)
    if model and Path(str(model)).is_dir():
        return Path(str(model))
    return None


def _source_for(layer) -> _Source | None:
    """Where the artifacts of the model `layer` belongs to are (resolved once per process and model)."""
    model_dir = _served_model_dir(layer)
    env_dir = envs.artifacts_dir()
    key = f"{env_dir}|{model_dir}"
    sources = serving.current().sources
    if key in sources:
        return sources[key]
    # the cache snapshot served (by path, or by Hub id), and whether vLLM's download left out its mla/
    snapshot = hub_cache.snapshot_at(model_dir) if model_dir is not None else None
    if model_dir is None and not env_dir:
        snapshot = _cached_snapshot(layer)
    left_out = snapshot is not None and hub_cache.lacks_artifacts(snapshot.path)
    if env_dir:
        where = env_dir
    elif model_dir is not None and (model_dir / MLA_DIR_NAME).is_dir() and not left_out:
        where = model_dir / MLA_DIR_NAME
    elif model_dir is None and snapshot is not None and not left_out:  # a Hub id, from the local cache
        where = snapshot.path / MLA_DIR_NAME
    else:
        _say_no_artifacts(model_dir, snapshot if left_out else None)
        sources[key] = None
        return None
    config = None
    if model_dir is None:  # served from a hub id: validate against vLLM's view of the config
        hf = getattr(getattr(_vllm_config_of(layer), "model_config", None), "hf_config", None)
        config = hf.to_dict() if hf is not None and hasattr(hf, "to_dict") else None
    sources[key] = _Source(where, model_dir, config, fallback=envs.fallback(), check=envs.spot_check())
    return sources[key]


def _cached_snapshot(layer) -> hub_cache.Snapshot | None:
    """The local cache's snapshot of the Hub id vLLM serves, if it is one and is cached."""
    model_config = getattr(_vllm_config_of(layer), "model_config", None)
    model = getattr(model_config, "model", None)
    if not isinstance(model, str):
        return None
    revision = getattr(model_config, "revision", None)
    return hub_cache.snapshot_of(model, revision if isinstance(revision, str) else None)


def _say_no_artifacts(model_dir: Path | None, left_out: hub_cache.Snapshot | None) -> None:
    """`left_out`: the cache snapshot whose mla/ vLLM's download left out (the line names the command)."""
    if left_out is not None:
        snapshot = left_out
        logger.info(
            "mla_runtime: no %s/ in %s: vLLM downloads only the weights the index (or a params.json model's consolidated shards) "
            "of %s names, so an mla-convert output's artifacts are not there; fetch them with `%s` and restart (or "
            "set %s); vLLM computes W_UK_T/W_UV itself",
            MLA_DIR_NAME, snapshot.path, snapshot.repo_id, snapshot.fetch_command(), envs.DIR,
        )  # fmt: skip
        return
    logger.info(
        "mla_runtime: no MLA artifacts for %s (no %s/ directory, %s unset); vLLM computes W_UK_T/W_UV itself",
        model_dir or "the served model", MLA_DIR_NAME, envs.DIR,
    )  # fmt: skip


def _tp_rank_size() -> tuple[int, int]:
    """This process's tensor-parallel rank and size (0, 1 when vLLM's TP group is not set up)."""
    try:
        distributed = importlib.import_module(vllm_names.DISTRIBUTED_MODULE)
        rank = getattr(distributed, vllm_names.TP_RANK_GETTER)()
        size = getattr(distributed, vllm_names.TP_SIZE_GETTER)()
        return int(rank), int(size)
    except (ImportError, AssertionError, AttributeError):
        return 0, 1


def _count_mla_layers(layer) -> int | None:
    """MLA layers this process builds whose class the plugin hooked (vLLM's static forward context),
    or None when unknown. Others (an MLA module of a model's own that is no MLAAttention) are
    named once: vLLM computes their weights."""
    ctx = getattr(getattr(_vllm_config_of(layer), "compilation_config", None), "static_forward_context", None)
    if not ctx:
        return None
    mla = [m for m in ctx.values() if hasattr(m, "kv_b_proj") and hasattr(m, "kv_lora_rank")]
    hooked = [m for m in mla if getattr(getattr(type(m), vllm_names.HOOKED_METHOD, None), WRAPPED, False)]
    others = sorted({type(m).__name__ for m in mla} - {type(m).__name__ for m in hooked})
    if others:
        say_once(
            "unhooked", logging.INFO,
            "mla_runtime: %d MLA layers of %s do not run the hooked %s.%s: vLLM computes their W_UK_T/W_UV and the "
            "artifacts are not used there", len(mla) - len(hooked), ", ".join(others), vllm_names.UPSTREAM_CLASS,
            vllm_names.HOOKED_METHOD,
        )  # fmt: skip
    return len(hooked)


def summary() -> list[dict]:
    """What the plugin did in this process, per artifacts source (for tests and diagnostics)."""
    return [s.summary() for s in serving.current().sources.values() if s is not None]
