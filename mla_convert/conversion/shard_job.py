"""One shard job: every tensor of one output shard read by offset, transformed by the chosen
kernels and written, plus the MLA artifact file of each kv_b_proj the shard holds.

A job is a `JobSpec`, small enough to send to a worker process. Its tensors are handled by op
(plan.ops), one small function each; a layer's W_UK_T / W_UV are written in one place, from the
exact value of the SOURCE kv_b_proj (the fp32 dequant of a block-FP8 one, a 16-bit one as it is),
never from the requantized copy.

Two ways through each handler. With the native kernels (kernels.choice.NativeRows) a weight is read
a chunk of rows at a time into a reused buffer and converted straight into the writer's staging
buffers, where it is hashed and written from (io.shard_writer.fill_rows): no torch, no fresh
memory. Otherwise (eager, torch.compile, another device, dtypes the native kernels do not take)
tensors are torch tensors (`_Inputs.get`, `self.kernels`), imported on first use.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mla_convert.conversion.compute import Compute
from mla_convert.conversion.scales import check_int4_shape, check_scale, check_scale_bytes, int_values
from mla_convert.errors import SourceError
from mla_convert.io.buffers import Buffer
from mla_convert.io.headers import read_exact
from mla_convert.io.read_ahead import will_need
from mla_convert.io.shard_writer import BackgroundCommits, ShardWriter
from mla_convert.plan.ops import COPY, FP8_SCALE, INT4_SHAPE, INT4_TO_BF16, QUANT_FP8, TO_BF16, TO_FP8
from mla_convert.plan.planner import OutTensor, Plan, ShardJob, mla_file_rel
from mla_convert.process.interrupts import crash_point
from mla_convert.process.torch_import import import_torch
from mla_convert.process.workers import errors_intact, report
from mla_convert.settings import ProgressFn
from mla_convert.source.checkpoint import SourceCheckpoint, module_of
from mla_runtime.format import ARTIFACT_ST_DTYPE, MlaDims, w_uk_t_name, w_uv_name
from mla_runtime.safetensors_file import nbytes_of

FP8, BF16, F32 = "F8_E4M3", "BF16", "F32"


@dataclass(frozen=True)
class SourceTensor:
    file: str  # relative to the source root
    offset: int  # absolute byte offset in the file
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.dtype, self.shape)


@dataclass(frozen=True)
class Int4Job:
    """An INT4 weight's partners and dims, for its INT4_TO_BF16 and INT4_SHAPE tensors."""

    packed: str
    scale: str
    shape: str  # weight_shape: its values must be [rows, cols]
    rows: int
    cols: int
    group_size: int


@dataclass(frozen=True)
class JobSpec:
    """Everything one shard job needs, small enough to send to a worker process."""

    src_root: str
    out_dir: str
    job: ShardJob
    sources: dict[str, SourceTensor]  # every source tensor the job reads, partner scales included
    scales: dict[str, str]  # FP8 weight -> its scale tensor
    dims: MlaDims
    compute: Compute
    write_io: str  # disk_write mode, resolved once for the output directory: direct or buffered
    int4: dict[str, Int4Job] = field(default_factory=dict)  # an INT4 weight's packed and shape tensor -> it

    def read_bytes(self, t: OutTensor) -> int:
        """The source bytes behind output tensor `t`: its source tensor and that one's block scale
        (an INT4 weight's scale)."""
        scale = self.scales.get(t.source)
        if t.op == INT4_TO_BF16:
            scale = self.int4[t.source].scale
        return self.sources[t.source].nbytes + (self.sources[scale].nbytes if scale else 0)


def job_specs(plan: Plan, out_dir: Path, compute: Compute, write_io: str) -> list[JobSpec]:
    src = plan.source
    specs = []
    for job in plan.shards:
        sources = {}
        for name, rel in plan.inputs_of(job).items():
            info = src.info(name)
            sources[name] = SourceTensor(rel, src.headers[rel].data_start + info.begin, info.dtype, info.shape)
        scales = {n: src.fp8[n].scale.name for n in sources if n in src.fp8}
        int4 = _int4_jobs(src, job)
        specs.append(JobSpec(str(src.root), str(out_dir), job, sources, scales, src.dims, compute, write_io, int4))
    return specs


def _int4_jobs(src: SourceCheckpoint, job: ShardJob) -> dict[str, Int4Job]:
    out = {}
    for t in job.tensors:
        if t.op in (INT4_TO_BF16, INT4_SHAPE):
            w = src.int4[module_of(t.source)]
            g = src.quant.int4.columns_per_scale(w.cols)
            out[t.source] = Int4Job(w.packed.name, w.scale.name, w.shape.name, w.rows, w.cols, g)
    return out


@dataclass(frozen=True)
class _Rows:
    """A 2-D source weight for the native kernels: `at(r0, r1)` is the address of rows [r0, r1) in
    memory (read there on the way, unless the whole weight is already in memory)."""

    at: Callable[[int, int], int]
    rows: int
    cols: int


class _Buffers:
    """The native path's memory, reused by every tensor of every job in this process: a chunk of
    a weight's rows, a whole weight (a kv_b_proj), its block scales, the channel scales computed,
    and the MLA split's W_UK_T and W_UV. `release()` lets go of all of it (a conversion's end)."""

    def __init__(self) -> None:
        self.chunk, self.whole, self.block_scale = Buffer(), Buffer(), Buffer()
        self.channel_scale, self.w_uk_t, self.w_uv = Buffer(), Buffer(), Buffer()

    def release(self) -> None:
        for buf in vars(self).values():
            buf.release()


BUFFERS = _Buffers()


def release_buffers() -> None:
    BUFFERS.release()


class _Inputs:
    """Source files opened once per job. Torch tensors (`get`) are read into fresh memory, never
    cached; the native path reads into the process's reused buffers (`rows`, `whole`, `scale`)."""

    def __init__(self, spec: JobSpec):
        self.root, self.sources, self.files = Path(spec.src_root), spec.sources, {}
        self._chunk, self._whole, self._scale = BUFFERS.chunk, BUFFERS.whole, BUFFERS.block_scale

    def _file(self, rel: str):
        if rel not in self.files:
            try:
                self.files[rel] = open(self.root / rel, "rb")  # noqa: SIM115 (kept open for the job; close())
            except OSError as e:
                raise SourceError(f"{self.root / rel}: cannot open ({e.strerror or e})") from e
        return self.files[rel]

    def at(self, name: str) -> tuple[int, int, Path]:
        """(file descriptor, offset, path) of a source tensor's bytes."""
        t = self.sources[name]
        return self._file(t.file).fileno(), t.offset, self.root / t.file

    def get(self, name: str):
        """A source tensor as a torch tensor, read into fresh memory (freed with the tensor)."""
        import_torch()
        from mla_convert.io.tensors import empty_tensor

        t, (fd, offset, path) = self.sources[name], self.at(name)
        tensor, view = empty_tensor(t.dtype, t.shape)
        read_exact(fd, offset, view, path, name)
        return tensor

    def prefetch(self, name: str) -> None:
        t = self.sources[name]
        will_need(self._file(t.file).fileno(), t.offset, t.nbytes)

    def scale(self, name: str) -> int:
        """A block scale, checked, as float32 (an E8M0 one decoded) in the job's buffer (valid
        until the next call): its address."""
        t, (fd, offset, path) = self.sources[name], self.at(name)
        data = bytearray(t.nbytes)
        read_exact(fd, offset, memoryview(data), path, name)
        f32 = check_scale_bytes(data, t.dtype, path, name)
        self._scale.view(len(f32))[:] = f32
        return self._scale.address

    def whole(self, name: str) -> tuple[memoryview, _Rows]:
        """A 2-D weight read whole into the job's buffer (valid until the next call): its bytes,
        and its rows."""
        t, (fd, offset, path) = self.sources[name], self.at(name)
        view = self._whole.view(t.nbytes)
        read_exact(fd, offset, view, path, name)
        row_bytes, base = nbytes_of(t.dtype, t.shape[1:]), self._whole.address
        return view, _Rows(lambda r0, r1: base + r0 * row_bytes, t.shape[0], t.shape[1])

    def rows(self, name: str) -> _Rows:
        """A 2-D weight read a chunk of rows at a time into the job's buffer, as the kernels ask."""
        t, (fd, offset, path) = self.sources[name], self.at(name)
        row_bytes = nbytes_of(t.dtype, t.shape[1:])

        def at(r0: int, r1: int) -> int:
            read_exact(fd, offset + r0 * row_bytes, self._chunk.view((r1 - r0) * row_bytes), path, name)
            return self._chunk.address

        return _Rows(at, t.shape[0], t.shape[1])

    def close(self) -> None:
        for f in self.files.values():
            f.close()


PendingFiles = list[tuple[str, cf.Future]]  # (relative path, future of its WrittenFile)


def run_shard_job(spec: JobSpec, progress: ProgressFn | None = None) -> list[tuple[str, int, str]]:
    """Convert one output shard (and the MLA artifacts of the kv_b_proj it holds), committed.

    Returns (relative path, size, sha256) of every file written. Memory: the tensor being converted
    (a chunk of its rows, on the native path) and the writers' staging buffers.
    """
    with BackgroundCommits() as commits:
        pending = start_shard_job(spec, commits, progress)
    return committed(pending)


def run_reported_shard_job(spec: JobSpec) -> list[tuple[str, int, str]]:
    """run_shard_job in a worker process, each tensor's source bytes reported to the parent as
    (job file, bytes) as it is done (process.workers.report), so that progress moves with the work;
    an error raised whole in the parent by process.workers.result, as with one worker."""
    with errors_intact():
        return run_shard_job(spec, lambda n: report((spec.job.file, n)))


def committed(pending: PendingFiles) -> list[tuple[str, int, str]]:
    """(relative path, size, sha256) of each file once its commit is done; raises its error."""
    return [(rel, (done := fut.result()).size, done.sha256) for rel, fut in pending]


def start_shard_job(spec: JobSpec, commits: BackgroundCommits, progress: ProgressFn | None = None) -> PendingFiles:
    """run_shard_job, except that the files' commits (fsync, rename) are left to `commits`."""
    job = _ShardJob(spec, commits)
    tensors = spec.job.tensors
    specs = {t.name: (t.dtype, t.shape) for t in tensors}
    try:
        out = Path(spec.out_dir) / spec.job.file
        with ShardWriter(out, specs, background=True, write_mode=spec.write_io) as writer:
            job.writer = writer
            for i, t in enumerate(tensors):
                if i == len(tensors) // 2:
                    crash_point(f"shard-write:{spec.job.file}")
                if i + 1 < len(tensors):  # a cold source: read ahead while this one converts
                    job.inputs.prefetch(tensors[i + 1].source)
                job.write(t)
                if progress and t.op != FP8_SCALE:
                    progress(spec.read_bytes(t))
            job.pending.append((spec.job.file, commits.submit(writer)))
    finally:
        job.inputs.close()
    return job.pending


class _ShardJob:
    """The tensors of one shard, handled one at a time by op (_HANDLERS)."""

    def __init__(self, spec: JobSpec, commits: BackgroundCommits):
        self.spec, self.commits = spec, commits
        self.native = spec.compute.native_rows()  # None: the torch kernels
        self._kernels = None if self.native else spec.compute.kernels()  # checked before the first write
        self.inputs = _Inputs(spec)
        self.writer: ShardWriter | None = None
        self.pending: PendingFiles = []
        self.channel_scale = None  # computed with a weight, written right after it: a tensor, or float32 bytes
        self._scales = BUFFERS.channel_scale  # the native kernels' channel scales
        self._artifacts = (BUFFERS.w_uk_t, BUFFERS.w_uv)  # the native split's W_UK_T, W_UV

    @property
    def kernels(self):
        """The torch kernels (kernels.select.Kernels), for what the native ones do not cover."""
        if self._kernels is None:
            self._kernels = self.spec.compute.kernels()
        return self._kernels

    def write(self, t: OutTensor) -> None:
        layer = t.layer if t.op != FP8_SCALE else None
        if t.op == COPY and layer is None:  # bit for bit, read straight into the writer: never decoded
            fd, offset, path = self.inputs.at(t.source)
            self.writer.copy_from(t.name, fd, offset, path)
            return
        _HANDLERS[t.op](self, t, layer)

    def _copy(self, t: OutTensor, layer: int | None) -> None:
        src = self.spec.sources[t.source]
        if self.native and src.dtype == BF16:  # a bf16 kv_b_proj: its artifacts are bit-exact splits of it
            data, _ = self._native_rows(t.source, layer, None)
            self.writer.write_bytes(t.name, data, src.dtype, src.shape)
            return
        w = self.inputs.get(t.source)  # a 16-bit kv_b_proj: its artifacts are bit-exact splits of it
        self._mla_artifacts(layer, w)
        self.writer.write(t.name, w)

    def _scale(self, t: OutTensor, layer: int | None) -> None:
        if isinstance(self.channel_scale, memoryview):
            self.writer.write_bytes(t.name, self.channel_scale, F32, t.shape)
        else:
            self.writer.write(t.name, self.channel_scale)
        self.channel_scale = None

    def _quantize(self, t: OutTensor, layer: int | None) -> None:
        src = self.spec.sources[t.source]
        if self.native and src.dtype == BF16 and len(src.shape) == 2:
            _, rows = self._native_rows(t.source, layer, None)
            k = rows.cols

            def kernel(w: int, q: int, scales: int, r0: int, r1: int) -> None:
                self.native.bf16_channel_fp8(w, k, q, scales, r0, r1)

            self._native_channel_fp8(t, rows, kernel)
            return
        w = self.inputs.get(t.source)
        self._mla_artifacts(layer, w)
        q, self.channel_scale = self.kernels.quantize(w)
        self.writer.write(t.name, q)

    def _block_fp8(self, t: OutTensor, layer: int | None) -> None:
        if self.native:
            s = self.inputs.scale(self.spec.scales[t.source])
            _, rows = self._native_rows(t.source, layer, s)
            k = rows.cols
            if t.op == TO_BF16:

                def fill(out: int, r0: int, r1: int) -> None:
                    self.native.bf16_rows(rows.at(r0, r1), s, k, out, r0, r1)

                self.writer.fill_rows(t.name, BF16, (rows.rows, k), fill)
            else:

                def kernel(w: int, q: int, scales: int, r0: int, r1: int) -> None:
                    self.native.channel_fp8(w, s, k, q, scales, r0, r1)

                self._native_channel_fp8(t, rows, kernel)
            return
        w, s = self._fp8_inputs(t.source)
        if layer is not None:
            self._mla_artifacts(layer, self.kernels.dequant_fp32(w, s))
        if t.op == TO_BF16:
            self.writer.write(t.name, self.kernels.to_bf16(w, s))
        else:
            q, self.channel_scale = self.kernels.to_channel_fp8(w, s)
            self.writer.write(t.name, q)

    def _int4_to_bf16(self, t: OutTensor, layer: int | None) -> None:
        """The exact fp32 dequant of an INT4 weight, rounded once to bf16 (torch: the native kernels
        do not take INT4)."""
        from mla_convert.kernels import numerics

        j = self._int4_checked(t.source)
        w = numerics.dequantize_int4(self.inputs.get(j.packed), self.inputs.get(j.scale), j.cols, j.group_size)
        self._mla_artifacts(layer, w)
        self.writer.write(t.name, numerics.to_bf16(w))

    def _int4_shape(self, t: OutTensor, layer: int | None) -> None:
        """An INT4 weight's weight_shape, copied once its values are its packed weight's [N, K]."""
        self._int4_checked(t.source)
        fd, offset, path = self.inputs.at(t.source)
        self.writer.copy_from(t.name, fd, offset, path)

    def _int4_checked(self, name: str) -> Int4Job:
        j = self.spec.int4[name]
        shape, (fd, offset, path) = self.spec.sources[j.shape], self.inputs.at(j.shape)
        data = bytearray(shape.nbytes)
        read_exact(fd, offset, memoryview(data), path, j.shape)
        check_int4_shape(int_values(data, shape.dtype), (j.rows, j.cols), path, j.shape, j.packed)
        return j

    def _fp8_inputs(self, name: str):
        scale_name = self.spec.scales[name]
        where = f"{self.spec.src_root}/{self.spec.sources[scale_name].file}"
        scale = check_scale(self.inputs.get(scale_name), where, scale_name)
        return self.inputs.get(name), scale

    # -- the native path's plumbing -------------------------------------------------------------------

    def _native_rows(self, name: str, layer: int | None, scale: int | None) -> tuple[memoryview | None, _Rows]:
        """A weight's rows for the native kernels: read a chunk at a time, or (a kv_b_proj, whose
        artifacts are split from it first: block FP8 with its float32 scales at `scale`, else bf16)
        whole, once; and, when whole, its bytes."""
        if layer is None:
            return None, self.inputs.rows(name)
        data, rows = self.inputs.whole(name)
        w, dims = rows.at(0, 0), self.spec.dims
        if scale is None:
            self._native_artifacts(layer, lambda uk_t, uv: self.native.split_bf16(w, dims, uk_t, uv))
        else:
            self._native_artifacts(layer, lambda uk_t, uv: self.native.split_fp8(w, scale, dims, uk_t, uv))
        return data, rows

    def _native_channel_fp8(self, t: OutTensor, rows: _Rows, kernel) -> None:
        """Codes into the writer's stages, channel scales into the job's buffer (written next)."""
        scales = self._scales.view(4 * rows.rows)
        base = self._scales.address

        def fill(q: int, r0: int, r1: int) -> None:
            kernel(rows.at(r0, r1), q, base + 4 * r0, r0, r1)

        self.writer.fill_rows(t.name, FP8, (rows.rows, rows.cols), fill)
        self.channel_scale = scales

    def _native_artifacts(self, layer: int, split: Callable[[int, int], None]) -> None:
        """The layer's W_UK_T / W_UV (bf16) split by the native kernels into the job's buffers."""
        dims = self.spec.dims
        uk_t, uv = (buf.view(nbytes_of(ARTIFACT_ST_DTYPE, shape)) for buf, shape in
                    zip(self._artifacts, (dims.w_uk_t_shape(), dims.w_uv_shape()), strict=True))  # fmt: skip
        split(self._artifacts[0].address, self._artifacts[1].address)
        self._write_artifacts(layer, lambda w: (
            w.write_bytes(w_uk_t_name(layer), uk_t, ARTIFACT_ST_DTYPE, dims.w_uk_t_shape()),
            w.write_bytes(w_uv_name(layer), uv, ARTIFACT_ST_DTYPE, dims.w_uv_shape()),
        ))  # fmt: skip

    # -- the artifacts --------------------------------------------------------------------------------

    def _mla_artifacts(self, layer: int | None, kv_b_exact) -> None:
        """The layer's W_UK_T / W_UV (bf16) from the exact value of its source kv_b_proj, in their
        own file, committed with the shard's."""
        if layer is None:
            return
        torch = import_torch()
        from mla_runtime.layout import split_kv_b_proj

        w_uk_t, w_uv = split_kv_b_proj(kv_b_exact, self.spec.dims, torch.bfloat16)
        self._write_artifacts(layer, lambda w: (w.write(w_uk_t_name(layer), w_uk_t), w.write(w_uv_name(layer), w_uv)))

    def _write_artifacts(self, layer: int, write: Callable[[ShardWriter], object]) -> None:
        dims, rel = self.spec.dims, mla_file_rel(layer)
        specs = {
            w_uk_t_name(layer): (ARTIFACT_ST_DTYPE, dims.w_uk_t_shape()),
            w_uv_name(layer): (ARTIFACT_ST_DTYPE, dims.w_uv_shape()),
        }
        with ShardWriter(Path(self.spec.out_dir) / rel, specs, write_mode=self.spec.write_io) as w:
            write(w)
            self.pending.append((rel, self.commits.submit(w)))


_HANDLERS: dict[str, Callable[[_ShardJob, OutTensor, int | None], None]] = {
    COPY: _ShardJob._copy,
    FP8_SCALE: _ShardJob._scale,
    QUANT_FP8: _ShardJob._quantize,
    TO_FP8: _ShardJob._block_fp8,
    TO_BF16: _ShardJob._block_fp8,
    INT4_TO_BF16: _ShardJob._int4_to_bf16,
    INT4_SHAPE: _ShardJob._int4_shape,
}
