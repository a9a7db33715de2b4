"""verify, data pass: one file read once, front to back.

Every byte goes to sha256 (integrity, on a helper thread) and each tensor is read into a reused
buffer (buffers) and checked from it, so memory holds about one tensor of the file at a time. Each
tensor goes to the values checks and to the check of its role in the conversion: the comparison
with its source, and the MLA check once an artifact file's tensors are all read. Source tensors,
and a weight's channel scale stored elsewhere, are read on demand by offset, in row chunks.

Each check runs first on the bytes read, in the native kernels (native_pass), where the native
readers passed their probes; a check that fails there, or one they do not cover, runs on torch
tensors over the same bytes (values, against_source, mla), which describe what failed. torch is
imported only then, so a verify whose checks all pass natively imports no torch.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from mla_convert.io.read_ahead import will_need
from mla_convert.kernels.transforms import PLAN_TRANSFORMS
from mla_convert.plan.ops import FP8_SCALE
from mla_convert.process.torch_import import import_torch
from mla_convert.verification.buffers import Lease, ReadBuffers, thread_buffers
from mla_convert.verification.native_pass import NativePass
from mla_convert.verification.readers import fp8_readers
from mla_convert.verification.report import INTEGRITY, MLA, SOURCE, FileTally, Tally
from mla_convert.verification.rows import ReadError, RowReader
from mla_convert.verification.tasks import FileResult, FileTask, TensorJob
from mla_runtime.safetensors_file import HASH_CHUNK, ShardHeader, TensorInfo

if TYPE_CHECKING:
    import torch

READ_AHEAD_BYTES = 128 * 1024 * 1024  # asked of the kernel past the tensor being read


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
    except (OSError, ReadError) as e:
        tally.fail(INTEGRITY, "read", task.rel, expected="a readable file", found=str(e))
        return FileResult(task.rel, h.nbytes, None, tally)
    finally:
        checks.close()
        h.close()
    tally.bytes_read += h.nbytes
    return FileResult(task.rel, h.nbytes, h.hexdigest(), tally)


def _hash_and_check_tensors(f, header: ShardHeader, h: _BackgroundSha256, checks: _FileChecks, progress) -> None:
    """The header and then each tensor of the open file `f`, in file order: read once, hashed and
    checked from the same buffer."""
    h.update(f.read(header.data_start))
    for info in sorted(header.tensors.values(), key=lambda t: t.begin):
        # a cold file: this tensor and what follows are read in large requests, and the disk goes
        # on reading while this one is hashed and checked
        will_need(f.fileno(), header.data_start + info.begin, info.nbytes + READ_AHEAD_BYTES)
        buf = checks.buffers.read(f, info.nbytes)
        h.update(buf)
        if len(buf) != info.nbytes:
            raise ReadError(f"short read of {info.name!r}: the file changed or is truncated")
        checks.tensor(info, buf)
        del buf
        if progress:
            progress(info.nbytes)


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
        self.native = None
        if task.header is not None and fp8_readers().name == "native":
            self.native = NativePass(self.out, fp8_max=task.fp8_max, signed_zero=task.signed_zero,
                                     block=task.block, dims=task.dims, rope_dim=task.rope_dim)  # fmt: skip
        self._torch_parts = None  # (RowReader, SourceComparisons), made when the torch path is first needed
        self.pending: dict[str, tuple[TensorInfo, memoryview]] = {}  # scale name -> its FP8 weight
        self.artifacts: dict[str, tuple[TensorInfo, memoryview]] = {}
        self.leases: dict[str, Lease] = {}  # a kept tensor's name -> the lease on its buffer

    def tensor(self, info: TensorInfo, buf: memoryview) -> None:
        """Check one tensor, read into `buf` by self.buffers."""
        if not (self.native and self.native.values(info, buf)):
            from mla_convert.verification.values import check_values

            check_values(info, _tensor(info, buf), self.out, self.task.fp8_max, self.task.signed_zero)
        kept = False
        job = self.task.tensors.get(info.name)
        if job is not None:
            try:
                kept = self._role(info, buf, job)
            except ReadError as e:
                group = SOURCE if job.source else INTEGRITY
                self.out.fail(group, "read", info.name, expected="readable input", found=str(e))
        if self.task.mla is not None:
            self.artifacts[info.name] = (info, buf)
            kept = True
        if kept:
            self.leases[info.name] = self.buffers.lease(buf, owner=info.name)

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
            except ReadError as e:
                self.out.fail(MLA, "read", expected="readable kv_b_proj", found=str(e))

    def close(self) -> None:
        """Drop what the checks kept, release its buffers for reuse, and close the source files."""
        self.pending.clear()
        self.artifacts.clear()
        for lease in self.leases.values():
            lease.release()
        self.leases.clear()
        if self.native:
            self.native.close()
        if self._torch_parts:
            self._torch_parts[0].close()

    def _torch(self):
        """The torch path's reader and source comparisons, made on first use."""
        if self._torch_parts is None:
            import_torch()
            from mla_convert.verification.against_source import SourceComparisons

            reader = RowReader()
            source = SourceComparisons(reader, self.out, block=self.task.block, fp8_max=self.task.fp8_max)
            self._torch_parts = (reader, source)
        return self._torch_parts

    def _role(self, info: TensorInfo, buf: memoryview, job: TensorJob) -> bool:
        """The checks of the tensor's role in the conversion: the comparison its transform names
        (Transform.verify). Returns whether `buf` is kept for later."""
        native = self.native
        check = PLAN_TRANSFORMS[job.op].verify if job.op in PLAN_TRANSFORMS else None
        if check == "channel_fp8" and job.source is not None and job.scale is not None:
            if job.scale_name in self.task.tensors and self.task.header.tensors[job.scale_name].begin > info.begin:
                self.pending[job.scale_name] = (info, buf)  # checked when its scale streams by
                return True
            self._channel_fp8(info, buf, None, job)
        elif job.op == FP8_SCALE:
            if not (native and native.channel_scale(info, buf)):
                from mla_convert.verification.values import check_channel_scale

                check_channel_scale(info, _tensor(info, buf), self.out)
            if info.name in self.pending:
                w_info, q = self.pending.pop(info.name)
                try:
                    self._channel_fp8(w_info, q, (info, buf), self.task.tensors[w_info.name])
                finally:
                    self._drop(w_info.name)
        elif check in ("bf16", "int4_bf16") and job.source is not None:
            getattr(self._torch()[1], check)(info, _tensor(info, buf), job)
        elif check == "copy" and job.source is not None and not (native and native.copy(info, buf, job)):
            self._torch()[1].copy(info, _tensor(info, buf), job)
        return False

    def _channel_fp8(self, info: TensorInfo, q: memoryview, scale, job: TensorJob) -> None:
        """A channel-FP8 weight against its source; `scale`: its scale's (info, bytes) if read."""
        if self.native and self.native.channel_fp8(info, q, None if scale is None else scale[1], job):
            return
        reader, source = self._torch()
        s = reader.rows(job.scale) if scale is None else _tensor(*scale)
        source.channel_fp8(info, _tensor(info, q), s, job)

    def _drop(self, name: str) -> None:
        """A kept tensor is no longer needed: its buffer may be read into again."""
        self.leases.pop(name).release()


def _tensor(info: TensorInfo, buf: memoryview) -> torch.Tensor:
    """The torch tensor over a tensor's bytes (no copy), for the torch path."""
    import_torch()
    from mla_convert.io.tensors import TORCH_DTYPES
    from mla_convert.verification.rows import decode

    return decode(buf, TORCH_DTYPES[info.dtype], info.shape)
