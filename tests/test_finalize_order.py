"""What makes a directory a model is written last: a conversion killed before its end
leaves no config (and, before the config, no index), so that a loader refuses it, the manifest
says incomplete, and --resume finishes it with the bytes of an uninterrupted run."""

import json

import pytest

from support.processes import MANIFEST

CONFIGS = ("config.json", "params.json")  # an HF layout's, Mistral's own
INDEXES = ("model.safetensors.index.json", "consolidated.safetensors.index.json")


def vllm_would_load(out) -> bool:
    """What vLLM's loader asks of a local directory: a config (without one it refuses, "no config
    file"), and weights: the index's shards, or every top-level *.safetensors when there is no index."""
    has_config = any((out / name).is_file() for name in CONFIGS)
    has_weights = any((out / name).is_file() for name in INDEXES) or any(out.glob("*.safetensors"))
    return has_config and has_weights


def assert_not_a_model(out) -> None:
    assert json.loads((out / MANIFEST).read_text())["status"] == "incomplete"
    assert not any((out / name).exists() for name in CONFIGS), sorted(p.name for p in out.iterdir())
    assert not vllm_would_load(out)


@pytest.mark.parametrize("point", ["mla-manifest", "index", "config"])
def test_killed_while_finishing_leaves_nothing_loadable(tiny_src, converted, tmp_path, run_cli, tree_hashes, point):
    """Before: killed at 'mla-manifest' config, index and every shard were there (vLLM would load
    it, without its MLA manifest and card); at 'index' the config and the shards."""
    out = tmp_path / "out"
    r = run_cli("convert", tiny_src, "--out", out, "--quiet", crash_at=point)
    assert r.returncode == -9, r.stderr
    assert_not_a_model(out)
    assert (out / "model-00004-of-00004.safetensors").is_file()  # the shards were all done
    r = run_cli("convert", tiny_src, "--out", out, "--resume", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["resumed_jobs"] == 4
    assert tree_hashes(out) == tree_hashes(converted["channel-fp8"])
    assert vllm_would_load(out)


def test_a_resume_cut_short_leaves_nothing_loadable_either(tiny_src, converted, tmp_path, run_cli, tree_hashes):
    """Killed between the config and the manifest (the one window: two renames apart), then
    resumed and killed again before its end: the first run's config and index are gone."""
    out = tmp_path / "out"
    assert run_cli("convert", tiny_src, "--out", out, "--quiet", crash_at="final-manifest").returncode == -9
    assert vllm_would_load(out)  # the window left: its manifest says incomplete
    assert json.loads((out / MANIFEST).read_text())["status"] == "incomplete"
    r = run_cli("convert", tiny_src, "--out", out, "--resume", "--quiet", crash_at="mla-manifest")
    assert r.returncode == -9, r.stderr
    assert_not_a_model(out)
    assert not any((out / name).exists() for name in INDEXES)
    assert run_cli("convert", tiny_src, "--out", out, "--resume", "--quiet").returncode == 0
    assert tree_hashes(out) == tree_hashes(converted["channel-fp8"])


def test_mistral_layout_writes_its_params_json_last(family_checkpoints, tmp_path, run_cli, tree_hashes):
    src = family_checkpoints.source("mistral-large-3")
    expected = family_checkpoints.converted("mistral-large-3", "channel-fp8")
    out = tmp_path / "out"
    assert run_cli("convert", src, "--out", out, "--quiet", crash_at="config").returncode == -9
    assert_not_a_model(out)
    assert (out / "consolidated.safetensors.index.json").is_file()
    assert run_cli("convert", src, "--out", out, "--resume", "--quiet").returncode == 0
    assert tree_hashes(out) == tree_hashes(expected)


def test_the_plugin_refuses_the_window_left_with_one_line_saying_to_resume(tiny_src, tmp_path, run_cli):
    """Killed between the config and the manifest, the directory looks loadable: the plugin's
    loader (mla_runtime.artifacts.open_artifacts, what it runs at vLLM's start) refuses it, saying
    to --resume; once resumed, it opens."""
    from mla_runtime.artifacts import open_artifacts
    from mla_runtime.format import ArtifactError

    out = tmp_path / "out"
    assert run_cli("convert", tiny_src, "--out", out, "--quiet", crash_at="final-manifest").returncode == -9
    assert vllm_would_load(out)
    with pytest.raises(ArtifactError, match=r"an unfinished mla-convert conversion .* says 'incomplete'.*--resume"):
        open_artifacts(out / "mla", model_dir=out)
    assert run_cli("convert", tiny_src, "--out", out, "--resume", "--quiet").returncode == 0
    assert open_artifacts(out / "mla", model_dir=out).layers == [0, 1, 2, 3]
