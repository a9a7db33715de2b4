"""End to end on the tiny checkpoint: every output tensor against the slow reference."""

import dataclasses

import pytest
import torch
from safetensors import safe_open

from mla_convert.constants import MANIFEST_NAME
from mla_convert.conversion.pipeline import convert
from mla_convert.errors import ConvertError
from mla_convert.settings import Options, RunSettings
from mla_runtime.format import read_manifest, w_uk_t_name, w_uv_name


@pytest.fixture(scope="module")
def src_tensors(tiny_src, load_all):
    return load_all(tiny_src)


def test_fixture_has_the_awkward_cases(tiny_src, load_json):
    """Guard the fixture itself: a scale in another shard, 576-row partial blocks, MTP layer, experts."""
    wm = load_json(tiny_src / "model.safetensors.index.json")["weight_map"]
    assert any(wm[n] != wm[n[: -len("_scale_inv")]] for n in wm if n.endswith("_scale_inv"))
    assert len(set(wm.values())) >= 3
    assert "model.layers.3.eh_proj.weight" in wm and "model.layers.3.self_attn.kv_b_proj.weight" in wm
    assert (
        "model.layers.1.mlp.experts.7.down_proj.weight" in wm
        and "model.layers.2.mlp.shared_experts.up_proj.weight" in wm
    )
    with safe_open(str(tiny_src / wm["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]), "pt") as f:
        assert f.get_slice("model.layers.0.self_attn.kv_a_proj_with_mqa.weight").get_shape() == [576, 256]


def _fp8_weights(src_tensors):
    return [n[: -len("_scale_inv")] for n in src_tensors if n.endswith("_scale_inv")]


def test_bf16_output_is_reference_dequant_bit_exact(converted, src_tensors, load_all, reference):
    out = load_all(converted["bf16"])
    fp8 = set(_fp8_weights(src_tensors))
    assert fp8 and set(out) == {n for n in src_tensors if not n.endswith("_scale_inv")}
    for name, t in out.items():
        if name in fp8:
            expected = reference.dequant_block(src_tensors[name], src_tensors[name + "_scale_inv"]).to(torch.bfloat16)
        else:
            expected = src_tensors[name]
        assert reference.same_bits(t, expected), name


def test_channel_fp8_output_matches_reference(converted, src_tensors, load_all, reference):
    out = load_all(converted["channel-fp8"])
    fp8 = _fp8_weights(src_tensors)
    expected_names = {n for n in src_tensors if not n.endswith("_scale_inv")} | {
        n[: -len(".weight")] + ".weight_scale" for n in fp8
    }
    assert set(out) == expected_names
    for name in fp8:
        x = reference.dequant_block(src_tensors[name], src_tensors[name + "_scale_inv"])
        q, s = reference.channel_fp8(x, 448.0)
        assert reference.same_bits(out[name], q), name
        assert reference.same_bits(out[name[: -len(".weight")] + ".weight_scale"], s), name
    for name in set(src_tensors) - set(fp8):
        if not name.endswith("_scale_inv"):
            assert reference.same_bits(out[name], src_tensors[name]), name


@pytest.mark.parametrize("fmt", ["channel-fp8", "bf16"])
def test_mla_artifacts_bit_exact_to_seed_layout_of_source_kv_b_proj(
    converted, src_tensors, tiny_src, fmt, load_json, reference
):
    cfg = load_json(tiny_src / "config.json")
    out = converted[fmt]
    manifest = read_manifest(out / "mla")
    layers = cfg["num_hidden_layers"] + cfg["num_nextn_predict_layers"]
    assert manifest.layer_ids() == list(range(layers))
    for i in range(layers):
        name = f"model.layers.{i}.self_attn.kv_b_proj.weight"
        bf16 = reference.dequant_block(src_tensors[name], src_tensors[name + "_scale_inv"]).to(torch.bfloat16)
        uk_t, uv = reference.seed_split(
            bf16, cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
        )
        with safe_open(str(out / "mla" / manifest.entry(i).file), "pt") as f:
            assert reference.same_bits(f.get_tensor(w_uk_t_name(i)), uk_t)
            assert reference.same_bits(f.get_tensor(w_uv_name(i)), uv)
        assert uk_t.shape == (4, 128, 512) and uv.shape == (4, 512, 128)


@pytest.mark.parametrize("fmt", ["channel-fp8", "bf16"])
def test_index_config_side_files_and_manifest(converted, tiny_src, fmt, load_json, load_all, tree_hashes):
    out = converted[fmt]
    index = load_json(out / "model.safetensors.index.json")
    wm = index["weight_map"]
    assert list(wm) == sorted(wm)
    tensors = load_all(out)
    assert set(wm) == set(tensors)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert not any(n.endswith("_scale_inv") for n in wm)

    cfg, src_cfg = load_json(out / "config.json"), load_json(tiny_src / "config.json")
    assert cfg["torch_dtype"] == "bfloat16"
    assert {k: v for k, v in cfg.items() if k != "quantization_config"} == {
        k: v for k, v in src_cfg.items() if k != "quantization_config"
    }
    if fmt == "bf16":
        assert "quantization_config" not in cfg
    else:
        assert cfg["quantization_config"]["quant_method"] == "compressed-tensors"

    for rel in ["tokenizer.json", "tokenizer_config.json", "generation_config.json", "configuration_deepseek.py",
                "modeling_deepseek.py", "figures/notes.txt"]:  # fmt: skip
        assert (out / rel).read_bytes() == (tiny_src / rel).read_bytes(), rel
    # README.md is the output's own model card, the source's text below it (tests/test_card.py).
    source_text = (tiny_src / "README.md").read_text().split("---\n", 2)[2].strip()
    assert (out / "README.md").read_text().rstrip().endswith(source_text)

    manifest = load_json(out / MANIFEST_NAME)
    assert manifest["status"] == "complete" and manifest["options"]["format"] == fmt
    on_disk = {k: v for k, v in tree_hashes(out).items() if k != MANIFEST_NAME}
    assert {k: v["sha256"] for k, v in manifest["files"].items()} == on_disk
    assert all(v["size"] == (out / k).stat().st_size for k, v in manifest["files"].items())
    assert read_manifest(out / "mla").source_fingerprint == manifest["source_fingerprint"]


@pytest.mark.slow
def test_channel_fp8_quantization_config_validates_with_compressed_tensors(tmp_path, tiny_src, load_json, load_all):
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStrategy

    for target in ("gaudi3", "gaudi2"):
        out = tmp_path / target
        convert(tiny_src, out, Options(target=target, ignore=(r"model\.layers\.\d+\.mlp\.experts",)))
        qc = load_json(out / "config.json")["quantization_config"]
        parsed = QuantizationConfig.model_validate(qc)
        scheme = parsed.config_groups["group_0"]
        assert scheme.weights.strategy == QuantizationStrategy.CHANNEL and not scheme.weights.dynamic
        assert scheme.input_activations.strategy == QuantizationStrategy.TOKEN and scheme.input_activations.dynamic
        assert "lm_head" in parsed.ignore and "model.layers.3.eh_proj" in parsed.ignore
        assert "model.layers.1.mlp.gate" in parsed.ignore and "model.layers.3.shared_head.head" in parsed.ignore
        assert r"re:model\.layers\.\d+\.mlp\.experts" in parsed.ignore
        # The bytes are float8_e4m3fn for both targets: no claim of another encoding (fnuz).
        assert "fp8_dtype_flavor" not in qc
        tensors = load_all(out)
        # Ignored experts are bf16 (no scale); everything quantized fits the target range.
        assert tensors["model.layers.1.mlp.experts.0.up_proj.weight"].dtype == torch.bfloat16
        assert "model.layers.1.mlp.experts.0.up_proj.weight_scale" not in tensors
        fp8_max = 240.0 if target == "gaudi2" else 448.0
        for name, t in tensors.items():
            if t.dtype == torch.float8_e4m3fn:
                assert t.float().abs().max() <= fp8_max, name


def test_source_is_not_modified_and_runs_are_deterministic(src_copy, tmp_path, tree_hashes):
    before = tree_hashes(src_copy)
    convert(src_copy, tmp_path / "a", Options())
    convert(src_copy, tmp_path / "b", Options())
    assert tree_hashes(src_copy) == before
    assert tree_hashes(tmp_path / "a") == tree_hashes(tmp_path / "b")


@pytest.mark.slow
def test_workers_give_identical_bytes(tiny_src, converted, tmp_path, tree_hashes):
    convert(tiny_src, tmp_path / "w2", Options(), workers=2)
    assert tree_hashes(tmp_path / "w2") == tree_hashes(converted["channel-fp8"])


def test_run_settings_object_and_keywords_are_the_same_call(tiny_src, tmp_path):
    """convert(..., settings) and convert(..., **fields) take the same RunSettings; keywords
    replace fields of the object; an unknown one is a TypeError, as for any function."""
    a = convert(tiny_src, tmp_path / "a", Options(), RunSettings(workers=3, dry_run=True))
    b = convert(tiny_src, tmp_path / "b", Options(), RunSettings(workers=3), dry_run=True)
    assert a.dry_run and a.workers == 3
    # The same call: the same result, but for where it was asked to write and the free space, which
    # the filesystem reports anew for each call (and other processes change in between).
    assert dataclasses.replace(a, out="", disk_free=0) == dataclasses.replace(b, out="", disk_free=0)
    with pytest.raises(TypeError, match="worker"):
        convert(tiny_src, tmp_path / "c", Options(), worker=2)
    with pytest.raises(ConvertError, match="write_io='fast': unknown mode"):
        RunSettings(write_io="fast")
    assert not any((tmp_path / d).exists() for d in "abc")


def test_transformers_loads_bf16_output_with_reference_logits(converted, src_tensors, tiny_src, reference):
    """transformers' DeepseekV3ForCausalLM on the bf16 output gives exactly the logits of the same
    model built from the reference dequant of the source."""
    from transformers import AutoConfig, AutoModelForCausalLM, DeepseekV3ForCausalLM

    out = converted["bf16"]
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()
    cfg = AutoConfig.from_pretrained(out)
    ref = DeepseekV3ForCausalLM(cfg).eval()
    n_layers = cfg.num_hidden_layers
    state = {}
    for name, t in src_tensors.items():
        if name.endswith("_scale_inv") or any(
            name.startswith(f"model.layers.{i}.") for i in range(n_layers, n_layers + 1)
        ):
            continue
        scale = src_tensors.get(name + "_scale_inv")
        state[name] = reference.dequant_block(t, scale).to(torch.bfloat16) if scale is not None else t
    # transformers 5 holds routed experts fused: gate_up_proj[e] = cat(gate, up), down_proj[e].
    for i in range(cfg.first_k_dense_replace, n_layers):
        p = f"model.layers.{i}.mlp.experts"
        experts = range(cfg.n_routed_experts)
        state[f"{p}.gate_up_proj"] = torch.stack(
            [torch.cat([state.pop(f"{p}.{e}.gate_proj.weight"), state.pop(f"{p}.{e}.up_proj.weight")]) for e in experts]
        )
        state[f"{p}.down_proj"] = torch.stack([state.pop(f"{p}.{e}.down_proj.weight") for e in experts])
    missing, unexpected = ref.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    # Same dtypes as transformers chose on load (bf16, with the router gate kept in fp32).
    loaded = dict(model.named_parameters())
    for name, param in ref.named_parameters():
        param.data = param.data.to(loaded[name].dtype)
    ids = torch.tensor([[0, 17, 42, 99, 311, 7, 500, 3]])
    with torch.no_grad():
        got, want = model(ids).logits, ref(ids).logits
    assert torch.isfinite(got).all() and got.abs().max() > 0
    assert torch.equal(got, want)
