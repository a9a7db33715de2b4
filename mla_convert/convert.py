"""Run a plan: per shard load -> transform -> write, then config, index and manifests."""

from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import functools
import json
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from mla_runtime.format import (
    ARTIFACT_ST_DTYPE,
    CONFIG_NAME,
    MLA_DIR_NAME,
    LayerEntry,
    MlaDims,
    MlaManifest,
    kv_b_layer_index,
    w_uk_t_name,
    w_uv_name,
)
from mla_runtime.format import (
    MANIFEST_NAME as MLA_MANIFEST_NAME,
)
from mla_runtime.layout import split_kv_b_proj
from mla_runtime.safetensors_file import nbytes_of

from . import __version__, disk_write, hub
from .checkpoint import INDEX_NAME, check_scale_values, checked_member, open_source
from .errors import ConvertError, OutputError, SourceError
from .kernels import resolve_mode, select_kernels
from .manifest import COMPLETE, INCOMPLETE, MANIFEST_NAME, read_manifest, write_manifest
from .plan import COPY, FP8_SCALE, TO_BF16, TO_FP8, Options, Plan, ShardJob, make_plan, mla_file_rel
from .read_ahead import will_need
from .resume import Journal, completed_jobs, crash_point
from .safetensors_io import (
    BackgroundCommits,
    ShardWriter,
    WrittenFile,
    copy_file_atomic,
    read_chunks,
    read_tensor,
    write_bytes_atomic,
)
from .source import is_hub_source, resolve_source
from .workers import process_pool

ProgressFn = Callable[[int], None]  # called with source bytes processed


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
class JobSpec:
    """Everything one shard job needs, small enough to send to a worker process."""

    src_root: str
    out_dir: str
    job: ShardJob
    sources: dict[str, SourceTensor]  # every source tensor the job reads, partner scales included
    scales: dict[str, str]  # FP8 weight -> its scale tensor
    block: tuple[int, int]
    fp8_max: float
    dims: MlaDims
    device: str = "cpu"
    kernels: tuple[str, ...] = ("native", "eager")  # kernels to try in order (kernels.resolve_mode)
    ops: tuple[str, ...] = ("fp8", "bf16")  # conversions this plan uses (what gets compiled)
    write_io: str = disk_write.BUFFERED  # disk_write mode, resolved once for the output directory


class _Inputs:
    """Source files opened once per job; each tensor is read into fresh memory, never cached."""

    def __init__(self, spec: JobSpec):
        self.root, self.sources, self.files = Path(spec.src_root), spec.sources, {}

    def _file(self, rel: str):
        if rel not in self.files:
            try:
                self.files[rel] = open(self.root / rel, "rb")  # noqa: SIM115 (kept open for the job; close())
            except OSError as e:
                raise SourceError(f"{self.root / rel}: cannot open ({e.strerror or e})") from None
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


def run_shard_job(spec: JobSpec, progress: ProgressFn | None = None) -> list[tuple[str, int, str]]:
    """Convert one output shard (and the MLA artifacts of the kv_b_proj it holds), committed.

    Returns (relative path, size, sha256) of every file written. Memory: a few tensors at a time
    (the one being converted and at most ShardWriter.INFLIGHT_BYTES waiting to be written).
    """
    with BackgroundCommits() as commits:
        pending = start_shard_job(spec, commits, progress)
    return committed(pending)


def committed(pending: PendingFiles) -> list[tuple[str, int, str]]:
    """(relative path, size, sha256) of each file once its commit is done; raises its error."""
    return [(rel, (done := fut.result()).size, done.sha256) for rel, fut in pending]


def start_shard_job(spec: JobSpec, commits: BackgroundCommits, progress: ProgressFn | None = None) -> PendingFiles:
    """run_shard_job, except that the files' commits (fsync, rename) are left to `commits`."""
    kernels = select_kernels(spec.block, spec.fp8_max, spec.device, spec.kernels, spec.ops)
    out_dir = Path(spec.out_dir)
    inputs = _Inputs(spec)
    specs = {t.name: (t.dtype, t.shape) for t in spec.job.tensors}
    pending: PendingFiles = []
    pending_scale: torch.Tensor | None = None
    try:
        with ShardWriter(out_dir / spec.job.file, specs, background=True, write_mode=spec.write_io) as writer:
            for i, t in enumerate(spec.job.tensors):
                if i == len(spec.job.tensors) // 2:
                    crash_point(f"shard-write:{spec.job.file}")
                if i + 1 < len(spec.job.tensors):  # a cold source: read ahead while this one converts
                    inputs.prefetch(spec.job.tensors[i + 1].source)
                if t.op == COPY:
                    writer.write_raw(t.name, inputs.chunks(t.source))
                elif t.op == FP8_SCALE:
                    writer.write(t.name, pending_scale)
                    pending_scale = None
                else:
                    w, s = _fp8_inputs(spec, inputs, t.source)
                    layer = kv_b_layer_index(t.source)
                    if layer is not None:  # from the exact fp32 dequant of the source weight
                        kv_b = kernels.dequant_fp32(w, s).cpu()
                        pending.append(_write_mla_layer(out_dir, layer, kv_b, spec.dims, spec.write_io, commits))
                    if t.op == TO_BF16:
                        writer.write(t.name, kernels.to_bf16(w, s).cpu())
                    elif t.op == TO_FP8:
                        q, pending_scale = (x.cpu() for x in kernels.to_channel_fp8(w, s))
                        writer.write(t.name, q)
                    else:
                        raise AssertionError(f"unknown op {t.op!r}")
                    del w, s
                if progress and t.op != FP8_SCALE:
                    scale = spec.scales.get(t.source)
                    progress(spec.sources[t.source].nbytes + (spec.sources[scale].nbytes if scale else 0))
            pending.append((spec.job.file, commits.submit(writer)))
    finally:
        inputs.close()
    return pending


def _fp8_inputs(spec: JobSpec, inputs: _Inputs, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    scale_name = spec.scales[name]
    scale = inputs.get(scale_name)
    if not torch.isfinite(scale).all():
        raise SourceError(f"{spec.src_root}/{spec.sources[scale_name].file}: scale {scale_name!r} contains NaN or Inf")
    weight = inputs.get(name)
    if spec.device != "cpu":
        weight, scale = weight.to(spec.device), scale.to(spec.device)
    return weight, scale


def _write_mla_layer(
    out_dir: Path, layer: int, kv_b_dequant: torch.Tensor, dims: MlaDims, write_io: str, commits: BackgroundCommits
) -> tuple[str, cf.Future]:
    """W_UK_T / W_UV from the exact fp32 dequant of the SOURCE kv_b_proj, never the requantized copy."""
    w_uk_t, w_uv = split_kv_b_proj(kv_b_dequant, dims, torch.bfloat16)
    rel = mla_file_rel(layer)
    specs = {
        w_uk_t_name(layer): (ARTIFACT_ST_DTYPE, tuple(w_uk_t.shape)),
        w_uv_name(layer): (ARTIFACT_ST_DTYPE, tuple(w_uv.shape)),
    }
    with ShardWriter(out_dir / rel, specs, write_mode=write_io) as w:
        w.write(w_uk_t_name(layer), w_uk_t)
        w.write(w_uv_name(layer), w_uv)
        return rel, commits.submit(w)


def ensure_empty_dir(path: Path, overwrite: bool) -> None:
    """Create `path`, or accept it empty; a non-empty one only with `overwrite` (its contents go)."""
    if path.exists() and not path.is_dir():
        raise OutputError(f"{path}: exists and is not a directory")
    if path.exists() and any(path.iterdir()):
        if not overwrite:
            raise OutputError(f"{path}: directory is not empty; delete it, pick another --out, or pass --overwrite")
        for child in path.iterdir():
            shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
    path.mkdir(parents=True, exist_ok=True)


def check_out_dir_location(out_dir: Path, src_root: Path) -> None:
    out_real, src_real = out_dir.resolve(), src_root.resolve()
    if out_real == src_real or src_real in out_real.parents:
        raise OutputError(f"{out_dir}: --out is the source or inside it; pick a directory outside {src_root}")
    if out_real in src_real.parents:
        raise OutputError(f"{out_dir}: --out contains the source {src_root}; pick a directory outside it")


def prepare_out_dir(out_dir: Path, src_root: Path, overwrite: bool) -> None:
    check_out_dir_location(out_dir, src_root)
    if not overwrite and (out_dir / MANIFEST_NAME).exists():
        status = (read_manifest(out_dir) or {}).get("status")
        if status != COMPLETE:
            raise OutputError(f"{out_dir}: holds an unfinished conversion; pass --resume to finish it, or --overwrite")
    ensure_empty_dir(out_dir, overwrite)


def plan_ops(plan: Plan) -> tuple[str, ...]:
    """The per-tensor conversions the plan uses: 'fp8' (block -> channel) and/or 'bf16'."""
    used = {t.op for job in plan.shards for t in job.tensors}
    return tuple(name for op, name in ((TO_FP8, "fp8"), (TO_BF16, "bf16")) if op in used)


def job_specs(
    plan: Plan, out_dir: Path, device: str = "cpu", kernels=("native", "eager"), write_io: str = disk_write.BUFFERED
) -> list[JobSpec]:
    src = plan.source
    ops = plan_ops(plan)
    specs = []
    for job in plan.shards:
        sources = {}
        for name, rel in plan.inputs_of(job).items():
            info = src.info(name)
            sources[name] = SourceTensor(rel, src.headers[rel].data_start + info.begin, info.dtype, info.shape)
        scales = {n: src.fp8[n].scale.name for n in sources if n in src.fp8}
        specs.append(
            JobSpec(
                str(src.root),
                str(out_dir),
                job,
                sources,
                scales,
                src.block,
                plan.options.fp8_max,
                src.dims,
                device,
                kernels,
                ops,
                write_io,
            )
        )
    return specs


def execute(
    plan: Plan,
    out_dir: Path,
    *,
    skip: set[str] = frozenset(),
    workers: int = 1,
    device: str = "cpu",
    kernels: tuple[str, ...] = ("native", "eager"),
    write_io: str = disk_write.BUFFERED,
    progress: ProgressFn | None = None,
    on_job_done: Callable[[str, list], None] | None = None,
    inputs_ready: Callable[[JobSpec], None] | None = None,
) -> dict[str, dict]:
    """Write every shard and MLA layer of the jobs not in `skip`, in plan order; returns
    {relative path: {size, sha256}}.

    `inputs_ready(spec, timeout)` says whether a job's source files are there (--stream), waiting
    up to `timeout` (None: until they are); at most `workers` jobs run at once.
    `on_job_done(job_file, files)` runs here once a job's files are all in place.
    """
    specs = [s for s in job_specs(plan, out_dir, device, kernels, write_io) if s.job.file not in skip]
    files: dict[str, dict] = {}

    def record(spec: JobSpec, results) -> None:
        for rel, size, sha in results:
            files[rel] = {"size": size, "sha256": sha}
        if on_job_done:
            on_job_done(spec.job.file, results)
        crash_point(f"after-job:{spec.job.file}")

    if workers <= 1:  # one job at a time; its files' commits overlap the next job
        with BackgroundCommits() as commits:
            waiting: collections.deque[tuple[JobSpec, PendingFiles]] = collections.deque()

            def settle(wait: bool) -> None:  # record finished jobs, in order
                while waiting and (wait or all(fut.done() for _, fut in waiting[0][1])):
                    spec, pending = waiting.popleft()
                    record(spec, committed(pending))

            for spec in specs:
                # A job is recorded (and, streaming, its shards released) only once committed;
                # keep settling while the next job's inputs may be waiting on that.
                while inputs_ready and not inputs_ready(spec, 0.05 if waiting else None):
                    settle(wait=False)
                waiting.append((spec, start_shard_job(spec, commits, progress)))
                settle(wait=False)
            settle(wait=True)
        return files
    with process_pool(workers) as pool:
        running: dict[cf.Future, JobSpec] = {}

        def collect(timeout: float | None = None) -> None:
            finished, _ = cf.wait(running, timeout, return_when=cf.FIRST_COMPLETED)
            for fut in finished:
                spec = running.pop(fut)
                record(spec, fut.result())
                if progress:
                    progress(sum(t.nbytes for t in spec.sources.values()))

        try:
            for spec in specs:
                while len(running) >= workers:
                    collect()
                # Keep collecting while waiting for inputs: a finished job frees the shards (and the
                # download window) that the next job's inputs may be waiting for.
                while inputs_ready and not inputs_ready(spec, 0.05 if running else None):
                    if running:
                        collect(0.05)
                running[pool.submit(run_shard_job, spec)] = spec
            while running:
                collect()
        except BaseException:
            for f in running:
                f.cancel()
            raise
    return files


def finalize(plan: Plan, out_dir: Path, files: dict[str, dict]) -> None:
    """Side files, config, index, MLA manifest; the caller then marks the conversion complete."""
    src = plan.source

    def record(rel: str, w: WrittenFile) -> None:
        files[rel] = {"size": w.size, "sha256": w.sha256}

    for rel in src.side_files:
        record(rel, copy_file_atomic(checked_member(src.root, rel, "side file"), out_dir / rel))
    record(CONFIG_NAME, write_bytes_atomic(out_dir / CONFIG_NAME, _json_bytes(plan.config)))
    weight_map = {t.name: job.file for job in plan.shards for t in job.tensors}
    total = sum(job.out_bytes for job in plan.shards)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    crash_point("index")
    record(INDEX_NAME, write_bytes_atomic(out_dir / INDEX_NAME, _json_bytes(index)))
    layers = tuple(
        LayerEntry(i, Path(mla_file_rel(i)).name, files[mla_file_rel(i)]["size"], files[mla_file_rel(i)]["sha256"])
        for i in plan.mla_layers
    )
    manifest = MlaManifest(
        dims=src.dims,
        layers=layers,
        source_fingerprint=src.fingerprint(),
        producer={"tool": "mla-convert", "version": __version__, "format": plan.options.format},
    )
    rel = f"{MLA_DIR_NAME}/{MLA_MANIFEST_NAME}"
    crash_point("mla-manifest")
    record(rel, write_bytes_atomic(out_dir / rel, manifest.to_json().encode()))


def _json_bytes(obj: dict) -> bytes:
    return (json.dumps(obj, indent=2) + "\n").encode()


def convert(
    source: str | Path,
    out_dir: str | Path,
    options: Options = Options(),  # noqa: B008 (frozen: one shared default is safe)
    *,
    revision: str | None = None,
    workers: int = 1,
    overwrite: bool = False,
    dry_run: bool = False,
    resume: bool = False,
    stream: bool = False,
    device: str = "cpu",
    kernels: str = "auto",
    write_io: str = disk_write.AUTO,
    progress_factory: Callable[[int], ProgressFn] | None = None,
) -> dict:
    """Convert `source` into `out_dir`. Returns a summary dict (the CLI's --json output).

    Stages: resolve and validate the source (headers only) -> plan -> prepare --out (fresh, or
    resume) -> shard jobs (journaled) -> side files, config, index, MLA manifest -> manifest
    'complete'. With `stream`, shards of a Hub source are downloaded just in time and deleted
    once converted.
    """
    t0 = time.perf_counter()
    out_dir = Path(out_dir)
    source = str(source)
    remote = is_hub_source(source) and (stream or dry_run)
    if write_io not in disk_write.MODES:
        raise ConvertError(f"--write-io: unknown mode {write_io!r}; expected one of {', '.join(disk_write.MODES)}")
    if stream and not is_hub_source(source):
        raise ConvertError(f"--stream needs a Hub repo id; {source!r} is a local directory")
    if remote and hub.offline():
        if stream:
            raise ConvertError("--stream downloads shards as it goes; it cannot run with HF_HUB_OFFLINE=1")
        remote = False
    repo = None
    with contextlib.ExitStack() as cleanup:
        if remote:
            repo = hub.list_repo(source, revision)
            if dry_run:
                staging = Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="mla-convert-plan-")))
            else:
                if not (resume and out_dir.is_dir()):
                    ensure_empty_dir(out_dir, overwrite)
                staging = out_dir / hub.STAGING_DIR_NAME
            src = open_source(staging, remote_headers=hub.prepare_staging(repo, staging))
        else:
            src = open_source(resolve_source(source, revision))
            check_scale_values(src)
        plan = make_plan(src, options)
        summary = plan.summary() | {"out": str(out_dir), "dry_run": dry_run, "workers": workers, "device": device}
        if repo is not None:
            summary |= _hub_summary(repo, plan, workers) | {"source": f"{repo.repo_id}@{repo.commit}"}
        if dry_run:
            return summary
        return summary | _run(
            plan,
            out_dir,
            repo,
            t0,
            overwrite=overwrite,
            resume=resume,
            workers=workers,
            device=device,
            kernels=kernels,
            write_io=write_io,
            progress_factory=progress_factory,
        )


def _hub_summary(repo: hub.HubRepo, plan: Plan, workers: int) -> dict:
    shard_sizes = sorted((f.size or 0 for p, f in repo.files.items() if p.endswith(".safetensors")), reverse=True)
    out = plan.summary()["disk_needed"]
    return {
        "hub_commit": repo.commit,
        "download_bytes": sum(f.size or 0 for f in repo.files.values()),
        # Download then convert: the whole source and the output side by side.
        "disk_needed_download_then_convert": out + sum(shard_sizes),
        # --stream: the output plus the shards of the jobs in flight and prefetched (and a partner).
        "disk_needed_stream": out + sum(shard_sizes[: workers + 2]),
    }


def _run(plan, out_dir, repo, t0, *, overwrite, resume, workers, device, kernels, write_io, progress_factory) -> dict:
    src, options = plan.source, plan.options
    stream = repo is not None
    _check_device(device)
    try:
        kernels, why = resolve_mode(kernels, sum(p.weight.nbytes for p in src.fp8.values()))
    except ValueError as e:
        raise ConvertError(f"--kernels: {e}") from None
    chosen = select_kernels(src.block, options.fp8_max, device, kernels, plan_ops(plan))
    reason = chosen.reason if why in ("requested", "auto") or chosen.name != "eager" else f"{chosen.reason}; {why}"
    result = {"kernels": chosen.name, "kernels_reason": reason}

    fingerprint = src.fingerprint()
    done: dict[str, list] = {}
    if resume and (out_dir / MANIFEST_NAME).exists():
        if not stream:
            check_out_dir_location(out_dir, src.root)
        outputs = {job.file: [job.file, *map(mla_file_rel, job.mla_layers)] for job in plan.shards}
        done = completed_jobs(out_dir, options.as_dict(), fingerprint, outputs)
    elif not stream:
        prepare_out_dir(out_dir, src.root, overwrite)
    try:  # before the first byte of output: a refused --write-io direct leaves nothing behind
        write_io, why = disk_write.resolve_mode(out_dir, write_io)
    except OSError as e:
        raise OutputError(f"--write-io: {e}") from None
    result |= {"write_io": write_io, "write_io_reason": why}
    write_manifest(out_dir, INCOMPLETE, options.as_dict(), fingerprint, {})
    (out_dir / MLA_DIR_NAME).mkdir(exist_ok=True)
    journal = Journal(out_dir)
    progress = progress_factory(src.total_bytes()) if progress_factory else None
    if progress:
        progress(sum(plan.in_bytes(j) for j in plan.shards if j.file in done))
    files = {rel: {"size": n, "sha256": h} for entries in done.values() for rel, n, h in entries}
    run = functools.partial(
        execute,
        plan,
        out_dir,
        skip=set(done),
        workers=workers,
        device=device,
        kernels=kernels,
        write_io=write_io,
        progress=progress,
    )
    if stream:
        todo = [(j.file, sorted(set(plan.inputs_of(j).values()))) for j in plan.shards if j.file not in done]
        with hub.ShardStreamer(repo, src.root, todo, ahead=workers) as streamer:
            needs = dict(todo)

            def job_done(job_file, results):
                journal.record(job_file, results)
                streamer.release(job_file, needs[job_file])

            files |= run(
                on_job_done=job_done, inputs_ready=lambda spec, timeout: streamer.wait_for(spec.job.file, timeout)
            )
        result |= {"peak_source_bytes_on_disk": streamer.peak_on_disk}
    else:
        files |= run(on_job_done=journal.record)
    finalize(plan, out_dir, files)
    crash_point("final-manifest")
    write_manifest(out_dir, COMPLETE, options.as_dict(), fingerprint, files)
    journal.remove()
    if stream:
        hub.remove_staging(src.root)
    seconds = time.perf_counter() - t0
    return result | {
        "status": COMPLETE,
        "resumed_jobs": len(done),
        "files": len(files),
        "seconds": round(seconds, 3),
        "gb_per_s": round(src.total_bytes() / seconds / 1e9, 3),
        "source_fingerprint": fingerprint,
    }


def _check_device(device: str) -> None:
    try:
        torch.empty(1, device=device)
    except Exception as e:  # unknown device string, or no such device on this host
        raise ConvertError(f"--device {device!r} is not usable here ({type(e).__name__}: {e})") from None
