"""One shard job: every tensor of one output shard read by offset, transformed by the chosen
kernels and written, plus the MLA artifact file of each kv_b_proj the shard holds.

A job is a `JobSpec`, small enough to send to a worker process. Its tensors are handled by op
(plan.ops), one small function each; a layer's W_UK_T / W_UV are written in one place, from the
exact value of the SOURCE kv_b_proj (the fp32 dequant of a block-FP8 one, a 16-bit one as it is),
never from the requantized copy.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mla_convert.conversion.compute import Compute
from mla_convert.conversion.crash_points import crash_point
from mla_convert.conversion.scales import check_int4_shape, check_scale
from mla_convert.errors import SourceError
from mla_convert.io.read_ahead import will_need
from mla_convert.io.shard_writer import BackgroundCommits, ShardWriter
from mla_convert.io.tensors import read_chunks, read_tensor
from mla_convert.kernels import numerics
from mla_convert.kernels.select import Kernels
from mla_convert.plan.ops import COPY, FP8_SCALE, INT4_SHAPE, INT4_TO_BF16, QUANT_FP8, TO_BF16, TO_FP8
from mla_convert.plan.planner import OutTensor, Plan, ShardJob, mla_file_rel
from mla_convert.settings import ProgressFn
from mla_convert.source.checkpoint import SourceCheckpoint, module_of
from mla_runtime.format import ARTIFACT_ST_DTYPE, MlaDims, w_uk_t_name, w_uv_name
from mla_runtime.layout import split_kv_b_proj
from mla_runtime.safetensors_file import nbytes_of


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


class _Inputs:
    """Source files opened once per job; each tensor is read into fresh memory, never cached."""

    def __init__(self, spec: JobSpec):
        self.root, self.sources, self.files = Path(spec.src_root), spec.sources, {}

    def _file(self, rel: str):
        if rel not in self.files:
            try:
                self.files[rel] = open(self.root / rel, "rb")  # noqa: SIM115 (kept open for the job; close())
            except OSError as e:
                raise SourceError(f"{self.root / rel}: cannot open ({e.strerror or e})") from e
        return self.files[rel]

    def get(self, name: str) -> torch.Tensor:
        t = self.sources[name]
        return read_tensor(self._file(t.file), t.offset, t.dtype, t.shape, self.root / t.file, name)

    def prefetch(self, name: str) -> None:
        t = self.sources[name]
        will_need(self._file(t.file).fileno(), t.offset, t.nbytes)

    def chunks(self, name: str):
        t = self.sources[name]
        return read_chunks(self._file(t.file), t.offset, t.nbytes, self.root / t.file, name)

    def close(self) -> None:
        for f in self.files.values():
            f.close()


PendingFiles = list[tuple[str, cf.Future]]  # (relative path, future of its WrittenFile)


def run_shard_job(spec: JobSpec) -> list[tuple[str, int, str]]:
    """Convert one output shard (and the MLA artifacts of the kv_b_proj it holds), committed.

    Returns (relative path, size, sha256) of every file written. Memory: a few tensors at a time
    (the one being converted and at most ShardWriter.INFLIGHT_BYTES waiting to be written).
    """
    with BackgroundCommits() as commits:
        pending = start_shard_job(spec, commits)
    return committed(pending)


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
        self.kernels: Kernels = spec.compute.kernels()
        self.inputs = _Inputs(spec)
        self.writer: ShardWriter | None = None
        self.pending: PendingFiles = []
        self.channel_scale: torch.Tensor | None = None  # computed with a weight, written right after it

    def write(self, t: OutTensor) -> None:
        layer = t.layer if t.op != FP8_SCALE else None
        if t.op == COPY and layer is None:  # bit for bit, streamed: never decoded
            self.writer.write_raw(t.name, self.inputs.chunks(t.source))
            return
        _HANDLERS[t.op](self, t, layer)

    def _copy(self, t: OutTensor, layer: int | None) -> None:
        w = self.inputs.get(t.source)  # a 16-bit kv_b_proj: its artifacts are bit-exact splits of it
        self._mla_artifacts(layer, w)
        self.writer.write(t.name, w)

    def _scale(self, t: OutTensor, layer: int | None) -> None:
        self.writer.write(t.name, self.channel_scale)
        self.channel_scale = None

    def _quantize(self, t: OutTensor, layer: int | None) -> None:
        w = self.inputs.get(t.source)
        self._mla_artifacts(layer, w)
        q, self.channel_scale = self.kernels.quantize(w)
        self.writer.write(t.name, q)

    def _block_fp8(self, t: OutTensor, layer: int | None) -> None:
        w, s = self._fp8_inputs(t.source)
        if layer is not None:
            self._mla_artifacts(layer, self.kernels.dequant_fp32(w, s))
        if t.op == TO_BF16:
            self.writer.write(t.name, self.kernels.to_bf16(w, s))
        else:
            q, self.channel_scale = self.kernels.to_channel_fp8(w, s)
            self.writer.write(t.name, q)

    def _int4_to_bf16(self, t: OutTensor, layer: int | None) -> None:
        """The exact fp32 dequant of an INT4 weight, rounded once to bf16."""
        j = self._int4_checked(t.source)
        w = numerics.dequantize_int4(self.inputs.get(j.packed), self.inputs.get(j.scale), j.cols, j.group_size)
        self._mla_artifacts(layer, w)
        self.writer.write(t.name, numerics.to_bf16(w))

    def _int4_shape(self, t: OutTensor, layer: int | None) -> None:
        """An INT4 weight's weight_shape, copied once its values are its packed weight's [N, K]."""
        self._int4_checked(t.source)
        self.writer.write_raw(t.name, self.inputs.chunks(t.source))

    def _int4_checked(self, name: str) -> Int4Job:
        j = self.spec.int4[name]
        where = f"{self.spec.src_root}/{self.spec.sources[j.shape].file}"
        check_int4_shape(self.inputs.get(j.shape), (j.rows, j.cols), where, j.shape, j.packed)
        return j

    def _fp8_inputs(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        scale_name = self.spec.scales[name]
        where = f"{self.spec.src_root}/{self.spec.sources[scale_name].file}"
        scale = check_scale(self.inputs.get(scale_name), where, scale_name)
        return self.inputs.get(name), scale

    def _mla_artifacts(self, layer: int | None, kv_b_exact: torch.Tensor) -> None:
        """The layer's W_UK_T / W_UV (bf16) from the exact value of its source kv_b_proj, in their
        own file, committed with the shard's."""
        if layer is None:
            return
        w_uk_t, w_uv = split_kv_b_proj(kv_b_exact, self.spec.dims, torch.bfloat16)
        rel = mla_file_rel(layer)
        specs = {
            w_uk_t_name(layer): (ARTIFACT_ST_DTYPE, tuple(w_uk_t.shape)),
            w_uv_name(layer): (ARTIFACT_ST_DTYPE, tuple(w_uv.shape)),
        }
        with ShardWriter(Path(self.spec.out_dir) / rel, specs, write_mode=self.spec.write_io) as w:
            w.write(w_uk_t_name(layer), w_uk_t)
            w.write(w_uv_name(layer), w_uv)
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
