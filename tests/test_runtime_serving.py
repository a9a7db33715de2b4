"""The plugin's per-process state has one owner (mla_runtime.serving) and one reset: no module of
mla_runtime keeps a cache of its own, and plugin.reset() forgets what serving learnt, so a layer's
next call is a first call again."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
import torch

from mla_runtime import envs, plugin, serving
from mla_runtime.format import MlaDims
from support.artifacts import read_artifacts, write_artifacts

RUNTIME = Path(__file__).resolve().parent.parent / "mla_runtime"
_EMPTY_CONTAINERS = {"dict", "set", "list", "WeakKeyDictionary", "WeakValueDictionary", "WeakSet", "defaultdict"}


def _is_cache(value: ast.expr | None) -> bool:
    """An empty container made at import: what a module-level cache starts as."""
    if isinstance(value, ast.Dict | ast.Set | ast.List):
        return not (getattr(value, "keys", None) or getattr(value, "elts", None))
    if isinstance(value, ast.Call):
        name = value.func.attr if isinstance(value.func, ast.Attribute) else getattr(value.func, "id", "")
        return name in _EMPTY_CONTAINERS and not value.args
    return False


def test_no_runtime_module_keeps_state_of_its_own():
    found = []
    for path in sorted(RUNTIME.glob("*.py")):
        tree = ast.parse(path.read_text())
        found += [f"{path.name}: global" for node in ast.walk(tree) if isinstance(node, ast.Global)]
        for node in tree.body:
            if isinstance(node, ast.Assign | ast.AnnAssign) and _is_cache(node.value):
                found.append(f"{path.name}:{node.lineno}")
    assert found == []
    owners = [n for n in ast.parse((RUNTIME / "serving.py").read_text()).body if isinstance(n, ast.Assign)]
    assert [ast.unparse(n) for n in owners] == ["_STATE = ServingState()"]


@pytest.mark.parametrize("vllm_codebase", ["vllm 0.34.0"])
def test_reset_forgets_what_the_process_learnt(vllm_standin, tmp_path, monkeypatch):
    for var in envs.ALL:
        monkeypatch.delenv(var, raising=False)
    plugin.reset()
    plugin.register()
    engine = importlib.import_module("mla_engine")
    dims = MlaDims(num_heads=4, qk_nope_head_dim=128, v_head_dim=128, kv_lora_rank=512)
    exact = engine.random_kv_b(2, *dims.kv_b_shape())
    write_artifacts(tmp_path / "mla", exact, dims)
    layers = engine.build_and_load(vllm_standin, tmp_path, {i: x * (1 + 2**-9) for i, x in exact.items()}, num_heads=4)
    state = serving.current()
    assert len(state.sources) == 1 and all(state.first_call(layer) for layer in layers.values())
    layers[0].process_weights_after_loading()  # a second call: a reload, vLLM's values
    assert plugin.summary()[0]["reloads"] == 1
    assert not torch.equal(layers[0].W_UK_T, read_artifacts(tmp_path / "mla", 0)[0])

    plugin.reset()
    assert serving.current() is state and plugin.summary() == []
    assert not state.sources and not state.said and not state.active
    assert all(state.first_call(layer) is None for layer in layers.values())
    layers[0].process_weights_after_loading()  # a first call again: the artifacts
    assert plugin.summary()[0]["loaded"] == 1 and plugin.summary()[0]["reloads"] == 0
    assert torch.equal(layers[0].W_UK_T, read_artifacts(tmp_path / "mla", 0)[0])
    plugin.reset()
