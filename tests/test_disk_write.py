"""disk_write: O_DIRECT and page-cache writers leave byte-identical files, and the choice shows."""

import errno
import json
import os
import random
import re
import time

import pytest
import torch
from typer.testing import CliRunner

from mla_convert.cli.app import app
from mla_convert.conversion.pipeline import convert
from mla_convert.errors import OutputError
from mla_convert.io import disk_write
from mla_convert.io.shard_writer import ShardWriter
from mla_convert.settings import Options

STAGE = 4 * disk_write.ALIGN  # small stages, so a few KB cross many stage and block boundaries


def _pieces(total: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    out, left = [], total
    while left:
        n = min(left, rng.choice([1, 7, 511, 4096, 4097, STAGE - 1, STAGE, STAGE + 3, 3 * STAGE + 5]))
        out.append(rng.randbytes(n))
        left -= n
    return out


@pytest.mark.parametrize("total", [0, 1, 4095, 4096, 4097, STAGE - 1, STAGE, STAGE + 1, 5 * STAGE + 1234])
def test_direct_and_buffered_files_hold_exactly_the_bytes_written(tmp_path, total):
    pieces = _pieces(total, total)
    direct = disk_write.DirectFile(tmp_path / "direct", stage_bytes=STAGE)
    buffered = disk_write.BufferedFile(tmp_path / "buffered")
    for f in (direct, buffered):
        for p in pieces:
            f.write(memoryview(p))
        f.finish()
    expected = b"".join(pieces)
    assert (tmp_path / "direct").read_bytes() == expected
    assert (tmp_path / "buffered").read_bytes() == expected
    assert direct.size == buffered.size == total


def test_direct_files_reuse_the_staging_buffers_of_closed_ones(tmp_path):
    """A file's stages go back to the pool when it closes and the next file takes them, stale
    bytes and all: only what the next file writes reaches the disk."""
    size = 8 * disk_write.ALIGN  # a stage size no other test uses
    first = disk_write.DirectFile(tmp_path / "first", stage_bytes=size)
    first.write(b"\xff" * (3 * size))
    first.finish()
    created = disk_write.stage_pool().created
    second = disk_write.DirectFile(tmp_path / "second", stage_bytes=size)
    second.write(b"ab" * 3000)
    second.finish()
    assert disk_write.stage_pool().created == created, "the second file mapped fresh stages"
    assert (tmp_path / "second").read_bytes() == b"ab" * 3000


def _mount_table(monkeypatch, tmp_path, fs_type: str) -> None:
    """Stand-in mount table: `tmp_path` on a filesystem of `fs_type` (an NFS mount cannot be made here)."""
    table = tmp_path.parent / f"mounts-{tmp_path.name}"
    real = os.path.realpath(tmp_path).replace(" ", "\\040")
    table.write_text(f"/dev/vda / ext4 rw 0 0\nserver:/x {real} {fs_type} rw 0 0\n")
    monkeypatch.setattr(disk_write, "MOUNTS", table)


def test_auto_takes_direct_on_local_block_filesystems_only(tmp_path, monkeypatch):
    _mount_table(monkeypatch, tmp_path, "xfs")
    assert disk_write.resolve_mode(tmp_path, "auto") == ("direct", "xfs takes O_DIRECT: no page-cache copy")
    for fs in ("nfs4", "fuse.s3fs", "tmpfs", "overlay"):
        _mount_table(monkeypatch, tmp_path, fs)
        assert disk_write.resolve_mode(tmp_path, "auto") == ("buffered", f"{fs} is not a local block filesystem")
        assert disk_write.resolve_mode(tmp_path, "direct")[0] == "direct"  # asked for, it is tried
    assert disk_write.resolve_mode(tmp_path, "buffered") == ("buffered", "requested")
    assert not list(tmp_path.iterdir()), "the probe file must not stay behind"


def test_filesystem_type_reads_the_real_mount_table():
    assert disk_write.filesystem_type("/proc/self") == "proc"
    assert disk_write.filesystem_type("/") is not None


def _refuse_o_direct(monkeypatch):
    """Stand-in for a filesystem without O_DIRECT (some network and FUSE filesystems): open fails."""
    real_open = os.open

    def fake_open(path, flags, *args, **kw):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(disk_write.os, "open", fake_open)


def test_auto_falls_back_to_buffered_and_says_why(tmp_path, monkeypatch):
    _mount_table(monkeypatch, tmp_path, "ext4")
    _refuse_o_direct(monkeypatch)
    mode, why = disk_write.resolve_mode(tmp_path, "auto")
    assert mode == "buffered" and "O_DIRECT" in why and "Invalid argument" in why
    with pytest.raises(OSError, match="O_DIRECT"):
        disk_write.resolve_mode(tmp_path, "direct")


def test_a_failed_direct_write_surfaces_and_the_partial_file_goes(tmp_path, monkeypatch):
    specs = {"a": ("U8", (3 * disk_write.STAGE_BYTES,))}

    def fail(fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(disk_write.os, "pwrite", fail)
    w = ShardWriter(tmp_path / "x.safetensors", specs, write_mode="direct")
    with pytest.raises(Exception, match="No space left") as info, w:
        w.write("a", torch.zeros(3 * disk_write.STAGE_BYTES, dtype=torch.uint8))
        w.commit()
    assert "x.safetensors" in str(info.value)
    assert not list(tmp_path.iterdir())


def test_conversion_bytes_do_not_depend_on_the_write_mode(tiny_src, converted, tmp_path, tree_hashes):
    out = {}
    for mode in ("direct", "buffered"):
        summary = convert(tiny_src, tmp_path / mode, Options(), write_io=mode)
        assert summary.write_io == mode and summary.write_io_reason == "requested"
        out[mode] = tree_hashes(tmp_path / mode)
    assert out["direct"] == out["buffered"] == tree_hashes(converted["channel-fp8"])


def test_conversion_on_a_filesystem_without_o_direct_reports_buffered(tiny_src, tmp_path, monkeypatch):
    (tmp_path / "out").mkdir()
    _mount_table(monkeypatch, tmp_path / "out", "ext4")
    _refuse_o_direct(monkeypatch)
    with pytest.raises(OutputError, match=r"--write-io: .*cannot write with O_DIRECT"):
        convert(tiny_src, tmp_path / "out", Options(), write_io="direct")
    assert not list((tmp_path / "out").iterdir()), "a refused direct mode must write nothing"
    summary = convert(tiny_src, tmp_path / "out", Options())
    assert summary.write_io == "buffered" and "O_DIRECT refused" in summary.write_io_reason


def test_cli_rejects_an_unknown_write_mode_in_one_line(tiny_src, tmp_path):
    r = CliRunner().invoke(app, ["deepseek-r1", str(tiny_src), "--out", str(tmp_path / "o"), "--write-io", "fast"])
    assert r.exit_code == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "--write-io" in lines[0] and "fast" in lines[0], r.stderr
    assert not (tmp_path / "o").exists()


def test_a_slow_disk_holds_the_writer_to_its_staging_buffers(tmp_path, monkeypatch):
    """A slow disk must not let converted tensors pile up: the writer waits for a free staging
    buffer once a file holds StagedFile.STAGES of them, whatever the tensor sizes, and the file is
    still exact."""
    import time

    from safetensors.torch import load_file

    monkeypatch.setattr(disk_write, "STAGE_BYTES", STAGE)
    sizes = [1000] * 12 + [5 * STAGE + 7, 1000, 3 * STAGE]
    tensors = {f"t{i}": torch.full((n,), i, dtype=torch.uint8) for i, n in enumerate(sizes)}
    real_pwrite = os.pwrite

    def slow_pwrite(fd, data, offset):
        time.sleep(0.01)
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(disk_write.os, "pwrite", slow_pwrite)
    specs = {k: ("U8", tuple(t.shape)) for k, t in tensors.items()}
    with ShardWriter(tmp_path / "x.safetensors", specs) as w:
        for k, t in tensors.items():
            w.write(k, t)
            assert w._out.stages <= disk_write.StagedFile.STAGES
        w.commit()
    back = load_file(tmp_path / "x.safetensors")
    assert all(torch.equal(back[k], t) for k, t in tensors.items())


def _fsync_by_name(monkeypatch, action):
    """Wrap os.fsync so `action(file name, real fsync, fd)` runs in its place."""
    real = os.fsync

    def fsync(fd):
        return action(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")), real, fd)

    monkeypatch.setattr(os, "fsync", fsync)


def test_a_shard_commit_overlaps_the_next_shard(tiny_src, converted, tmp_path, monkeypatch, tree_hashes):
    """fsync waits for the disk; the next shard's conversion must not wait for it (and the result
    and the journal order stay the same)."""
    import threading
    import time

    from mla_convert.io import reader as convert_mod

    events, lock = [], threading.Lock()

    def log(what):
        with lock:
            events.append(what)

    def slow(name, real, fd):
        if name.endswith(".safetensors.partial") and name.startswith(".model-00001"):
            log("fsync-1 start")
            time.sleep(0.5)
            log("fsync-1 end")
        return real(fd)

    real_read = convert_mod.read_exact

    def read(fd, offset, view, path, name):
        log(f"read {os.path.basename(path)}")
        return real_read(fd, offset, view, path, name)

    _fsync_by_name(monkeypatch, slow)
    monkeypatch.setattr(convert_mod, "read_exact", read)
    convert(tiny_src, tmp_path / "out", Options())
    start, end = events.index("fsync-1 start"), events.index("fsync-1 end")
    assert any(e.startswith("read model-00002") for e in events[start:end]), events
    assert tree_hashes(tmp_path / "out") == tree_hashes(converted["channel-fp8"])


def test_a_failed_background_commit_fails_the_conversion_cleanly(tiny_src, tmp_path, monkeypatch):
    def fail(name, real, fd):
        if name == ".model-00002-of-00004.safetensors.partial":
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd)

    _fsync_by_name(monkeypatch, fail)
    with pytest.raises(
        OutputError, match=re.escape("model-00002-of-00004.safetensors: write failed: Input/output error")
    ):
        convert(tiny_src, tmp_path / "out", Options())
    out = tmp_path / "out"
    assert not list(out.rglob("*.partial")) and not (out / "model-00002-of-00004.safetensors").exists()
    manifest = json.loads((out / "mla-convert-manifest.json").read_text())
    assert manifest["status"] != "complete"


@pytest.mark.parametrize("kernels", ["eager", "native"])
def test_conversion_asks_the_kernel_for_the_next_source_tensor_before_reading_it(
    tiny_src, tmp_path, monkeypatch, kernels
):
    """A cold source is read ahead: each converted tensor's source bytes are requested
    (posix_fadvise WILLNEED) while the tensor before it converts, whether it is then read whole
    (torch kernels) or a chunk of rows at a time into a reused buffer (native kernels)."""
    from mla_convert.io import reader as convert_mod

    events = []
    real_need, real_read = convert_mod.will_need, convert_mod.read_exact
    monkeypatch.setattr(
        convert_mod, "will_need", lambda fd, off, n: (events.append(("need", off, n)), real_need(fd, off, n))
    )

    def read(fd, offset, view, path, name):
        real_read(fd, offset, view, path, name)
        events.append(("read", offset, len(view)))

    monkeypatch.setattr(convert_mod, "read_exact", read)
    convert(tiny_src, tmp_path / "out", Options(), kernels=kernels)
    needs = [e[1:] for e in events if e[0] == "need"]
    reads = [i for i, e in enumerate(events) if e[0] == "read" and e[2] > 4096]  # weights, not scales
    assert len(reads) > 10

    def asked_before(i: int) -> bool:
        _, offset, n = events[i]
        return any(e[0] == "need" and e[1] <= offset and offset + n <= e[1] + e[2] for e in events[:i])

    ahead = [i for i in reads[1:] if asked_before(i)]
    assert len(ahead) >= len(reads) - 1 - 4, "all but each shard's first weight requested early"
    assert all(n > 0 for _, n in needs)


@pytest.mark.parametrize("direct", [True, False])
def test_a_file_continued_after_its_whole_blocks_holds_the_bytes_and_their_sha256(tmp_path, direct):
    """append_at keeps the first bytes (what an earlier, interrupted writer left, cut to whole
    blocks) and writes after them; the sha256 given for them is continued."""
    import hashlib

    data = random.Random(3).randbytes(5 * STAGE + 777)
    path = tmp_path / "f"
    path.write_bytes(data[: 2 * disk_write.ALIGN] + b"junk past the kept blocks")
    f = disk_write.StagedFile(
        path, direct, STAGE, append_at=2 * disk_write.ALIGN, sha256=hashlib.sha256(data[: 2 * disk_write.ALIGN])
    )
    f.write(data[2 * disk_write.ALIGN :])
    assert f.size == len(data)
    assert f.finish() == hashlib.sha256(data).hexdigest()
    assert path.read_bytes() == data


def test_an_in_order_file_left_unfinished_holds_a_prefix_of_what_was_written(tmp_path, monkeypatch):
    """in_order: one I/O thread, stages written in file order, so a writer closed without finish
    (a failure, an interrupt) leaves a prefix of the bytes committed, never a gap: what a later
    run continues from. The I/O thread is slowed so that stages are still queued at the close."""
    data = random.Random(4).randbytes(12 * STAGE)
    slow = disk_write._pwrite_all

    def pwrite_slowly(fd, view, offset):
        time.sleep(0.02)
        slow(fd, view, offset)

    monkeypatch.setattr(disk_write, "_pwrite_all", pwrite_slowly)
    f = disk_write.StagedFile(tmp_path / "f", True, STAGE, in_order=True)
    assert f.IO_THREADS == 1
    f.write(data)
    f.close()
    kept = (tmp_path / "f").read_bytes()
    assert len(kept) % STAGE == 0 and len(kept) < len(data) and data.startswith(kept)
