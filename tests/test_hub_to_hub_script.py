"""scripts/r1_sparse_source.py and scripts/hub_to_hub_r1.py, the Hub-to-Hub measurement at DeepSeek-R1's
real size, exercised at a tiny scale: the sparse source is what its header and digests say, the
real-size tensor set has R1's counts, and the whole Hub-to-Hub path runs and checks its sink."""

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_real_size_tensor_set_is_deepseek_r1s():
    r1 = _script("r1_sparse_source")
    spec = r1.r1_spec()
    tensors = spec.tensors()
    assert (len(tensors), spec.num_shards) == (91_991, 163)
    assert round(r1.tensor_bytes(spec) / 1e9, 1) == 688.6
    shapes = dict((n, s) for n, _, s in tensors)
    assert shapes["model.layers.61.mlp.experts.255.down_proj.weight_scale_inv"] == (56, 16)
    assert shapes["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"] == (5, 56)
    assert shapes["model.layers.3.mlp.gate.e_score_correction_bias"] == (256,)
    assert "model.layers.2.mlp.gate.weight" not in shapes and "model.layers.61.eh_proj.weight" in shapes
    config = r1.config_of(spec)
    assert config["quantization_config"] == {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128],
    }  # fmt: skip
    assert spec.shard_name.format(i=1, n=163) == "model-00001-of-000163.safetensors"


def test_the_sparse_source_is_holes_its_digests_and_headers_true(tmp_path):
    from mla_convert.source.checkpoint import open_source

    r1 = _script("r1_sparse_source")
    spec = r1.r1_spec(layers=4, experts=8, shards=3, tiny=True)
    summary = r1.build(tmp_path / "src", spec, jobs=1)
    digests = json.loads((tmp_path / "src.sha256.json").read_text())
    assert sorted(digests) == [spec.shard_name.format(i=i, n=3) for i in (1, 2, 3)]
    for name, digest in digests.items():
        assert hashlib.sha256((tmp_path / "src" / name).read_bytes()).hexdigest() == digest
    src = open_source(tmp_path / "src")
    assert len(src.weight_map) == summary["tensors"] == len(spec.tensors())
    scale = next(n for n in src.weight_map if n.endswith("weight_scale_inv"))
    from safetensors import safe_open

    with safe_open(tmp_path / "src" / src.weight_map[scale], "np") as f:
        values = f.get_tensor(scale)
    assert values.min() >= 2.0**-14 and values.max() <= 2.0**-7 and len(set(values.ravel().tolist())) > 1
    assert r1.build(tmp_path / "src", spec, jobs=1)["reused"]


def test_hub_to_hub_at_a_tiny_scale(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "hub_to_hub_r1.py"), "--workdir", str(tmp_path), "--tiny",
         "--json", str(tmp_path / "report.json"), "--sample", "0.1"],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    tree = report["tree"]
    assert tree["equal_to_manifest"] and tree["missing"] == tree["extra"] == tree["differ"] == []
    assert tree["received_more_than_once"] == {} and tree["config_only_in_last_commit"]
    assert report["source"]["tensors"] == 209
    assert report["tool_cpu_s"] > 0 and report["hub_cpu_s"] > 0 and report["peak_disk"] > 0
    assert report["peak_rss_tree"] >= report["peak_rss_largest"] / 2 > 0
    assert "equal to the manifest: True" in out.stdout
    assert set(report["stage_seconds"]) == {"download", "convert", "check", "upload"}  # the tool's --json
    assert report["wall_over_busiest_stage"] >= 1 and "wall / busiest stage" in out.stdout
    assert not (tmp_path / "run").exists()  # the run's output and cache deleted; the source kept
    assert (tmp_path / "source-tiny.json").exists()


def test_the_cpu_floor_script_sums_the_primitives_it_measures(tmp_path):
    """scripts/cpu_floor.py: every primitive measured (a positive CPU cost), and the floor is their
    sum, each as many times as a GB of source needs it (two sha256 passes: the source's and the
    output's)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "cpu_floor.py"), "--mb", "16", "--reps", "1", "--dir", str(tmp_path),
         "--json", str(tmp_path / "floor.json")],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads((tmp_path / "floor.json").read_text())
    figures, uses = report["cpu_s_per_gb"], report["uses"]
    assert set(uses) <= set(figures) and len(uses) == 8 and uses["sha256"] == 2
    assert all(value > 0 for value in figures.values()), figures
    assert report["floor"] == round(sum(figures[name] * uses[name] for name in uses), 2)
    for part in ("required", "cheapest"):
        assert report[f"{part}_floor"] == round(sum(figures[name] * n for name, n in report[part].items()), 2)
    assert report["required"]["sha256"] == 2 and report["required_floor"] < report["cheapest_floor"]
    assert f"floor of convert --upload per GB of source: {report['floor']} CPU-s" in out.stdout
    assert list(tmp_path.iterdir()) == [tmp_path / "floor.json"]  # the scratch file removed
