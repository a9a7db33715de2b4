"""A conversion, stage by stage (docs/design.md, "The conversion pipeline"):

1. open the source from its headers (a Hub source by range requests, before any download) and
   validate it;
2. plan every output shard;
3. preflight: --out usable, what --resume keeps or --overwrite replaces, room on the filesystems;
4. download a Hub source that is not streamed, and check it is what was planned;
5. choose and probe the kernels;
6. prepare --out (an earlier output deleted, the write mode probed, the manifest 'incomplete');
7. the shard jobs, journaled (with --stream, each job's shards downloaded just in time);
8. finalize: side files, config, index, MLA manifest, then the manifest 'complete'.

A sink (conversion.sink; `convert --upload`: publish.hub_to_hub) takes each job's files further
once journaled, within its disk budget, and is asked at each stage: its refusals come with the
plan's, before anything is written.

What can refuse a run from headers alone runs before anything is downloaded or written, and a
dry run runs all of it (the lock of --out only checked) and stops there, as the real run would
refuse. The run holds --out's lock (output.lock) from the preflight, or from when it creates --out,
to its end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import time
from pathlib import Path

from mla_convert.constants import INCOMPLETE, MLA_DIR_NAME, STAGING_DIR_NAME
from mla_convert.conversion.compute import Compute, check_device, choose_compute
from mla_convert.conversion.finalize import finalize, unmake_model
from mla_convert.conversion.scales import check_scale_values
from mla_convert.conversion.schedulers import execute, execute_streaming
from mla_convert.conversion.shard_job import shard_job_specs
from mla_convert.conversion.sink import Run, Sink
from mla_convert.conversion.stages import CONVERT
from mla_convert.errors import OutputError, SourceError
from mla_convert.io import disk_write
from mla_convert.kernels.modes import check_request
from mla_convert.output import preflight
from mla_convert.output.card import BASE_MODEL_HINT
from mla_convert.output.card_facts import SourceRef, source_ref
from mla_convert.output.journal import Journal
from mla_convert.output.lock import check_unlocked, locked
from mla_convert.output.manifest import write_manifest
from mla_convert.output.out_dir import check_location
from mla_convert.plan.ignore import check_patterns
from mla_convert.plan.planner import Plan, make_plan
from mla_convert.process import resources
from mla_convert.results import ConversionResult
from mla_convert.settings import Options, RunSettings
from mla_convert.source import hub
from mla_convert.source.checkpoint import SourceCheckpoint, open_source
from mla_convert.source.resolve import open_planned_source, resolve_source
from mla_convert.units import gb


def convert(
    source: str | Path,
    out_dir: str | Path,
    options: Options = Options(),  # noqa: B008 (frozen: one shared default is safe)
    settings: RunSettings = RunSettings(),  # noqa: B008 (frozen, as options)
    *,
    sink: Sink | None = None,
    **changes,
) -> ConversionResult:
    """Convert `source` into `out_dir`. Returns what was planned and done (`to_json()`: the CLI's
    --json output).

    `options` says what to produce, `settings` how (RunSettings); keyword arguments replace fields
    of `settings`: `convert(src, out, options, workers=2)`. With `settings.stream`, shards are
    downloaded just in time and deleted once converted. `sink`: where the files go once written
    (conversion.sink; default: they stay in `out_dir`).
    """
    options.check_new_conversion()
    run = _Conversion(str(source), Path(out_dir), options, dataclasses.replace(settings, **changes), sink)
    # The run's scope owns what it allocates for its own use (staging buffers, the shard jobs'
    # buffers, the native kernels' threads: every run gets its own), closed after the cleanup.
    with resources.run_scope(), contextlib.ExitStack() as cleanup:
        run.cleanup = cleanup
        try:
            run.open_source(cleanup)
            run.make_plan()
            run.preflight()
            if run.settings.dry_run:  # every check above ran, as in the real run; nothing is written
                check_device(run.settings.device)
                check_request(run.settings.kernels)  # --kernels native that cannot build here
                run.sink.close(None)
                return run.result
            run.download()
            run.choose_kernels()
            run.prepare_output()
            run.convert_shards()
            run.finalize()
        except BaseException as e:
            run.sink.close(e)
            raise
        run.sink.close(None)
    return run.result


def _quiet(message: str) -> None:
    pass


class _Conversion:
    """One conversion's state, as the stages build it up."""

    def __init__(self, source: str, out_dir: Path, options: Options, settings: RunSettings, sink: Sink | None = None):
        self.source, self.out_dir, self.options, self.settings = source, out_dir, options, settings
        self.sink = sink or Sink()
        self.status = settings.status or _quiet
        self.t0 = time.perf_counter()
        self.src: SourceCheckpoint | None = None
        self.repo: hub.HubRepo | None = None  # while only the headers of a Hub source are here
        self.plan: Plan | None = None
        self.state: preflight.OutputState | None = None
        self.compute: Compute | None = None
        self.write_io: str | None = None
        self.result: ConversionResult | None = None  # from the plan on; each stage adds its fields (`record`)
        self.download_bytes: int | None = None  # a Hub source to download first: what is not in the cache
        self.cache: Path | None = None
        self.cleanup: contextlib.ExitStack | None = None  # what convert() undoes at the end: the lock, ...
        self.lock = None  # --out's lock while this run holds it (output.lock)
        self.origin: SourceRef | None = None  # where the source came from, for the card and the manifest

    def record(self, **fields) -> None:
        """Add a stage's fields to the result (a field the result lacks fails here, at once)."""
        self.result = dataclasses.replace(self.result, **fields)

    @property
    def streaming(self) -> bool:
        return self.repo is not None and self.settings.stream

    # --- 1. the source, from its headers ----------------------------------------------------------

    def open_source(self, cleanup: contextlib.ExitStack) -> None:
        s = self.settings
        self.src, self.repo = open_planned_source(self.source, s.revision, s.stream, cleanup, self.status)
        repo = self.repo
        base = self.options.base_model
        self.origin = (
            source_ref(self.src.root, repo.repo_id, repo.commit, base)
            if repo
            else source_ref(self.src.root, base_model=base)
        )
        if self.repo is None:  # on disk: its scales are read now, before anything is written
            check_scale_values(self.src)

    # --- 2. the plan ------------------------------------------------------------------------------

    def make_plan(self) -> None:
        s, repo = self.settings, self.repo
        self.plan = make_plan(self.src, self.options)
        by_pattern = check_patterns(self.plan)  # a pattern that keeps nothing is a typo: refused
        self.result = ConversionResult(
            **self.plan.summary(),
            ignored_by_pattern=by_pattern or None,
            out=str(self.out_dir),
            dry_run=s.dry_run,
            workers=s.workers,
            device=s.device,
        )
        if repo is not None:
            self.record(**_hub_summary(repo, self.plan, s.workers), source=f"{repo.repo_id}@{repo.commit}")
            if not s.stream:
                self.download_bytes, self.cache = hub.bytes_to_download(repo), hub.cache_dir()
        self.record(**self.sink.planned(self.plan, repo, self.origin))

    # --- 3. preflight -----------------------------------------------------------------------------

    def lock_output(self) -> None:
        """Hold --out's lock from now to the end of the run (a dry run only checks it); refused,
        naming the holder, when another run has it."""
        if self.settings.dry_run:
            check_unlocked(self.out_dir)
        elif self.lock is None and self.out_dir.is_dir():
            self.lock = self.cleanup.enter_context(locked(self.out_dir, "convert", self.settings.notice))

    def preflight(self) -> None:
        self.lock_output()
        plan, s = self.plan, self.settings
        conversion = preflight.Conversion(
            plan.options.as_dict(), self.src.fingerprint(), None if self.repo else self.src.root,
            plan.job_outputs(), plan.writes(),
        )  # fmt: skip
        self.state = preflight.inspect_output(conversion, self.out_dir, s, self.sink.held)
        self.record(**self.sink.resumed(self.state.kept))
        budget = None  # the most a --upload run may hold: its budget, or all it converts where that is less
        if self.sink.budget is not None:
            budget = min(self.sink.budget.limit, self.result.disk_peak_planned or self.sink.budget.limit)
        self.record(
            **preflight.space(
                self.result.to_json(), self.out_dir, s, self.state, self.download_bytes, self.cache, budget
            )
        )
        preflight.check_room(self.result.to_json(), self.out_dir, s)
        if self.repo is not None and s.notice and not s.dry_run:
            s.notice(preflight.plan_line(self.result.to_json(), self.out_dir, s.stream))

    # --- 4. the download of a Hub source that is not streamed ---------------------------------------

    def download(self) -> None:
        """The whole source into the Hub cache, checked, and converted from there: the plan is
        rooted there once the downloaded headers are the planned ones."""
        if self.repo is None or self.settings.stream:
            return
        repo, planned = self.repo, self.src.fingerprint()
        self.status(f"downloading {self.source} ({gb(self.download_bytes)}) to {self.cache}")
        self.status(f"reading the headers of {self.source}")
        src = open_source(resolve_source(self.source, self.settings.revision))
        check_scale_values(src)
        # The download resolves the revision again (so the cache records it for offline use): it
        # must be the commit, and the headers, that the plan and its checks were made for.
        if src.root.name != repo.commit or src.fingerprint() != planned:
            raise SourceError(
                f"{self.source}: revision {self.settings.revision or 'main'!r} moved on the Hub while it was "
                f"planned (planned commit {repo.commit}, downloaded {src.root.name}); run the command again, or "
                "pass --revision with a commit hash"
            )
        self.src, self.repo = src, None
        self.plan = dataclasses.replace(self.plan, source=src)

    # --- 5. the kernels ---------------------------------------------------------------------------

    def choose_kernels(self) -> None:
        self.compute, chosen = choose_compute(self.plan, self.settings)
        self.record(**chosen)

    # --- 6. --out, as the run starts ----------------------------------------------------------------

    def prepare_output(self) -> None:
        out_dir = self.out_dir
        if self.repo is None:  # a downloaded source lies in the Hub cache: checked against --out only now
            check_location(out_dir, self.plan.source.root)
        preflight.prepare(out_dir, self.state)
        self.lock_output()  # a new --out: locked as soon as it exists, before anything is written in it
        if self.streaming:
            self.plan = _staged_in(self.plan, out_dir)
        try:  # before the first byte of output: a refused --write-io direct leaves nothing behind
            self.write_io, why = disk_write.resolve_mode(out_dir, self.settings.write_io)
        except OSError as e:
            raise OutputError(f"--write-io: {e}") from e
        self.record(write_io=self.write_io, write_io_reason=why)
        write_manifest(out_dir, INCOMPLETE, self.plan.options.as_dict(), self.plan.source.fingerprint(), {})
        unmake_model(self.plan, out_dir)  # a resumed run's: until finalize, nothing here looks loadable
        (out_dir / MLA_DIR_NAME).mkdir(exist_ok=True)

    # --- 7. the shard jobs ------------------------------------------------------------------------

    def convert_shards(self) -> None:
        plan, s, done = self.plan, self.settings, self.state.kept
        journal = Journal(self.out_dir)
        # What this run converts: a resume's kept jobs are not counted, so speed and time left are this run's.
        todo = plan.source.total_bytes() - sum(plan.in_bytes(j) for j in plan.shards if j.file in done)
        progress = s.progress_factory(max(todo, 0)) if s.progress_factory else None
        self.files = {rel: {"size": n, "sha256": h} for entries in done.values() for rel, n, h in entries}
        specs = [
            sp for sp in shard_job_specs(plan, self.out_dir, self.compute, self.write_io) if sp.shard.file not in done
        ]
        sink = self.sink
        if sink.active:
            recheck = sink.to_check(done)
            run = Run(plan, self.out_dir, journal, done, [sp.shard.file for sp in specs])
        if self.streaming:
            streamed, peak = execute_streaming(
                plan, specs, self.repo, s.workers, journal, progress,
                *((sink, run, recheck) if sink.active else ()), write_io=self.write_io,
            )  # fmt: skip
            self.files |= streamed
            self.record(peak_source_bytes_on_disk=peak)
        elif sink.active:
            sink.started(run, _OnDisk())

            def written(job_file: str, results: list) -> None:
                journal.record(job_file, results)
                sink.clock.stop(CONVERT)
                sink.written(job_file, results)

            def admitted(spec, timeout: float | None) -> bool:
                if not sink.admit(spec.shard.file, timeout):
                    return False
                sink.clock.start(CONVERT)
                return True

            self.files |= execute(specs, s.workers, progress=progress, on_job_done=written, inputs_ready=admitted)
        else:
            self.files |= execute(specs, s.workers, progress=progress, on_job_done=journal.record)

    # --- 8. finalize ------------------------------------------------------------------------------

    def finalize(self) -> None:
        src = self.plan.source
        if self.sink.active:
            self.sink.finishing()
        self.origin = finalize(self.plan, self.out_dir, self.files, self.origin)
        if self.sink.active:  # the last jobs' checks may still read the source; the journal stays
            self.record(**self.sink.finished(self.files))
        else:
            Journal(self.out_dir).remove()
        if self.streaming:
            hub.remove_staging(src.root)
        seconds = time.perf_counter() - self.t0
        self.record(
            status="complete",
            resumed_jobs=len(self.state.kept),
            files=len(self.files),
            seconds=round(seconds, 3),
            gb_per_s=round(src.total_bytes() / seconds / 1e9, 3),
            source_fingerprint=src.fingerprint(),
            base_model=self.origin.base_model if self.options.card else None,
            base_model_hint=BASE_MODEL_HINT if self.options.card and not self.origin.base_model else None,
        )


class _OnDisk:
    """A local source's shards, for a sink: always there, never deleted."""

    def wait(self, job: str, timeout: float | None = None) -> bool:
        return True

    def release(self, job: str) -> None:
        pass


def _hub_summary(repo: hub.HubRepo, plan: Plan, workers: int) -> dict:
    shard_sizes = sorted((f.size or 0 for p, f in repo.files.items() if p.endswith(".safetensors")), reverse=True)
    out = plan.summary()["bytes_out"]
    return {
        "hub_commit": repo.commit,
        "download_bytes": sum(f.size or 0 for f in repo.files.values()),
        # Download then convert: the whole source and the output side by side.
        "disk_required_download_then_convert": out + sum(shard_sizes),
        # --stream: the output plus the shards of the jobs in flight and prefetched (and a partner).
        "disk_required_stream": out + sum(shard_sizes[: workers + 2]),
    }


def _staged_in(plan: Plan, out_dir: Path) -> Plan:
    """--stream: the source's small files, staged in a temporary directory while planning, moved to
    --out's staging directory, where its shards will be downloaded; the plan rooted there."""
    staging = out_dir / STAGING_DIR_NAME
    try:
        shutil.copytree(plan.source.root, staging, dirs_exist_ok=True)
    except (OSError, shutil.Error) as e:
        raise OutputError(f"{staging}: cannot stage the source's small files ({e})") from e
    shutil.rmtree(plan.source.root, ignore_errors=True)  # now, not at the end: a killed run leaves no copy
    return dataclasses.replace(plan, source=dataclasses.replace(plan.source, root=staging))
