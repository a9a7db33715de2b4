"""A failure says the same thing whatever the worker count: an error raised in a worker
process reaches the parent whole (its type, message and causes, and with them the hint), on a real
small filesystem and a real source defect; a worker that is killed is one line too."""

import json
import os
import signal
import subprocess

import pytest
import torch

from support.edits import rewrite_shard, shard_of
from support.processes import MANIFEST, group_members, small_filesystem, start_cli, wait_until, workers_of

HINT = "free some space on that filesystem, then finish it with the same command and --resume"


def one_error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


def without_path(line: str) -> str:
    """'error: PATH: what failed; what to do' -> 'what failed; what to do' (which file a run was
    writing when the disk filled up depends on the timing)."""
    return line.split(": ", 2)[2]


@pytest.mark.slow
def test_out_of_space_with_two_workers_has_the_one_worker_hint(tiny_src, converted, tmp_path, run_cli, tree_hashes):
    """Before: with -w 2 the line ended at 'No space left on device' (5 of 5 runs), no hint."""
    with small_filesystem(tmp_path / "small", "4m") as small:
        lines = {}
        for workers in (1, 2):
            out = small / f"out-{workers}"
            r = run_cli("convert", tiny_src, "--out", out, "--ignore-free-space", "-w", workers)
            assert r.returncode == 2, r.stderr
            lines[workers] = one_error_line(r.stderr)
            assert json.loads((out / MANIFEST).read_text())["status"] == "incomplete"
        assert HINT in lines[1]
        assert without_path(lines[2]) == without_path(lines[1]), lines
        subprocess.run(["rm", "-r", str(small / "out-1")], check=True)
        subprocess.run(["mount", "-o", "remount,size=20m", str(small)], check=True)
        r = run_cli("convert", tiny_src, "--out", small / "out-2", "--resume", "--quiet", "-w", 2)
        assert r.returncode == 0, r.stderr
        assert tree_hashes(small / "out-2") == tree_hashes(converted["channel-fp8"])


def test_a_source_defect_found_in_a_worker_is_the_same_line(src_copy, tmp_path, run_cli):
    """A block scale of NaN, found while its shard job runs: SourceError, exit 2, the same line."""
    name = "model.layers.1.self_attn.o_proj.weight_scale_inv"

    def poison(tensors: dict) -> None:
        tensors[name] = torch.full_like(tensors[name], float("nan"))

    rewrite_shard(shard_of(src_copy, name), poison)
    results = {w: run_cli("convert", src_copy, "--out", tmp_path / "out", "--overwrite", "-w", w) for w in (1, 2)}
    assert [r.returncode for r in results.values()] == [2, 2], results[2].stderr
    assert one_error_line(results[2].stderr) == one_error_line(results[1].stderr)
    assert "NaN or Inf" in results[1].stderr and name in results[1].stderr


@pytest.mark.slow
def test_a_worker_killed_mid_run_is_one_line_that_says_what_to_do(big_tensors, tmp_path, run_cli, tree_hashes):
    """Before: 'error: unexpected BrokenProcessPool: ...' and exit 70, the code of a bug. The line
    names the signal that ended the worker (the cause, not a guess)."""
    src, expected = big_tensors
    out = tmp_path / "out"
    p = start_cli("convert", src, "--out", out, "--quiet", "--workers", 2, group=True)
    wait_until(lambda: len(workers_of(p.pid)) == 2 or p.poll() is not None, what="the workers")
    worker = next(pid for pid, cmd in group_members(p.pid) if "spawn_main" in cmd)
    os.kill(worker, signal.SIGKILL)  # as the OOM killer would, while the jobs run (eager kernels: seconds)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 2, err
    assert one_error_line(err) == (
        "error: a worker process was killed by SIGKILL (the out-of-memory killer?); use fewer --workers, "
        "then finish it with the same command and --resume"
    )
    assert json.loads((out / MANIFEST).read_text())["status"] == "incomplete"
    r = run_cli("convert", src, "--out", out, "--resume", "--quiet", "--kernels", "native")
    assert r.returncode == 0, r.stderr
    assert tree_hashes(out) == tree_hashes(expected)
