"""Run the shard jobs of a conversion: one at a time in this process (each job's commits overlapping
the next job), or up to N at once in worker processes; with --stream, each job's source shards
downloaded just before it and deleted once it is recorded (with a sink, once the sink is done with
them: conversion.sink)."""

from __future__ import annotations

import collections
from collections.abc import Callable
from pathlib import Path

from mla_convert.constants import WRITE_AUTO
from mla_convert.conversion.shard_job import (
    PendingFiles,
    ShardJobSpec,
    committed,
    run_reported_shard_job,
    start_shard_job,
)
from mla_convert.conversion.sink import Run, Sink
from mla_convert.conversion.stages import CONVERT, DOWNLOAD
from mla_convert.errors import ConvertError
from mla_convert.io.shard_writer import BackgroundCommits
from mla_convert.output.journal import Journal, remove_partials
from mla_convert.plan.planner import Plan
from mla_convert.process.interrupts import crash_point
from mla_convert.process.pool import WorkerPool
from mla_convert.process.workers import WorkerDied
from mla_convert.settings import ProgressFn
from mla_convert.source import hub

JobDone = Callable[[str, list], None]  # (job file, [(relative path, size, sha256)])
InputsReady = Callable[[ShardJobSpec, float | None], bool]  # (spec, timeout) -> the job's sources are there
RecordFn = Callable[[ShardJobSpec, list], None]  # the step after each finished job (execute's record)


def execute(
    specs: list[ShardJobSpec],
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

    def record(spec: ShardJobSpec, results: list[tuple[str, int, str]]) -> None:
        """The one step after a job, in either scheduler: note its files, tell the caller, crash point."""
        for rel, size, sha in results:
            files[rel] = {"size": size, "sha256": sha}
        if on_job_done:
            on_job_done(spec.shard.file, results)
        crash_point(f"after-job:{spec.shard.file}")

    if workers <= 1:
        run_in_process(specs, record, progress, inputs_ready)
    else:
        run_in_pool(specs, workers, record, progress, inputs_ready)
    return files


def run_in_process(
    specs: list[ShardJobSpec], record: RecordFn, progress: ProgressFn | None, inputs_ready: InputsReady | None
) -> None:
    """One job at a time in this process; its files' commits overlap the next job, and finished
    jobs are recorded in order."""
    with BackgroundCommits() as commits:
        waiting: collections.deque[tuple[ShardJobSpec, PendingFiles]] = collections.deque()

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
    specs: list[ShardJobSpec],
    workers: int,
    record: RecordFn,
    progress: ProgressFn | None,
    inputs_ready: InputsReady | None,
) -> None:
    """Up to `workers` jobs at once in worker processes (process.pool), each recorded as it finishes.
    Progress moves with each tensor a worker finishes, and a job's unreported rest when it is recorded."""
    try:
        with WorkerPool(workers, record, progress) as pool:
            for spec in specs:
                while pool.running >= workers:
                    pool.collect()
                # Keep collecting while waiting for inputs: a finished job frees the shards (and the
                # download window) that the next job's inputs may be waiting for.
                while inputs_ready and not inputs_ready(spec, 0.05 if pool.running else None):
                    if pool.running:
                        pool.collect(0.05)
                pool.submit(run_reported_shard_job, spec, spec.shard.file, sum(t.nbytes for t in spec.sources.values()))
            pool.run_all()
    except BaseException as e:
        # Ctrl-C or a failed job: the pool stopped the other jobs; remove the files they were
        # writing (a killed job cannot remove its own).
        if specs:
            remove_partials(Path(specs[0].out_dir))
        if isinstance(e, WorkerDied):
            more = "use fewer --workers, then " if e.out_of_memory else ""
            raise ConvertError(f"{e}; {more}finish it with the same command and --resume") from e
        raise


def execute_streaming(
    plan: Plan,
    specs: list[ShardJobSpec],
    repo: hub.HubRepo,
    workers: int,
    journal: Journal,
    progress: ProgressFn | None,
    sink: Sink | None = None,
    run: Run | None = None,
    recheck: list[str] = (),
    write_io: str = WRITE_AUTO,
) -> tuple[dict[str, dict], int]:
    """execute(), each job's source shards downloaded just before it and deleted once it is
    recorded; also returns the peak bytes of source shards on disk. The shards are written as
    `write_io` says (the run's --write-io, resolved for --out, whose staging directory they go to).

    With a `sink` (conversion.sink), the shards of the kept jobs in `recheck` are downloaded first,
    each job's shards and its output files are reserved together in the sink's budget before the
    download, a recorded job goes to the sink, and the sink releases its shards (once checked)."""
    by_file = {shard.file: shard for shard in plan.shards}
    jobs = [*recheck, *(s.shard.file for s in specs)]
    todo = [(j, sorted(set(plan.inputs_of(by_file[j]).values()))) for j in jobs]
    extra = {s.shard.file: sink.extra(s.shard.file) for s in specs} if sink else None
    busy = (lambda: sink.clock.busy(DOWNLOAD)) if sink else None
    ahead = workers + 1 if sink else workers  # with a sink, a job's shards stay until it is checked
    budget = sink.budget if sink else None
    with hub.ShardStreamer(
        repo, plan.source.root, todo, ahead, budget=budget, extra=extra, busy=busy, write_mode=write_io
    ) as streamer:
        needs = dict(todo)
        if sink:
            sink.started(run, _Streamed(streamer, needs))

        def job_done(job_file, results):
            journal.record(job_file, results)
            if sink:
                sink.clock.stop(CONVERT)
                sink.written(job_file, results)
            else:
                streamer.release(job_file, needs[job_file])

        def inputs_ready(spec, timeout):
            ready = streamer.wait_for(spec.shard.file, timeout)
            if sink:
                sink.raise_error()
                if ready:
                    sink.clock.start(CONVERT)
            return ready

        files = execute(specs, workers, progress=progress, on_job_done=job_done, inputs_ready=inputs_ready)
    return files, streamer.peak_on_disk


class _Streamed:
    """The streamer as a sink's Sources (conversion.sink)."""

    def __init__(self, streamer: hub.ShardStreamer, needs: dict[str, list[str]]):
        self.streamer, self.needs = streamer, needs

    def wait(self, job: str, timeout: float | None = None) -> bool:
        return self.streamer.wait_for(job, timeout)

    def release(self, job: str) -> None:
        self.streamer.release(job, self.needs[job])
