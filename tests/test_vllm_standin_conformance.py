"""The upstream-vLLM stand-in (tests/support/standins/vllm_upstream.py) against the real vLLM it
follows, where vLLM is installed (`python -m pytest -q -m vllm`): the same inputs give the same
registrations, attributes and tensors. The default group's Gaudi tests run on the stand-in; this
keeps it honest.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

STANDIN = importlib.util.spec_from_file_location(
    "vllm_upstream_conformance", __file__.rsplit("/", 1)[0] + "/support/standins/vllm_upstream.py"
)


@pytest.fixture(scope="module")
def pair(vllm_installed):
    """(real vLLM namespace, stand-in module)."""
    from vllm.model_executor.layers.attention import attention, mla_attention
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.quantization import kv_cache
    from vllm.model_executor.layers.quantization.utils import quant_utils
    from vllm.model_executor.utils import replace_parameter

    real = type("Real", (), {})()
    real.replace_parameter = replace_parameter
    real.should_load_quant_weights = attention.should_load_quant_weights
    real.set_default_quant_scales = attention.set_default_quant_scales
    real.split_kv_b_proj = mla_attention.split_kv_b_proj
    real.get_and_maybe_dequant_weights = quant_utils.get_and_maybe_dequant_weights
    real.BaseKVCacheMethod = kv_cache.BaseKVCacheMethod
    real.UnquantizedLinearMethod = UnquantizedLinearMethod
    standin = importlib.util.module_from_spec(STANDIN)
    STANDIN.loader.exec_module(standin)
    return real, standin


def _outcome(impl, *, old: torch.Tensor | None, new: torch.Tensor, prefer_copy: bool):
    layer = nn.Module()
    if old is not None:
        param = nn.Parameter(old.clone(), requires_grad=False)
        param.weight_loader = "loader-of-old"
        layer.register_parameter("w", param)
    before = layer._parameters.get("w")
    new = new.clone()
    new.marker = "carried"
    impl.replace_parameter(layer, "w", new, prefer_copy=prefer_copy)
    got = layer._parameters["w"]
    return {
        "registered": isinstance(got, nn.Parameter),
        "same_object": got is before,
        "shares_new_storage": got.data_ptr() == new.data_ptr(),
        "values": got.detach().clone(),
        "weight_loader": getattr(got, "weight_loader", None),
        "marker": getattr(got, "marker", None),
    }


@pytest.mark.parametrize("old", [None, "compatible", "other-shape"])
@pytest.mark.parametrize("prefer_copy", [False, True])
def test_replace_parameter(pair, old, prefer_copy):
    real, standin = pair
    new = torch.arange(6, dtype=torch.bfloat16).view(2, 3).T  # a non-contiguous view, as W_UK.permute gives
    old_t = {None: None, "compatible": torch.zeros(3, 2, dtype=torch.bfloat16), "other-shape": torch.zeros(4)}[old]
    a = _outcome(real, old=old_t, new=new, prefer_copy=prefer_copy)
    b = _outcome(standin, old=old_t, new=new, prefer_copy=prefer_copy)
    values_a, values_b = a.pop("values"), b.pop("values")
    assert a == b and torch.equal(values_a, values_b)


def test_quant_scale_helpers(pair):
    real, standin = pair
    assert real.should_load_quant_weights(None) is standin.should_load_quant_weights(None) is False
    assert real.should_load_quant_weights(real.UnquantizedLinearMethod()) is False
    assert standin.should_load_quant_weights(standin.UnquantizedLinearMethod()) is False
    assert real.should_load_quant_weights(object()) is standin.should_load_quant_weights(object()) is True

    def state(impl):
        layer = nn.Module()
        impl.set_default_quant_scales(layer, register_buffer=True)
        for name in ("_k_scale", "_q_scale"):
            getattr(layer, name).fill_(7.0)
        impl.set_default_quant_scales(layer, register_buffer=False)
        return (
            sorted(layer._buffers),
            [float(b) for b in layer._buffers.values()],
            {k: v for k, v in vars(layer).items() if k.endswith("_float")},
            float(layer._k_scale_cpu),
        )

    assert state(real) == state(standin)


@pytest.mark.parametrize("q_scale", [-1.0, 0.5])
def test_kv_cache_method_deletes_the_loadable_scales(pair, q_scale):
    real, standin = pair

    def state(impl):
        layer = nn.Module()
        impl.set_default_quant_scales(layer, register_buffer=True)
        layer.kv_cache_dtype = "auto"
        method = impl.BaseKVCacheMethod(quant_config=None)
        method.create_weights(layer)
        layer.q_scale.data.fill_(q_scale)
        method.process_weights_after_loading(layer)
        return (
            [n for n in ("q_scale", "k_scale", "v_scale", "prob_scale") if hasattr(layer, n)],
            sorted(layer._buffers),
            float(layer._q_scale),
            float(layer._prob_scale),
            layer._q_scale_float,
        )

    assert state(real) == state(standin)


def test_dequant_and_split(pair):
    real, standin = pair
    gen = torch.Generator().manual_seed(0)
    heads, p, v, rank = 2, 128, 128, 512
    weight = (torch.randn(heads * (p + v), rank, generator=gen) * 0.02).to(torch.bfloat16)

    class ScaledMatmul:  # any quantized method: the generic path pushes an identity matrix through apply
        def apply(self, layer, x, bias=None):
            return (x.float() @ layer.weight.float().T * 0.75).to(x.dtype)

    for method in ("unquantized", "generic"):
        outs = []
        for impl in (real, standin):
            layer = nn.Module()
            layer.weight = nn.Parameter(weight, requires_grad=False)
            layer.input_size_per_partition = rank
            layer.quant_method = impl.UnquantizedLinearMethod() if method == "unquantized" else ScaledMatmul()
            dequant = impl.get_and_maybe_dequant_weights(layer, out_dtype=torch.bfloat16)
            w_uk, w_uv = impl.split_kv_b_proj(layer, torch.bfloat16, rank, heads, p, v)
            outs.append((dequant, w_uk, w_uv))
        for a, b in zip(*outs, strict=True):
            assert a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b)
