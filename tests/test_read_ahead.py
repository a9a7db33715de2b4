"""Reading ahead during start-up: which files, which ranges, and without importing torch."""

import json
import subprocess
import sys
from pathlib import Path

from mla_convert.constants import MANIFEST_NAME
from mla_convert.io import read_ahead
from mla_convert.io.read_ahead import plan_startup_reads, read_ahead_in_background
from mla_convert.verification.order import FILE_THREADS, first_files, largest_first


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


def test_first_files_are_the_ones_verify_starts_with(converted):
    out = converted["channel-fp8"]
    listed = json.loads((out / MANIFEST_NAME).read_text())["files"]
    sizes = {rel: (out / rel).stat().st_size for rel in sorted(listed)}
    want = [out / rel for rel in largest_first(sizes)[:FILE_THREADS]]
    assert first_files(out, workers=1) == want
    assert max(sizes.values()) == want[0].stat().st_size
    assert len(first_files(out, workers=3)) == 3
    assert first_files(out / "no-such-dir", workers=1) == []


def test_the_read_ahead_runs_before_torch_is_imported():
    """The CLI starts it before `import torch`; if these modules pulled torch in, the read-ahead
    would start only after the ~2.5 s it is meant to overlap."""
    code = "import sys, mla_convert.io.read_ahead, mla_convert.verification, mla_convert.verification.order; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=Path(__file__).parent
    )
    assert out.stdout.strip() == "False"
