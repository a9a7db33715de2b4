"""scripts/r1_sparse_output.py, the converted DeepSeek-R1 at its real size that verify's memory is
measured on, proved at a tiny scale: every file it writes has the sha256 of the
file the real conversion writes from the same sparse source, verify passes on it with and without
--source, its weights are holes, and a source weight that is not zero is refused."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from mla_convert.api import verify
from mla_convert.conversion.pipeline import convert
from mla_convert.settings import Options

ROOT = Path(__file__).resolve().parent.parent


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # the generator's worker processes import it by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def sparse_src(tmp_path_factory) -> Path:
    r1 = _script("r1_sparse_source")
    src = tmp_path_factory.mktemp("sparse") / "src"
    r1.build(src, r1.r1_spec(layers=4, experts=8, shards=4, tiny=True), jobs=1)
    return src


@pytest.mark.parametrize("fmt, target", [("channel-fp8", "gaudi3"), ("channel-fp8", "gaudi2"), ("bf16", "gaudi3")])
def test_the_generated_output_is_the_conversion_byte_for_byte(sparse_src, tmp_path, fmt, target):
    gen = _script("r1_sparse_output")
    options = Options(format=fmt, target=target)
    convert(sparse_src, tmp_path / "real", options)
    summary = gen.build(sparse_src, tmp_path / "gen", options, jobs=1)
    assert gen.compare(tmp_path / "gen", tmp_path / "real") == []
    real_files = {p.relative_to(tmp_path / "real") for p in (tmp_path / "real").rglob("*") if p.is_file()}
    assert len(real_files) == summary["files"] + 1 == 20  # the manifest lists every file but itself
    index = json.loads((tmp_path / "real" / "model.safetensors.index.json").read_text())
    assert (summary["mla_layers"], summary["tensors"]) == (5, len(index["weight_map"]))
    # the weights are holes: the shards hold their headers and scales only
    shards = sorted((tmp_path / "gen").glob("model-*.safetensors"))
    assert sum(p.stat().st_blocks * 512 for p in shards) < sum(p.stat().st_size for p in shards) / 2
    if fmt == "channel-fp8" and target == "gaudi3":
        assert verify(tmp_path / "gen").exit_code == 0
        assert verify(tmp_path / "gen", source=sparse_src).exit_code == 0
    assert gen.build(sparse_src, tmp_path / "gen", options, jobs=1)["reused"]


def test_a_source_weight_that_is_not_zero_is_refused(sparse_src, tmp_path):
    import shutil

    from mla_convert.source.checkpoint import open_source

    gen = _script("r1_sparse_output")
    src = Path(shutil.copytree(sparse_src, tmp_path / "src"))
    s = open_source(src)
    name = "model.layers.3.mlp.experts.5.up_proj.weight"
    rel = s.weight_map[name]
    with open(src / rel, "r+b") as f:
        f.seek(s.headers[rel].data_start + s.info(name).begin + 100)
        f.write(b"\x01")
    with pytest.raises(SystemExit, match="not zero"):
        gen.build(src, tmp_path / "gen", jobs=1)
    assert not (tmp_path / "gen").exists()  # refused before anything was written
