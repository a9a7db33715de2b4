"""verify, data pass: one file read once, front to back.

Every byte goes to sha256 (integrity, on a helper thread) and each tensor is read by offset into a
reused buffer (buffers) and checked from it, so memory holds about one tensor of the file at a
time. Each tensor goes to the values checks (values: the format's and the target's) and to the
check of its role in the conversion: the comparison its transform names (comparisons), and the MLA
check once an artifact file's tensors are all read. Source tensors, and a weight's scale stored
elsewhere, are read on demand by offset, in row chunks, through the file's one io.reader.Reader; a
file that will not open or ends early is a failed check.

Each check runs first on the bytes read, in its native form (values, native_pass), where the
native readers passed their probes; a check that fails there, or one they do not cover, runs on
torch tensors over the same bytes (values, against_source, mla), which describe what failed. torch
is imported only then, so a verify whose checks all pass natively imports no torch.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from mla_convert.io.read_ahead import will_need
from mla_convert.io.reader import Reader, ReadFailed, read_exact
from mla_convert.kernels.transforms import PLAN_TRANSFORMS
from mla_convert.plan.ops import FP8_SCALE
from mla_convert.process.torch_import import import_torch
from mla_convert.verification.buffers import Lease, ReadBuffers, thread_buffers
from mla_convert.verification.comparisons import Comparison, comparison
from mla_convert.verification.native_pass import NativePass
from mla_convert.verification.readers import reader_backend
from mla_convert.verification.report import INTEGRITY, MLA, SOURCE, FileTally, Tally
from mla_convert.verification.rows import RowReader
from mla_convert.verification.tasks import FileResult, FileTask, TensorTask
from mla_convert.verification.values import ValueChecks
from mla_runtime.safetensors_file import HASH_CHUNK, ShardHeader, TensorInfo

if TYPE_CHECKING:
    import torch

READ_AHEAD_BYTES = 128 * 1024 * 1024  # asked of the kernel past the tensor being read
BY_ROWS_BYTES = ReadBuffers.REUSE_BYTES  # a larger tensor is checked as it is read, where its checks allow
ROWS_BYTES = 64 * 1024 * 1024  # ... this much at a time, in whole rows


def run_file_task(task: FileTask, progress: Callable[[int], None] | None = None, *, hashed: bool = True) -> FileResult:
    """Hash one file and check every tensor in it; never raises for a bad file (records it).
    `hashed` False: its sha256 is known (the converter hashed it as it wrote it), only the checks
    run (FileResult.sha256 None)."""
    tally = Tally()
    h = _BackgroundSha256() if hashed else _Counted()
    checks = _FileChecks(task, tally, thread_buffers())
    try:
        with open(Path(task.root) / task.rel, "rb") as f:
            if task.header is not None:
                _hash_and_check_tensors(f, task.header, h, checks, progress)
            while chunk := f.read(HASH_CHUNK):
                h.update(chunk)
        checks.finish()
    except FileNotFoundError:
        return FileResult(task.rel, None, None, tally)
    except (OSError, ReadFailed) as e:
        tally.fail(INTEGRITY, "read", task.rel, expected="a readable file", found=str(e))
        return FileResult(task.rel, h.nbytes, None, tally)
    finally:
        checks.close()
        h.close()
    tally.bytes_read += h.nbytes
    return FileResult(task.rel, h.nbytes, h.hexdigest(), tally)


def _hash_and_check_tensors(f, header: ShardHeader, h: _BackgroundSha256, checks: _FileChecks, progress) -> None:
    """The header and then each tensor of the open file `f`, in file order: read once, hashed and
    checked from the same buffer; `f` is left after the last tensor. A tensor over BY_ROWS_BYTES
    whose checks can be decided a run of rows at a time is read, hashed and checked ROWS_BYTES at a
    time in the reused buffers (an embedding is not held whole); where a run does not pass, the
    tensor is read whole and checked as any other, which describes what failed."""
    h.update(f.read(header.data_start))
    end = header.data_start
    for info in sorted(header.tensors.values(), key=lambda t: t.begin):
        offset = header.data_start + info.begin
        by_rows = checks.by_rows(info) if info.nbytes > BY_ROWS_BYTES else None
        hashed = _hash_and_check_rows(f, offset, info, h, checks.buffers, by_rows, progress) if by_rows else 0
        if by_rows is None or not by_rows.finish():
            # a cold file: this tensor and what follows are read in large requests, and the disk
            # goes on reading while this one is hashed and checked
            will_need(f.fileno(), offset, info.nbytes + READ_AHEAD_BYTES)
            buf = checks.buffers.take(info.nbytes)
            read_exact(f.fileno(), offset, buf, f.name, info.name)
            h.update(buf[hashed:])
            checks.tensor(info, buf)
            del buf
            if progress:
                progress(info.nbytes - hashed)
        end = offset + info.nbytes
    f.seek(end)


def _hash_and_check_rows(f, offset: int, info: TensorInfo, h, buffers: ReadBuffers, by_rows: _ByRows, progress) -> int:
    """A tensor read, hashed and checked (`by_rows`) ROWS_BYTES at a time, in whole rows, until a
    run does not pass or cannot be read; returns the bytes hashed (all of them where every run passed)."""
    row_bytes = info.nbytes // info.shape[0]
    step = max(1, ROWS_BYTES // row_bytes) * row_bytes
    will_need(f.fileno(), offset, info.nbytes + READ_AHEAD_BYTES)
    for start in range(0, info.nbytes, step):
        nbytes = min(step, info.nbytes - start)
        buf = buffers.take(nbytes)
        try:
            read_exact(f.fileno(), offset + start, buf, f.name, info.name)
        except ReadFailed:
            by_rows.passed = False  # read whole, which says where the file failed as it says of any tensor
            return start
        h.update(buf)
        if progress:
            progress(nbytes)
        if not by_rows.rows(buf, start, nbytes // row_bytes):
            return start + nbytes
    return info.nbytes


class _BackgroundSha256:
    """sha256 on a helper thread (hashlib drops the GIL), in order, while the caller checks the
    tensor just read; at most one buffer waits, so memory stays at two tensors."""

    def __init__(self) -> None:
        self._h = hashlib.sha256()
        self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="verify-sha256")
        self._last: cf.Future | None = None
        self.nbytes = 0  # handed to update so far

    def update(self, data) -> None:
        if self._last is not None:
            self._last.result()
        self._last = self._pool.submit(self._h.update, data)
        self.nbytes += len(data)

    def hexdigest(self) -> str:
        self.close()
        return self._h.hexdigest()

    def close(self) -> None:
        if self._last is not None:
            self._last.result()
            self._last = None
        self._pool.shutdown()


class _Counted:
    """_BackgroundSha256's place where the file is not hashed again: the bytes are only counted."""

    def __init__(self) -> None:
        self.nbytes = 0

    def update(self, data) -> None:
        self.nbytes += len(data)

    def hexdigest(self) -> None:
        return None

    def close(self) -> None:
        pass


class _FileChecks:
    """The per-tensor checks of one file, fed in file order: each tensor goes to the values checks
    and to the check of its role, and an artifact file's tensors are kept for the MLA check in
    finish(). A tensor kept for later (an MLA artifact, a weight waiting for its scale) leases its
    buffer until that check is done. Each check tries the native pass first, then torch."""

    def __init__(self, task: FileTask, tally: Tally, buffers: ReadBuffers):
        self.task = task
        self.out = FileTally(tally, task.rel)
        self.buffers = buffers  # what the file's tensors are read into
        self.reader = Reader()  # the source tensors and partner scales, by offset
        self.native = None
        if task.header is not None and reader_backend().name == "native":
            self.native = NativePass(self.out, self.reader, fp8_max=task.fp8_max, block=task.block, dims=task.dims,
                                     rope_dim=task.rope_dim)  # fmt: skip
        self.values = ValueChecks(task.value_checks, self.out, task.fp8_max, self.native)
        self._torch_parts = None  # (RowReader, SourceComparisons), made when the torch path is first needed
        self.pending: dict[str, tuple[TensorInfo, memoryview]] = {}  # scale name -> its weight
        self.artifacts: dict[str, tuple[TensorInfo, memoryview]] = {}
        self.leases: dict[str, Lease] = {}  # a kept tensor's name -> the lease on its buffer

    def tensor(self, info: TensorInfo, buf: memoryview) -> None:
        """Check one tensor, read into `buf` by self.buffers."""
        job = self.task.tensors.get(info.name)
        self.values.run(info, buf, job is not None and job.op == FP8_SCALE, lambda: _tensor(info, buf))
        kept = False
        if job is not None:
            try:
                kept = self._role(info, buf, job)
            except ReadFailed as e:
                group = SOURCE if job.source else INTEGRITY
                self.out.fail(group, "read", info.name, expected="readable input", found=str(e))
        if self.task.mla is not None:
            self.artifacts[info.name] = (info, buf)
            kept = True
        if kept:
            self.leases[info.name] = self.buffers.lease(buf, owner=info.name)

    def by_rows(self, info: TensorInfo) -> _ByRows | None:
        """The checks `tensor` would run on this tensor, decided a run of its rows at a time as it
        is read, where their native forms allow it (values.ValueCheck.by_rows,
        comparisons.Comparison.by_parts): not an artifact file's tensor (kept for the MLA check), a
        scale, or a weight compared with its scale. None: it is read whole."""
        if self.native is None or self.task.mla is not None or not info.shape or not info.nbytes:
            return None
        job = self.task.tensors.get(info.name)
        if (job is not None and job.op == FP8_SCALE) or not self.values.by_rows(info, False):
            return None
        t = PLAN_TRANSFORMS.get(job.op) if job is not None and job.source is not None else None
        check = comparison(t.verify) if t is not None else None
        if check is not None and (check.by_parts is None or check.native is None or check.partners_scale):
            return None
        return _ByRows(self, info, job, check)

    def finish(self) -> None:
        """The checks that wait for the whole file: an artifact file's MLA check."""
        if self.task.mla is not None:
            task = self.task
            try:
                if self.native and self.native.mla(task.mla, self.artifacts):
                    return
                from mla_convert.verification.mla import MlaChecks

                mla = MlaChecks(self._torch()[0], self.out, dims=task.dims, rope_dim=task.rope_dim, block=task.block)
                mla.layer(task.mla, {name: _tensor(i, b) for name, (i, b) in self.artifacts.items()})
            except ReadFailed as e:
                self.out.fail(MLA, "read", expected="readable kv_b_proj", found=str(e))

    def close(self) -> None:
        """Drop what the checks kept, release its buffers for reuse, and close the source files."""
        self.pending.clear()
        self.artifacts.clear()
        for lease in self.leases.values():
            lease.release()
        self.leases.clear()
        self.reader.close()

    def _torch(self):
        """The torch path's reader and source comparisons, made on first use."""
        if self._torch_parts is None:
            import_torch()
            from mla_convert.verification.against_source import SourceComparisons

            reader = RowReader(self.reader)
            source = SourceComparisons(reader, self.out, block=self.task.block, fp8_max=self.task.fp8_max)
            self._torch_parts = (reader, source)
        return self._torch_parts

    def _role(self, info: TensorInfo, buf: memoryview, job: TensorTask) -> bool:
        """The checks of the tensor's role in the conversion: the comparison its transform names
        (Transform.verify, comparisons), a weight with its scale once both are read. Returns
        whether `buf` is kept for later."""
        if job.op == FP8_SCALE:
            if info.name in self.pending:
                w_info, q = self.pending.pop(info.name)
                try:
                    w_job = self.task.tensors[w_info.name]
                    self._compare(comparison(PLAN_TRANSFORMS[w_job.op].verify), w_info, q, (info, buf), w_job)
                finally:
                    self._drop(w_info.name)
            return False
        t = PLAN_TRANSFORMS.get(job.op)
        check = comparison(t.verify) if t is not None else None
        if check is None or job.source is None:
            return False
        if check.partners_scale:
            if job.scale is None:
                return False  # its scale does not match its expectation: the structure checks said so
            if job.scale_name in self.task.tensors and self.task.header.tensors[job.scale_name].begin > info.begin:
                self.pending[job.scale_name] = (info, buf)  # checked when its scale streams by
                return True
        self._compare(check, info, buf, None, job)
        return False

    def _compare(self, check: Comparison, info: TensorInfo, buf: memoryview, scale, job: TensorTask) -> None:
        """A tensor against its source: natively where the comparison has a native form and it
        passes, else in torch; `scale`: its scale's (info, bytes) where read (else by job.scale)."""
        native = self.native
        if native and check.native is not None and check.native(native, info, buf, scale and scale[1], job):
            self.out.tally.ok(SOURCE, len(check.checks))
            return
        reader, source = self._torch()
        s = None
        if check.partners_scale:
            s = reader.rows(job.scale) if scale is None else _tensor(*scale)
        check.torch(source, info, _tensor(info, buf), s, job)

    def _drop(self, name: str) -> None:
        """A kept tensor is no longer needed: its buffer may be read into again."""
        self.leases.pop(name).release()


class _ByRows:
    """One tensor's checks (_FileChecks.by_rows), their native forms run on each run of its rows
    as it is read; where every run passed, `finish` counts them as `_FileChecks.tensor` would."""

    def __init__(self, checks: _FileChecks, info: TensorInfo, job: TensorTask | None, check: Comparison | None):
        self.checks, self.info, self.job, self.check = checks, info, job, check
        self.passed = True

    def rows(self, view: memoryview, start: int, rows: int) -> bool:
        """`rows` rows of the tensor, its bytes from `start`: whether every check passed there."""
        c = self.checks
        try:
            self.passed = c.values.rows_pass(self.info, view, rows, False) and (
                self.check is None or self.check.by_parts(c.native, self.info, view, start, self.job)
            )
        except ReadFailed:  # a source that will not read: the tensor is read whole, and that recorded
            self.passed = False
        return self.passed

    def finish(self) -> bool:
        """Whether every run passed (its checks then counted); False: check the tensor whole."""
        if self.passed:
            self.checks.values.count(self.info, False)
            if self.check is not None:
                self.checks.out.tally.ok(SOURCE, len(self.check.checks))
        return self.passed


def _tensor(info: TensorInfo, buf: memoryview) -> torch.Tensor:
    """The torch tensor over a tensor's bytes (no copy), for the torch path."""
    import_torch()
    from mla_convert.io.tensors import TORCH_DTYPES
    from mla_convert.verification.rows import decode

    return decode(buf, TORCH_DTYPES[info.dtype], info.shape)
