"""With --workers 2 or more, progress moves as the workers convert tensors, not only when a whole
shard is done (before, a bar stayed at 0.0 GB for the first shard, then jumped)."""

import threading
import time

import pytest

from mla_convert.conversion.pipeline import convert
from mla_convert.demo.specs import CheckpointSpec
from mla_convert.demo.synthetic import write_checkpoint
from mla_convert.settings import Options


@pytest.fixture(scope="module")
def two_shards(tmp_path_factory):
    """94 MB in two shards of about 40 tensors each: each job runs for several of the scheduler's
    looks at the workers' reports."""
    spec = CheckpointSpec(
        hidden_size=1024, num_hidden_layers=6, first_k_dense_replace=6, num_nextn_predict_layers=0,
        num_attention_heads=8, q_lora_rank=256, intermediate_size=4096, vocab_size=512, num_shards=2,
        n_routed_experts=2, split_scale_of="model.layers.0.mlp.down_proj.weight",
    )  # fmt: skip
    base = tmp_path_factory.mktemp("two_shards")
    src = write_checkpoint(base / "src", spec)
    convert(src, base / "one-worker", Options(), kernels="native")
    return src, base / "one-worker"


class Recorder:
    """A progress_factory that notes, for every advance, how many output shards were already in place."""

    def __init__(self, out):
        self.out, self.calls, self.total = out, [], None
        self.lock = threading.Lock()

    def __call__(self, total: int):
        self.total = total
        return self.advance

    def advance(self, n: int) -> None:
        with self.lock:
            self.calls.append((time.monotonic(), n, len(list(self.out.glob("model-*.safetensors")))))


def test_two_workers_report_progress_before_the_first_shard_is_done(two_shards, tmp_path, tree_hashes):
    """Before: one advance per finished shard (2 in all, the first once a shard was in place)."""
    src, expected = two_shards
    out = tmp_path / "out"
    rec = Recorder(out)
    convert(src, out, Options(), workers=2, kernels="eager", progress_factory=rec)
    assert tree_hashes(out) == tree_hashes(expected)
    before_a_shard = [n for _, n, shards in rec.calls if shards == 0]
    assert len(before_a_shard) >= 8, rec.calls  # several tensors of each job, as the workers go
    assert sum(before_a_shard) > 0.25 * rec.total, (sum(before_a_shard), rec.total)
    counted = sum(n for _, n, _ in rec.calls)  # every tensor once, none twice (the total has headers too)
    assert 0.999 * rec.total <= counted <= rec.total, (counted, rec.total)
    assert all(n >= 0 for _, n, _ in rec.calls)


def test_the_cli_with_two_workers_prints_progress_before_the_first_shard(two_shards, tmp_path, run_cli):
    """The real CLI (progress lines on a stderr that is not a terminal): many lines, most with less
    than one shard's share done. Before: one line per finished shard, the first at about half."""
    src, _ = two_shards
    out = tmp_path / "out"
    r = run_cli("convert", src, "--out", out, "-w", "2", env={"MLA_CONVERT_PROGRESS_INTERVAL": "0.001"})
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("converting: ") and " of " in ln]
    percents = [float(ln.split("(")[1].split(" %")[0]) for ln in lines]
    assert percents == sorted(percents), lines
    assert sum(p < 40.0 for p in percents) >= 3, lines  # two shards of about half each


def test_verify_with_two_workers_reports_progress_per_tensor(two_shards):
    """verify --workers 2: the bar moves with each tensor a worker checks, not once per file
    (before: exactly one advance per file), and every byte is counted once."""
    from mla_convert.api import verify

    _, converted = two_shards
    files = [p for p in converted.rglob("*") if p.is_file() and p.name != "mla-convert-manifest.json"]
    rec = Recorder(converted)
    report = verify(converted, workers=2, progress_factory=rec)
    assert report.ok, [f.line() for f in report.failures()]
    assert len(rec.calls) > len(files) + 20, (len(rec.calls), len(files))
    assert sum(n for _, n, _ in rec.calls) == rec.total and all(n >= 0 for _, n, _ in rec.calls)
