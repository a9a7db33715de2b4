"""`vllm serve REPO_ID` of a converted model as the card says it: a repo id served from the local
Hugging Face cache with HF_HUB_OFFLINE=1 and no MLA_RUNTIME_DIR, in a real vLLM engine (the CPU
build; `python -m pytest -q -m vllm`). The cache is laid out as huggingface_hub lays it out
(models--ORG--NAME/snapshots/COMMIT/..., refs/main) from a converted demo output whose card was
written for that repo: with the plugin every layer comes from the snapshot's mla/, and the tokens
equal those without the plugin."""

from __future__ import annotations

import hashlib
import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mla_convert
from mla_convert.conversion.pipeline import convert
from mla_convert.demo.specs import CheckpointSpec
from mla_convert.demo.synthetic import write_checkpoint
from mla_convert.settings import Options
from support.artifacts import read_artifacts
from support.vllm_engine_run import engine_env, plugin_lines, run_engine_process

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

REPO = "org/tiny-r1-bf16"
LAYERS = 3


@pytest.fixture(scope="module")
def cache(tmp_path_factory, vllm_installed) -> dict:
    base = tmp_path_factory.mktemp("vllm-hub")
    src = write_checkpoint(base / "src", CheckpointSpec(num_attention_heads=8))
    out = base / "out"
    convert(src, out, Options(format="bf16"))
    mla_convert.card(out, repo_id=REPO)  # as upload writes it
    commit = hashlib.sha1(b"tiny-r1-bf16").hexdigest()
    repo_dir = base / "hub" / f"models--{REPO.replace('/', '--')}"
    snapshot = repo_dir / "snapshots" / commit
    shutil.copytree(out, snapshot)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)
    return {"base": base, "out": out, "hub": base / "hub", "snapshot": snapshot}


def offline_engine(cache: dict, name: str, plugin: bool):
    env = engine_env(plugin=plugin, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache["hub"]),
                     HF_HOME=str(cache["base"] / "hf-home"))  # fmt: skip
    assert "MLA_RUNTIME_DIR" not in env
    run_dir = cache["base"] / f"run-{name}"
    run_dir.mkdir()
    result, log = run_engine_process(REPO, run_dir, env)  # a repo id, not a directory
    from safetensors.torch import load_file

    return result, log, load_file(str(run_dir / "mla.safetensors"))


def test_a_repo_id_from_the_local_cache_serves_every_layer_from_the_artifacts_with_nothing_set(cache):
    text = (cache["out"] / "README.md").read_text()
    assert (
        f"vllm serve {REPO} --tensor-parallel-size" in text
        and "MLA_RUNTIME_DIR" not in text.partition("## Serving")[2].partition("## Verification")[0]
    )
    on, on_log, on_weights = offline_engine(cache, "on", plugin=True)
    off, off_log, _ = offline_engine(cache, "off", plugin=False)
    lines = plugin_lines(on_log)
    assert len(lines) == 1 and f"loaded W_UK_T/W_UV of {LAYERS}/{LAYERS} MLA layers" in lines[0], on_log[-4000:]
    assert str(cache["snapshot"] / "mla") in lines[0] or "snapshots" in lines[0], lines[0]
    assert on["plugin"][0]["loaded"] == LAYERS
    assert plugin_lines(off_log) == []
    assert on["tokens"] == off["tokens"] and on["logprobs"] == off["logprobs"]
    for layer in range(LAYERS):
        names = [k for k in on_weights if k.endswith(".W_UK_T") and f".layers.{layer}." in k]
        assert len(names) == 1, sorted(on_weights)
        prefix = names[0][: -len(".W_UK_T")]
        art_uk_t, art_uv = read_artifacts(cache["snapshot"] / "mla", layer)
        assert torch.equal(on_weights[prefix + ".W_UK_T"], art_uk_t)
        assert torch.equal(on_weights[prefix + ".W_UV"], art_uv)


def test_online_vllm_downloads_only_the_index_shards_and_the_cards_fetch_line_brings_mla(fake_hub, cache, tmp_path):
    """vLLM online (here against the fake Hub): with an index in the repo its download takes exactly
    the index's shards (and its download of the rest skips every *.safetensors), so mla/'s layers
    are not in the snapshot and vLLM computes W_UK_T/W_UV itself; the card's first line (`hf
    download REPO --include 'mla/*'`, the real hf command) puts them into the same snapshot, from
    which `vllm serve REPO` (offline here: online, the plugin must find the snapshot of a repo id
    itself, mla_runtime's part) takes every layer."""
    fake_hub.add_repo(REPO, cache["out"])
    text = (cache["out"] / "README.md").read_text()
    fetch = f"hf download {REPO} --include 'mla/*'"
    assert fetch in text
    env = engine_env(plugin=True)  # the fake Hub's environment (HF_ENDPOINT, an empty cache), online
    assert "HF_HUB_OFFLINE" not in env or env["HF_HUB_OFFLINE"] in ("", "0")
    first = tmp_path / "first"
    first.mkdir()
    result, log = run_engine_process(REPO, first, env)
    snapshot = Path(env["HF_HUB_CACHE"]) / f"models--{REPO.replace('/', '--')}" / "snapshots"
    downloaded = sorted(p.relative_to(next(snapshot.iterdir())).as_posix() for p in snapshot.rglob("*") if p.is_file())
    # Its weights download takes the index's shards; its download of the rest skips every *.safetensors.
    assert not any(p.startswith("mla/layer-") for p in downloaded), downloaded
    assert all(
        p in downloaded
        for p in json.loads((cache["out"] / "model.safetensors.index.json").read_text())["weight_map"].values()
    )
    assert not any(f"{LAYERS}/{LAYERS} MLA layers" in ln for ln in plugin_lines(log)), plugin_lines(log)
    assert all(s.get("loaded", 0) == 0 for s in result["plugin"]), result["plugin"]

    bin_dir = Path(sys.executable).parent
    r = subprocess.run([str(bin_dir / "hf"), *shlex.split(fetch)[1:]], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    second = tmp_path / "second"
    second.mkdir()
    result, log = run_engine_process(REPO, second, env | {"HF_HUB_OFFLINE": "1"})
    lines = plugin_lines(log)
    assert len(lines) == 1 and f"loaded W_UK_T/W_UV of {LAYERS}/{LAYERS} MLA layers" in lines[0], log[-4000:]
