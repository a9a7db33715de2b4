"""Run a plan: per shard load -> transform -> write, then config, index and manifests."""

from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import dataclasses
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

from . import __version__, disk_write, hub, preflight
from .checkpoint import INDEX_NAME, SourceCheckpoint, check_scale, check_scale_values, checked_member, open_source
from .errors import ConvertError, OutputError, SourceError
from .kernels import BLOCK_DEFAULT, Kernels, resolve_mode, select_kernels
from .manifest import COMPLETE, INCOMPLETE, TOOL_NAME, write_manifest
from .numerics import SIGNED_ZERO
from .out_dir import STAGING_DIR_NAME, check_location, gb
from .plan import COPY, FP8_SCALE, QUANT_FP8, TO_BF16, TO_FP8, Options, Plan, ShardJob, make_plan, mla_file_rel
from .preflight import prepare
from .read_ahead import will_need
from .resume import Journal, crash_point, remove_partials
from .safetensors_io import (
    BackgroundCommits,
    ShardWriter,
    WrittenFile,
    copy_file_atomic,
    read_chunks,
    read_tensor,
    write_bytes_atomic,
)
from .settings import ProgressFn, RunSettings
from .source import is_hub_source, resolve_source
from .workers import process_pool
from .workers import stop as workers_stop


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
class Compute:
    """How the arithmetic runs, the same for every job of a conversion."""

    block: tuple[int, int] | None  # the source's scale block (None: a BF16 source)
    fp8_max: float  # the target's FP8 range
    ops: tuple[str, ...]  # conversions the plan uses: 'fp8', 'bf16', 'quant' (what gets compiled)
    device: str  # where the arithmetic should run, if it passes the check (kernels.select_kernels)
    chain: tuple[str, ...]  # CPU kernels to try in order (kernels.resolve_mode)
    signed_zero: bool = True  # the target's FP8 weights may hold -0 (numerics.SIGNED_ZERO)

    def kernels(self) -> Kernels:
        """Chosen and checked once per process: the first call, before this process writes."""
        return select_kernels(
            self.block or BLOCK_DEFAULT, self.fp8_max, self.device, self.chain, self.ops, self.signed_zero
        )


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
    kernels = spec.compute.kernels()
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
                layer = kv_b_layer_index(t.source) if t.op != FP8_SCALE else None
                if t.op == COPY and layer is None:
                    writer.write_raw(t.name, inputs.chunks(t.source))
                elif t.op == COPY:  # a 16-bit kv_b_proj: the artifacts are bit-exact splits of it
                    w = inputs.get(t.source)
                    pending.append(_write_mla_layer(out_dir, layer, w, spec.dims, spec.write_io, commits))
                    writer.write(t.name, w)
                    del w
                elif t.op == FP8_SCALE:
                    writer.write(t.name, pending_scale)
                    pending_scale = None
                elif t.op == QUANT_FP8:
                    w = inputs.get(t.source)
                    if layer is not None:
                        pending.append(_write_mla_layer(out_dir, layer, w, spec.dims, spec.write_io, commits))
                    q, pending_scale = kernels.quantize(w)
                    writer.write(t.name, q)
                    del w
                else:
                    w, s = _fp8_inputs(spec, inputs, t.source)
                    if layer is not None:  # from the exact fp32 dequant of the source weight
                        kv_b = kernels.dequant_fp32(w, s)
                        pending.append(_write_mla_layer(out_dir, layer, kv_b, spec.dims, spec.write_io, commits))
                    if t.op == TO_BF16:
                        writer.write(t.name, kernels.to_bf16(w, s))
                    elif t.op == TO_FP8:
                        q, pending_scale = kernels.to_channel_fp8(w, s)
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
    scale = check_scale(inputs.get(scale_name), f"{spec.src_root}/{spec.sources[scale_name].file}", scale_name)
    return inputs.get(name), scale


def _write_mla_layer(
    out_dir: Path, layer: int, kv_b_dequant: torch.Tensor, dims: MlaDims, write_io: str, commits: BackgroundCommits
) -> tuple[str, cf.Future]:
    """W_UK_T / W_UV from the exact value of the SOURCE kv_b_proj (the fp32 dequant of a block-FP8
    one, a 16-bit one as it is), never the requantized copy."""
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


def plan_ops(plan: Plan) -> tuple[str, ...]:
    """The per-tensor conversions the plan uses: 'fp8' (block -> channel), 'bf16', 'quant' (16-bit
    linear -> channel)."""
    used = {t.op for job in plan.shards for t in job.tensors}
    return tuple(name for op, name in ((TO_FP8, "fp8"), (TO_BF16, "bf16"), (QUANT_FP8, "quant")) if op in used)


def job_specs(plan: Plan, out_dir: Path, compute: Compute, write_io: str) -> list[JobSpec]:
    src = plan.source
    specs = []
    for job in plan.shards:
        sources = {}
        for name, rel in plan.inputs_of(job).items():
            info = src.info(name)
            sources[name] = SourceTensor(rel, src.headers[rel].data_start + info.begin, info.dtype, info.shape)
        scales = {n: src.fp8[n].scale.name for n in sources if n in src.fp8}
        specs.append(JobSpec(str(src.root), str(out_dir), job, sources, scales, src.dims, compute, write_io))
    return specs


JobDone = Callable[[str, list], None]  # (job file, [(relative path, size, sha256)])
InputsReady = Callable[[JobSpec, float | None], bool]  # (spec, timeout) -> the job's sources are there
RecordFn = Callable[[JobSpec, list], None]  # the step after each finished job (execute's record)


def execute(
    specs: list[JobSpec],
    workers: int,
    *,
    progress: ProgressFn | None = None,
    on_job_done: JobDone | None = None,
    inputs_ready: InputsReady | None = None,
) -> dict[str, dict]:
    """Write every shard and MLA layer of `specs`, in order; returns {relative path: {size, sha256}}.

    `inputs_ready(spec, timeout)` says whether a job's source files are there (--stream), waiting
    up to `timeout` (None: until they are); at most `workers` jobs run at once.
    `on_job_done(job_file, files)` runs here once a job's files are all in place.
    """
    files: dict[str, dict] = {}

    def record(spec: JobSpec, results: list[tuple[str, int, str]]) -> None:
        """The one step after a job, in either scheduler: note its files, tell the caller, crash point."""
        for rel, size, sha in results:
            files[rel] = {"size": size, "sha256": sha}
        if on_job_done:
            on_job_done(spec.job.file, results)
        crash_point(f"after-job:{spec.job.file}")

    if workers <= 1:
        run_in_process(specs, record, progress, inputs_ready)
    else:
        run_in_pool(specs, workers, record, progress, inputs_ready)
    return files


def run_in_process(
    specs: list[JobSpec], record: RecordFn, progress: ProgressFn | None, inputs_ready: InputsReady | None
) -> None:
    """One job at a time in this process; its files' commits overlap the next job, and finished
    jobs are recorded in order."""
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


def run_in_pool(
    specs: list[JobSpec],
    workers: int,
    record: RecordFn,
    progress: ProgressFn | None,
    inputs_ready: InputsReady | None,
) -> None:
    """Up to `workers` jobs at once in worker processes, each recorded as it finishes."""
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
            # Ctrl-C or a failed job: stop the other jobs now rather than let them finish, and
            # remove the files they were writing (a killed job cannot remove its own).
            workers_stop(pool)
            if specs:
                remove_partials(Path(specs[0].out_dir))
            raise


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
        producer={"tool": TOOL_NAME, "version": __version__, "format": plan.options.format},
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
    settings: RunSettings = RunSettings(),  # noqa: B008 (frozen, as options)
    **changes,
) -> dict:
    """Convert `source` into `out_dir`. Returns a summary dict (the CLI's --json output).

    `options` says what to produce, `settings` how (RunSettings); keyword arguments replace fields
    of `settings`: `convert(src, out, options, workers=2)`.

    Stages: open and validate the source from its headers (a Hub source by range requests, before
    any download) -> plan -> preflight (--out writable, free space) -> download a Hub source not
    streamed -> kernels and device check -> prepare --out (fresh, resume or overwrite) -> shard
    jobs (journaled) -> side files, config, index, MLA manifest -> manifest 'complete'. With
    `stream`, shards are downloaded just in time and deleted once converted.
    """
    t0 = time.perf_counter()
    settings = dataclasses.replace(settings, **changes)
    out_dir = Path(out_dir)
    status = settings.status or _quiet
    with contextlib.ExitStack() as cleanup:
        src, repo = _open_source(str(source), settings, cleanup)
        plan = make_plan(src, options)
        summary = plan.summary() | {
            "out": str(out_dir),
            "dry_run": settings.dry_run,
            "workers": settings.workers,
            "device": settings.device,
        }
        if repo is not None:
            summary |= _hub_summary(repo, plan, settings.workers) | {"source": f"{repo.repo_id}@{repo.commit}"}
        downloads = repo is not None and not settings.stream
        download = hub.bytes_to_download(repo) if downloads else None
        cache = hub.cache_dir() if downloads else None
        if settings.dry_run:  # the numbers, not the checks: a plan is also for a disk not ready yet
            return summary | preflight.space(summary, out_dir, settings, preflight.OutputState({}), download, cache)
        state = preflight.inspect_output(plan, out_dir, settings, src.fingerprint(), None if repo else src.root)
        summary |= preflight.space(summary, out_dir, settings, state, download, cache)
        preflight.check_room(summary, out_dir, settings)
        if repo is not None and settings.notice:
            settings.notice(preflight.plan_line(summary, out_dir, settings.stream))
        if downloads:  # the whole source into the Hub cache, checked, and converted from there
            status(f"downloading {source} ({gb(download)}) to {cache}")
            planned = src.fingerprint()
            src = _local_source(str(source), settings)
            # The download resolves the revision again (so the cache records it for offline use):
            # it must be the commit, and the headers, that the plan and its checks were made for.
            if src.root.name != repo.commit or src.fingerprint() != planned:
                raise SourceError(
                    f"{source}: revision {settings.revision or 'main'!r} moved on the Hub while it was planned "
                    f"(planned commit {repo.commit}, downloaded {src.root.name}); run the command again, or pass "
                    "--revision with a commit hash"
                )
            plan, repo = make_plan(src, options), None
        return summary | _run(plan, out_dir, repo, settings, state, t0)


def _quiet(message: str) -> None:
    pass


def _local_source(source: str, settings: RunSettings) -> SourceCheckpoint:
    (settings.status or _quiet)(f"reading the headers of {source}")
    src = open_source(resolve_source(source, settings.revision))
    check_scale_values(src)
    return src


def _open_source(
    source: str, settings: RunSettings, cleanup: contextlib.ExitStack
) -> tuple[SourceCheckpoint, hub.HubRepo | None]:
    """The source checkpoint, and its Hub repo when only its headers are here: a Hub source is first
    planned from its headers (range requests) and small files, staged in a temporary directory, so
    that nothing is downloaded or written before the plan's checks pass."""
    if settings.stream and not is_hub_source(source):
        raise ConvertError(f"--stream needs a Hub repo id; {source!r} is a local directory")
    if not is_hub_source(source) or hub.offline():
        if settings.stream:
            raise ConvertError("--stream downloads shards as it goes; it cannot run with HF_HUB_OFFLINE=1")
        return _local_source(source, settings), None
    (settings.status or _quiet)(f"reading the file list and shard headers of {source} on the Hub")
    repo = hub.list_repo(source, settings.revision)
    temporary = tempfile.TemporaryDirectory(prefix="mla-convert-plan-", ignore_cleanup_errors=True)
    staging = Path(cleanup.enter_context(temporary))
    return open_source(staging, remote_headers=hub.prepare_staging(repo, staging)), repo


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


def _run(
    plan: Plan,
    out_dir: Path,
    repo: hub.HubRepo | None,
    settings: RunSettings,
    state: preflight.OutputState,
    t0: float,
) -> dict:
    streaming = repo is not None
    compute, result = _choose_compute(plan, settings)
    if not streaming:  # a downloaded source lies in the Hub cache: checked against --out only now
        check_location(out_dir, plan.source.root)
    prepare(out_dir, state)
    done = state.kept
    if streaming:
        plan = _staged_in(plan, out_dir)
    src, options = plan.source, plan.options
    fingerprint = src.fingerprint()
    try:  # before the first byte of output: a refused --write-io direct leaves nothing behind
        write_io, why = disk_write.resolve_mode(out_dir, settings.write_io)
    except OSError as e:
        raise OutputError(f"--write-io: {e}") from None
    result |= {"write_io": write_io, "write_io_reason": why}
    write_manifest(out_dir, INCOMPLETE, options.as_dict(), fingerprint, {})
    (out_dir / MLA_DIR_NAME).mkdir(exist_ok=True)
    journal = Journal(out_dir)
    # What this run converts: a resume's kept jobs are not counted, so speed and time left are this run's.
    todo = src.total_bytes() - sum(plan.in_bytes(j) for j in plan.shards if j.file in done)
    progress = settings.progress_factory(max(todo, 0)) if settings.progress_factory else None
    files = {rel: {"size": n, "sha256": h} for entries in done.values() for rel, n, h in entries}
    specs = [s for s in job_specs(plan, out_dir, compute, write_io) if s.job.file not in done]
    if streaming:
        streamed, peak = _execute_streaming(plan, specs, repo, settings.workers, journal, progress)
        files |= streamed
        result |= {"peak_source_bytes_on_disk": peak}
    else:
        files |= execute(specs, settings.workers, progress=progress, on_job_done=journal.record)
    finalize(plan, out_dir, files)
    crash_point("final-manifest")
    write_manifest(out_dir, COMPLETE, options.as_dict(), fingerprint, files)
    journal.remove()
    if streaming:
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


def _choose_compute(plan: Plan, settings: RunSettings) -> tuple[Compute, dict]:
    """The device checked, the --kernels mode resolved for this source, and the kernels that will run
    (with the reason, for the summary)."""
    src = plan.source
    _check_device(settings.device)
    try:
        converted = {t.source for job in plan.shards for t in job.tensors if t.op in (TO_FP8, TO_BF16, QUANT_FP8)}
        chain, why = resolve_mode(settings.kernels, sum(src.info(n).nbytes for n in converted))
    except ValueError as e:
        raise ConvertError(f"--kernels: {e}") from None
    signed_zero = SIGNED_ZERO[plan.options.target]
    compute = Compute(src.block, plan.options.fp8_max, plan_ops(plan), settings.device, chain, signed_zero)
    chosen = compute.kernels()
    cpu_eager_by_policy = chosen.name == "eager" and chosen.device == "cpu" and why not in ("requested", "auto")
    reason = f"{chosen.reason}; {why}" if cpu_eager_by_policy else chosen.reason
    return compute, {
        "kernels": chosen.name,
        "kernels_reason": reason,
        "compute_device": chosen.device,
        "device_check": chosen.device_check,
        "device_reason": chosen.device_reason,
    }


def _check_device(device: str) -> None:
    try:
        torch.empty(1, device=device)
    except Exception as e:  # unknown device string, or no such device on this host
        raise ConvertError(f"--device {device!r} is not usable here ({type(e).__name__}: {e})") from None


def _staged_in(plan: Plan, out_dir: Path) -> Plan:
    """--stream: the source's small files, staged in a temporary directory while planning, moved to
    --out's staging directory, where its shards will be downloaded; the plan rooted there."""
    staging = out_dir / STAGING_DIR_NAME
    try:
        shutil.copytree(plan.source.root, staging, dirs_exist_ok=True)
    except (OSError, shutil.Error) as e:
        raise OutputError(f"{staging}: cannot stage the source's small files ({e})") from None
    shutil.rmtree(plan.source.root, ignore_errors=True)  # now, not at the end: a killed run leaves no copy
    return dataclasses.replace(plan, source=dataclasses.replace(plan.source, root=staging))


def _execute_streaming(
    plan: Plan,
    specs: list[JobSpec],
    repo: hub.HubRepo,
    workers: int,
    journal: Journal,
    progress: ProgressFn | None,
) -> tuple[dict[str, dict], int]:
    """execute(), each job's source shards downloaded just before it and deleted once it is
    recorded; also returns the peak bytes of source shards on disk."""
    todo = [(s.job.file, sorted(set(plan.inputs_of(s.job).values()))) for s in specs]
    with hub.ShardStreamer(repo, plan.source.root, todo, ahead=workers) as streamer:
        needs = dict(todo)

        def job_done(job_file, results):
            journal.record(job_file, results)
            streamer.release(job_file, needs[job_file])

        def inputs_ready(spec, timeout):
            return streamer.wait_for(spec.job.file, timeout)

        files = execute(specs, workers, progress=progress, on_job_done=job_done, inputs_ready=inputs_ready)
    return files, streamer.peak_on_disk
