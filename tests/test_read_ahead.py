"""Reading ahead during start-up: which files, which ranges, and without importing torch."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mla_convert.constants import MANIFEST_NAME
from mla_convert.io import read_ahead
from mla_convert.io.read_ahead import plan_startup_reads, read_ahead_in_background
from mla_convert.verification.order import files_at_once, first_files


def test_startup_reads_take_turns_between_the_files_read_at_once():
    reqs = plan_startup_reads([250, 90, 999], streams=2, budget=400, step=64)
    # each of the first two files gets half the budget, front first, in turns; the third none
    assert reqs == [(0, 0, 64), (1, 0, 64), (0, 64, 64), (1, 64, 26), (0, 128, 64), (0, 192, 8)]


def test_startup_reads_stop_at_the_budget_and_at_the_end_of_small_files():
    reqs = plan_startup_reads([10_000, 10_000], streams=2, budget=1000, step=300)
    per_file = {i: sum(n for j, _, n in reqs if j == i) for i in (0, 1)}
    assert per_file == {0: 500, 1: 500}
    assert plan_startup_reads([5, 0], streams=4, budget=1000, step=300) == [(0, 0, 5)]
    assert plan_startup_reads([], streams=2, budget=1000) == []


def test_read_ahead_asks_for_the_planned_ranges(tmp_path, monkeypatch):
    files = []
    for name, size in (("a", 300), ("b", 100)):
        (tmp_path / name).write_bytes(bytes(size))
        files.append(tmp_path / name)
    asked = []
    monkeypatch.setattr(read_ahead, "will_need", lambda fd, off, n: asked.append((off, n)))
    read_ahead_in_background([*files, tmp_path / "missing"], streams=3, budget=600).join(timeout=10)
    assert sorted(asked) == sorted((off, n) for _, off, n in plan_startup_reads([300, 100, 0], 3, 600))


def test_first_files_are_the_largest_listed_files_present_largest_first(tmp_path):
    """Sizes on disk decide (the manifest's are not read), a listed file that is gone is skipped,
    files of one size keep the manifest's sorted order, and files it does not list are not read."""
    sizes = {"a.safetensors": 500, "mla/layer-000.safetensors": 400, "c.json": 400, "d.txt": 100}
    for rel, size in sizes.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(bytes(size))
    (tmp_path / "unlisted.bin").write_bytes(bytes(10_000))
    listed = {rel: {"size": 1, "sha256": ""} for rel in [*sizes, "gone.safetensors"]}
    (tmp_path / MANIFEST_NAME).write_text(json.dumps({"files": listed}))
    order = [tmp_path / rel for rel in ("a.safetensors", "c.json", "mla/layer-000.safetensors", "d.txt")]
    for workers in (1, 3, 8):
        assert first_files(tmp_path, workers) == order[: files_at_once(workers)]


@pytest.mark.parametrize("manifest", [None, "{", '{"files": 3}', '{"status": "complete"}', "[]"])
def test_first_files_are_none_without_a_readable_manifest(tmp_path, manifest):
    (tmp_path / "a.safetensors").write_bytes(bytes(10))
    if manifest is not None:
        (tmp_path / MANIFEST_NAME).write_text(manifest)
    assert first_files(tmp_path, workers=1) == []
    assert first_files(tmp_path / "no-such-dir", workers=1) == []


def test_the_read_ahead_runs_before_torch_is_imported():
    """The CLI starts it before `import torch`; if these modules pulled torch in, the read-ahead
    would start only after the ~2.5 s it is meant to overlap."""
    code = "import sys, mla_convert.io.read_ahead, mla_convert.verification, mla_convert.verification.order; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=Path(__file__).parent
    )
    assert out.stdout.strip() == "False"
