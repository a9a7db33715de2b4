"""One shard job: every tensor of one output shard read by offset, transformed and written, plus
the MLA artifact file of each kv_b_proj the shard holds.

A shard job is described by a `ShardJobSpec`, small enough to send to a worker process. Each
tensor is read -> transform -> write: its op names its transform (kernels.transforms), which says what is read (its partners
included), what is written and which implementation runs. A layer's W_UK_T / W_UV are written in
one place, from the exact value of the SOURCE kv_b_proj (the fp32 dequant of a block-FP8 one, a
16-bit one as it is), never from the requantized copy.

Two ways through. Where the transform's C entry takes the source and the native kernels were chosen
(kernels.modes.NativeRows), a weight is read a chunk of rows at a time into a reused buffer
(io.buffers.scratch) and converted straight into the writer's staging buffers, where it is hashed
and written from (io.shard_writer.fill_rows): no torch, no fresh memory. Otherwise (eager, torch.compile, another
device, dtypes the native kernels do not take, INT4) tensors are torch tensors (`_Inputs.get`) and
the chosen kernel set (or the transform's definition) runs on them; torch is imported on first use.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mla_convert.conversion.compute import Compute
from mla_convert.conversion.scales import check_int4_shape, check_scale, check_scale_bytes, int_values
from mla_convert.errors import SourceError
from mla_convert.io.buffers import scratch
from mla_convert.io.reader import Reader, ReadFailed, Ref
from mla_convert.io.shard_writer import BackgroundCommits, ShardWriter
from mla_convert.kernels.modes import BLOCK_DEFAULT
from mla_convert.kernels.transforms import PLAN_TRANSFORMS, SPLITS, Params, Transform, mla_split
from mla_convert.kernels.transforms.transform import F32_DTYPE, FP8_DTYPE, SOURCE_DTYPE
from mla_convert.plan.ops import FP8_SCALE
from mla_convert.plan.planner import OutShard, OutTensor, Plan, mla_file_rel
from mla_convert.process.interrupts import crash_point
from mla_convert.process.torch_import import import_torch
from mla_convert.process.workers import errors_intact, report
from mla_convert.settings import ProgressFn
from mla_convert.source.checkpoint import SourceCheckpoint, module_of
from mla_runtime.format import ARTIFACT_ST_DTYPE, MlaDims, w_uk_t_name, w_uv_name
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
class Int4Parts:
    """A pack-quantized INT4 weight's partners and dims, for the transforms that read them."""

    packed: str
    scale: str
    shape: str  # weight_shape: its values must be [rows, cols]
    rows: int
    cols: int
    group_size: int


@dataclass(frozen=True)
class ShardJobSpec:
    """Everything one shard job needs, small enough to send to a worker process."""

    src_root: str
    out_dir: str
    shard: OutShard
    sources: dict[str, SourceTensor]  # every source tensor the job reads, partner scales included
    scales: dict[str, str]  # FP8 weight -> its scale tensor
    dims: MlaDims
    compute: Compute
    write_io: str  # disk_write mode, resolved once for the output directory: direct or buffered
    int4: dict[str, Int4Parts] = field(default_factory=dict)  # an INT4 weight's packed and shape tensor -> it
    layer_dims: dict[int, MlaDims] = field(default_factory=dict)  # a layer's MLA dims where not `dims`

    def dims_of(self, layer: int) -> MlaDims:
        """The MLA dims of `layer`: its own where the plan gives them, else the model's."""
        return self.layer_dims.get(layer, self.dims)

    def read_bytes(self, t: OutTensor) -> int:
        """The source bytes behind output tensor `t`: its source tensor and that one's block scale
        (an INT4 weight's scale)."""
        reads = PLAN_TRANSFORMS[t.op].reads if t.op in PLAN_TRANSFORMS else ()
        scale = self.scales.get(t.source)
        if "group_scale" in reads:
            scale = self.int4[t.source].scale
        return self.sources[t.source].nbytes + (self.sources[scale].nbytes if scale else 0)


def shard_job_specs(plan: Plan, out_dir: Path, compute: Compute, write_io: str) -> list[ShardJobSpec]:
    src = plan.source
    specs = []
    for shard in plan.shards:
        sources = {}
        for name, rel in plan.inputs_of(shard).items():
            info = src.info(name)
            sources[name] = SourceTensor(rel, src.headers[rel].data_start + info.begin, info.dtype, info.shape)
        scales = {n: src.block_fp8[n].scale.name for n in sources if n in src.block_fp8}
        int4 = _int4_parts(src, shard)
        layer_dims = _layer_dims(plan, shard)
        specs.append(ShardJobSpec(str(src.root), str(out_dir), shard, sources, scales, src.dims, compute, write_io, int4,
                             layer_dims))  # fmt: skip
    return specs


def _layer_dims(plan: Plan, shard: OutShard) -> dict[int, MlaDims]:
    """The dims of each layer whose artifacts the job writes, where they are not the model's
    (`Plan.dims_of`: a member's layer of its own kind)."""
    layers = {t.layer for t in shard.tensors if t.layer is not None and t.op != FP8_SCALE}
    return {layer: d for layer in sorted(layers) if (d := plan.dims_of(layer)) != plan.source.dims}


def _int4_parts(src: SourceCheckpoint, shard: OutShard) -> dict[str, Int4Parts]:
    out = {}
    for t in shard.tensors:
        if t.op in PLAN_TRANSFORMS and {"packed", "shape"} & set(PLAN_TRANSFORMS[t.op].reads):
            w = src.int4[module_of(t.source)]
            g = src.quant.int4.columns_per_scale(w.cols)
            out[t.source] = Int4Parts(w.packed.name, w.scale.name, w.shape.name, w.rows, w.cols, g)
    return out


@dataclass(frozen=True)
class _Rows:
    """A 2-D source weight for the native kernels: `at(r0, r1)` is the address of rows [r0, r1) in
    memory (read there on the way, unless the whole weight is already in memory)."""

    at: Callable[[int, int], int]
    rows: int
    cols: int


class _Inputs:
    """The job's source tensors, read by offset through one io.reader.Reader (files opened once per
    job). Torch tensors (`get`) are read into fresh memory, never cached; the native path reads into
    this thread's reused buffers of the run (io.buffers.scratch: `rows`, `whole`, `scale`)."""

    def __init__(self, spec: ShardJobSpec):
        root = Path(spec.src_root)
        self.refs = {
            name: Ref(str(root / t.file), name, t.offset, t.dtype, t.shape) for name, t in spec.sources.items()
        }
        self.reader = Reader()
        self.buffers = scratch()

    def get(self, name: str):
        """A source tensor as a torch tensor, read into fresh memory (freed with the tensor)."""
        import_torch()
        from mla_convert.io.tensors import empty_tensor

        ref = self.refs[name]
        tensor, view = empty_tensor(ref.dtype, ref.shape)
        self.reader.read(ref, view)
        return tensor

    def data(self, name: str) -> bytearray:
        """A small source tensor's bytes (a scale, a weight_shape), in memory of its own."""
        data = bytearray(self.refs[name].nbytes)
        self.reader.read(self.refs[name], memoryview(data))
        return data

    def copy_into(self, name: str) -> Callable[[memoryview, int], None]:
        """How the writer reads a tensor copied bit for bit: `read(view, start)` fills view from byte start."""
        ref = self.refs[name]
        return lambda view, start: self.reader.read(ref, view, start)

    def prefetch(self, name: str) -> None:
        self.reader.read_ahead(self.refs[name])

    def scale(self, name: str) -> int:
        """A block scale, checked, as float32 (an E8M0 one decoded) in the run's buffer (valid
        until the next call): its address."""
        ref = self.refs[name]
        f32 = check_scale_bytes(self.data(name), ref.dtype, ref.path, name)
        buf = self.buffers.block_scale
        buf.view(len(f32))[:] = f32
        return buf.address

    def whole(self, name: str) -> tuple[memoryview, _Rows]:
        """A 2-D weight read whole into the run's buffer (valid until the next call): its bytes,
        and its rows."""
        ref, buf = self.refs[name], self.buffers.whole
        view = self.reader.read(ref, buf.view(ref.nbytes))
        row_bytes, base = ref.row_bytes, buf.address
        return view, _Rows(lambda r0, r1: base + r0 * row_bytes, ref.shape[0], ref.shape[1])

    def rows(self, name: str) -> _Rows:
        """A 2-D weight read a chunk of rows at a time into the run's buffer, as the kernels ask."""
        ref, buf = self.refs[name], self.buffers.chunk

        def at(r0: int, r1: int) -> int:
            self.reader.read(ref, buf.view((r1 - r0) * ref.row_bytes), r0 * ref.row_bytes)
            return buf.address

        return _Rows(at, ref.shape[0], ref.shape[1])

    def close(self) -> None:
        self.reader.close()


PendingFiles = list[tuple[str, cf.Future]]  # (relative path, future of its WrittenFile)


def run_shard_job(spec: ShardJobSpec, progress: ProgressFn | None = None) -> list[tuple[str, int, str]]:
    """Convert one output shard (and the MLA artifacts of the kv_b_proj it holds), committed.

    Returns (relative path, size, sha256) of every file written. Memory: the tensor being converted
    (a chunk of its rows, on the native path) and the writers' staging buffers.
    """
    with BackgroundCommits() as commits:
        pending = start_shard_job(spec, commits, progress)
    return committed(pending)


def run_reported_shard_job(spec: ShardJobSpec) -> list[tuple[str, int, str]]:
    """run_shard_job in a worker process, each tensor's source bytes reported to the parent as
    (job file, bytes) as it is done (process.workers.report), so that progress moves with the work;
    an error raised whole in the parent by process.workers.result, as with one worker."""
    with errors_intact():
        return run_shard_job(spec, lambda n: report((spec.shard.file, n)))


def committed(pending: PendingFiles) -> list[tuple[str, int, str]]:
    """(relative path, size, sha256) of each file once its commit is done; raises its error."""
    return [(rel, (done := fut.result()).size, done.sha256) for rel, fut in pending]


def start_shard_job(spec: ShardJobSpec, commits: BackgroundCommits, progress: ProgressFn | None = None) -> PendingFiles:
    """run_shard_job, except that the files' commits (fsync, rename) are left to `commits`."""
    job = _ShardJob(spec, commits)
    tensors = spec.shard.tensors
    specs = {t.name: (t.dtype, t.shape) for t in tensors}
    try:
        out = Path(spec.out_dir) / spec.shard.file
        with ShardWriter(out, specs, write_mode=spec.write_io) as writer:
            job.writer = writer
            for i, t in enumerate(tensors):
                if i == len(tensors) // 2:
                    crash_point(f"shard-write:{spec.shard.file}")
                if i + 1 < len(tensors):  # a cold source: read ahead while this one converts
                    job.inputs.prefetch(tensors[i + 1].source)
                job.write(t)
                if progress and t.op != FP8_SCALE:
                    progress(spec.read_bytes(t))
            job.pending.append((spec.shard.file, commits.submit(writer)))
    except ReadFailed as e:  # a source file that will not open, ends early, or fails to read
        raise SourceError(str(e)) from e
    finally:
        job.inputs.close()
    return job.pending


class _ShardJob:
    """The tensors of one shard, each read -> transformed (its op's transform) -> written."""

    def __init__(self, spec: ShardJobSpec, commits: BackgroundCommits):
        self.spec, self.commits = spec, commits
        c = spec.compute
        self.params = Params(c.block or BLOCK_DEFAULT, c.fp8_max, c.signed_zero)
        self.native = c.native_rows()  # None: the torch kernels
        self._kernels = None if self.native else c.kernels()  # checked before the first write
        self.inputs = _Inputs(spec)
        self.writer: ShardWriter | None = None
        self.pending: PendingFiles = []
        # The scale computed with a quantized weight, written right after it (its layout is the
        # format's: formats.ScaleLayout): a tensor, or the native kernels' float32 channel scales.
        self.scale = None
        bufs = scratch()
        self._scales = bufs.channel_scale  # the native kernels' channel scales
        self._artifacts = (bufs.w_uk_t, bufs.w_uv)  # the native split's W_UK_T, W_UV

    @property
    def kernels(self):
        """The torch kernels (kernels.fastest.Kernels), for what the native ones do not cover."""
        if self._kernels is None:
            self._kernels = self.spec.compute.kernels()
        return self._kernels

    def write(self, t: OutTensor) -> None:
        if t.op == FP8_SCALE:
            self._scale(t)
            return
        tr, layer = PLAN_TRANSFORMS[t.op], t.layer
        if tr.writes == SOURCE_DTYPE and (layer is None or tr.split is None):
            if "shape" in tr.reads:
                self._int4_checked(t.source)
            # bit for bit, read straight into the writer: never decoded
            self.writer.copy_from(t.name, self.inputs.copy_into(t.source))
            return
        src = self.spec.sources[t.source]
        if self.native and src.dtype in tr.native_dtypes and len(src.shape) == 2 and (tr.rows or layer is not None):
            self._native_transform(t, tr, layer)
        else:
            self._torch_transform(t, tr, layer)

    def _scale(self, t: OutTensor) -> None:
        if isinstance(self.scale, memoryview):
            self.writer.write_bytes(t.name, self.scale, F32_DTYPE, t.shape)
        else:
            self.writer.write(t.name, self.scale)
        self.scale = None

    def _torch_transform(self, t: OutTensor, tr: Transform, layer: int | None) -> None:
        """On torch tensors: the chosen kernel set's implementation of the transform (its definition
        where kernel sets have none); the artifacts from the exact value of what it reads."""
        args = self._torch_inputs(t, tr)
        if tr.from_exact is not None:  # the output is made from the exact value, computed once
            exact = tr.exact(self.params)(*args)
            self._mla_artifacts(layer, exact)
            out = tr.from_exact(exact)
        else:
            if layer is not None:
                self._mla_artifacts(layer, self.kernels[tr.exact_op](*args) if tr.exact_op else args[0])
            run = self.kernels[tr.op] if tr.probes is not None else tr.eager(self.params)
            out = run(*args)
        if tr.writes == FP8_DTYPE:
            out, self.scale = out
        self.writer.write(t.name, out)

    def _torch_inputs(self, t: OutTensor, tr: Transform) -> list:
        """What the transform reads, as torch tensors in the order of `tr.reads` (a weight_shape,
        checked first, as the INT4 columns and group size, last)."""
        j = self._int4_checked(t.source) if "shape" in tr.reads else None
        got = {}
        if "block_scale" in tr.reads:
            got["block_scale"] = self._block_scale(t.source)
        for role, name in (("weight", t.source), ("packed", j and j.packed), ("group_scale", j and j.scale)):
            if role in tr.reads:
                got[role] = self.inputs.get(name)
        args = [got[role] for role in tr.reads if role != "shape"]
        return [*args, j.cols, j.group_size] if j is not None else args

    def _native_transform(self, t: OutTensor, tr: Transform, layer: int | None) -> None:
        """On raw rows: the transform's C entry (a kv_b_proj read whole, its artifacts split first)."""
        src = self.spec.sources[t.source]
        s = self.inputs.scale(self.spec.scales[t.source]) if "block_scale" in tr.reads else 0
        if layer is None:
            data, rows = None, self.inputs.rows(t.source)
        else:
            data, rows = self.inputs.whole(t.source)
            split, w, dims = self.native.rows(SPLITS[tr.split]), rows.at(0, 0), self.spec.dims_of(layer)
            self._native_artifacts(layer, lambda uk_t, uv: split(w, s, dims, uk_t, uv))
        if tr.writes == SOURCE_DTYPE:  # a bf16 kv_b_proj: its artifacts are bit-exact splits of it
            self.writer.write_bytes(t.name, data, src.dtype, src.shape)
            return
        kernel, k = self.native.rows(tr), rows.cols
        if tr.writes == FP8_DTYPE:
            self._native_channel_fp8(t, rows, lambda w, q, scales, r0, r1: kernel(w, s, k, q, scales, r0, r1))
            return

        def fill(out: int, r0: int, r1: int) -> None:
            kernel(rows.at(r0, r1), s, k, out, 0, r0, r1)

        self.writer.fill_rows(t.name, tr.writes, (rows.rows, k), fill)

    def _int4_checked(self, name: str) -> Int4Parts:
        j = self.spec.int4[name]
        ref = self.inputs.refs[j.shape]
        check_int4_shape(
            int_values(self.inputs.data(j.shape), ref.dtype), (j.rows, j.cols), ref.path, j.shape, j.packed
        )
        return j

    def _block_scale(self, name: str):
        scale_name = self.spec.scales[name]
        where = f"{self.spec.src_root}/{self.spec.sources[scale_name].file}"
        return check_scale(self.inputs.get(scale_name), where, scale_name)

    # -- the native path's plumbing -------------------------------------------------------------------

    def _native_channel_fp8(self, t: OutTensor, rows: _Rows, kernel) -> None:
        """Codes into the writer's stages, channel scales into the job's buffer (written next)."""
        scales = self._scales.view(4 * rows.rows)
        base = self._scales.address

        def fill(q: int, r0: int, r1: int) -> None:
            kernel(rows.at(r0, r1), q, base + 4 * r0, r0, r1)

        self.writer.fill_rows(t.name, FP8_DTYPE, (rows.rows, rows.cols), fill)
        self.scale = scales

    def _native_artifacts(self, layer: int, split: Callable[[int, int], None]) -> None:
        """The layer's W_UK_T / W_UV (bf16) split by the native kernels into the job's buffers."""
        dims = self.spec.dims_of(layer)
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
        w_uk_t, w_uv = mla_split.split_exact(kv_b_exact, self.spec.dims_of(layer))
        self._write_artifacts(layer, lambda w: (w.write(w_uk_t_name(layer), w_uk_t), w.write(w_uv_name(layer), w_uv)))

    def _write_artifacts(self, layer: int, write: Callable[[ShardWriter], object]) -> None:
        dims, rel = self.spec.dims_of(layer), mla_file_rel(layer)
        specs = {
            w_uk_t_name(layer): (ARTIFACT_ST_DTYPE, dims.w_uk_t_shape()),
            w_uv_name(layer): (ARTIFACT_ST_DTYPE, dims.w_uv_shape()),
        }
        with ShardWriter(Path(self.spec.out_dir) / rel, specs, write_mode=self.spec.write_io) as w:
            write(w)
            self.pending.append((rel, self.commits.submit(w)))
