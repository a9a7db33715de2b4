"""mla_runtime.model_configs against vLLM 0.34's own reading of a Mistral-Large-4 params.json (the
stand-in's `adapt_config_dict`, which follows transformers_utils/configs/mistral.py line by line),
and the config shapes of the other members (no layer of its own dims)."""

from __future__ import annotations

import importlib

import pytest

from mla_runtime import ArtifactError
from mla_runtime.artifacts import served_layer_dims
from mla_runtime.format import MlaDims
from mla_runtime.model_configs import kv_sources, layer_fields, nope_layers, text_model_config

pytestmark = pytest.mark.parametrize("vllm_codebase", ["vllm 0.34.0"])


def large4(layers: int, nope: str | None, sources: list[int] | None = None) -> dict:
    params = {"n_layers": layers, "n_heads": 8, "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16,
              "v_head_dim": 32, "q_lora_rank": None, "moe": {"num_shared_experts": 1}, "dsa": {"topk": 4}}  # fmt: skip
    if nope is not None:
        params["nope"] = nope
    if sources is not None:
        params["kv_sharing"] = {"source_layers_str": ",".join(map(str, sources))}
    return params


def vllm_reads(params: dict) -> dict:
    return importlib.import_module("vllm_034.mistral_large4").adapt_config_dict(params)


@pytest.mark.parametrize(
    "layers, nope",
    [(12, "rope,rope,rope,nope"), (7, "nope,rope"), (5, "rope"), (9, "nope"), (6, None), (4, "rope,nope,NoPE, nope,x")],
)
def test_nope_layers_and_dims_are_vllms(vllm_standin, layers, nope):
    params = large4(layers, nope)
    adapted = vllm_reads(dict(params))
    assert nope_layers(params) == adapted["nope_layer_flags"] == nope_layers(adapted)
    assert kv_sources(params) == adapted["kv_source_layers"] == kv_sources(adapted)
    served = served_layer_dims(params)
    assert served == served_layer_dims(adapted)
    model = MlaDims(num_heads=8, qk_nope_head_dim=32, v_head_dim=32, kv_lora_rank=64)
    for i, flag in enumerate(adapted["nope_layer_flags"]):
        assert served[i] == (MlaDims(8, 48, 32, 64) if flag else model)
        assert served[i].kv_b_shape() == (8 * ((48 if flag else 32) + 32), 64)  # the stand-in's kv_b_proj rows


@pytest.mark.parametrize(
    "nope, sources",
    [
        ("rope", [0, 0, 1, 3]),  # a source that itself shares
        ("rope", [0, 2, 2, 3]),  # a later source
        ("rope,nope", [0, 0, 2, 3]),  # a NoPE layer sharing a RoPE layer's cache
        ("rope", [0, 1, 2]),  # one entry short
    ],
)
def test_kv_sharing_vllm_refuses_is_refused(vllm_standin, nope, sources):
    params = large4(4, nope, sources)
    with pytest.raises(AssertionError):
        vllm_reads(dict(params))
    with pytest.raises(ValueError):
        kv_sources(params)
    with pytest.raises(ArtifactError, match="per-layer attention config"):
        served_layer_dims(params)


def test_kv_sharing_layers_keep_their_own_dims(vllm_standin):
    params = large4(8, "rope,rope,rope,nope", [0, 1, 2, 3, 4, 4, 6, 3])
    assert kv_sources(params) == vllm_reads(dict(params))["kv_source_layers"]
    assert layer_fields(params) == {3: {"qk_nope_head_dim": 48}, 7: {"qk_nope_head_dim": 48}}


def test_the_other_members_configs_have_no_layer_of_its_own(vllm_standin):
    flat = {"num_attention_heads": 4, "num_hidden_layers": 3, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
            "v_head_dim": 128, "kv_lora_rank": 512}  # fmt: skip
    nested = {"architectures": ["KimiK25ForConditionalGeneration"], "text_config": flat}
    large3 = {"n_heads": 4, "n_layers": 3, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
              "kv_lora_rank": 512, "nope": "nope", "moe": {"num_shared_experts": 1}}  # no dsa: `nope` unread  # fmt: skip
    for config in (flat, nested, large3):
        assert text_model_config(config)["num_hidden_layers"] == 3
        assert layer_fields(config) == {} and kv_sources(config) == [0, 1, 2]
        assert set(served_layer_dims(config).values()) == {MlaDims(4, 128, 128, 512)}
