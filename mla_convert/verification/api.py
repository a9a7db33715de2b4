"""`mla-convert verify`: prove a converted directory is complete, intact and numerically right.

    report = verify("/data/R1-channel-fp8", source="/data/DeepSeek-R1", workers=4)
    report.exit_code   # 0: every check passed, 1: a check failed

With `data_checks=False` (what `upload` runs first) only the structure and integrity groups run:
every file is hashed, no tensor's values are read.

Raises VerificationError (exit code 2) when verification cannot run: the directory is not an
mla-convert output, its manifest is unreadable, or --source cannot be opened or is not the source
the directory was converted from (its fingerprint is not the one recorded: one line, rather than
every comparison that follows from it reported as the output's failure).

Five check groups (see report.GROUP_TITLES). The header pass (structure) runs first in this
process. Then each file gets a task (tasks) and is read once, front to back (data_pass): hashed, and
each tensor checked from the same buffer, in the native kernels where they cover the check and
it passes (native_pass), else in torch; runners runs one file at a time on a 2-core host (two
above) on threads, or in worker processes with workers > 1. Last, the per-file hashes are compared with the conversion
manifest (integrity). Tolerances: bounds.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import time
from collections.abc import Callable
from pathlib import Path

from mla_convert.constants import CONFIG_NAME, MANIFEST_NAME
from mla_convert.errors import ConvertError, VerificationError
from mla_convert.output.manifest import manifest_problem
from mla_convert.plan.planner import make_plan
from mla_convert.process import resources
from mla_convert.results import VerifyReport
from mla_convert.settings import Options, ProgressFactory
from mla_convert.source.checkpoint import SourceCheckpoint, open_source
from mla_convert.source.resolve import resolve_source
from mla_convert.verification.bounds import TOLERANCES
from mla_convert.verification.card import check_card
from mla_convert.verification.integrity import check_integrity, check_source_identity
from mla_convert.verification.readers import reader_backend
from mla_convert.verification.report import MLA, SOURCE, VALUES, Tally, as_report
from mla_convert.verification.runners import run_files
from mla_convert.verification.structure import check_structure
from mla_convert.verification.tasks import FileResult, FileTask, file_tasks
from mla_convert.verification.written import check_not_sent_away


def verify(
    out_dir: str | Path,
    source: str | Path | None = None,
    *,
    workers: int = 1,
    progress_factory: ProgressFactory | None = None,
    data_checks: bool = True,
) -> VerifyReport:
    """Verify `out_dir` (an mla-convert output), optionally against its `source`. Returns the report.
    `data_checks=False`: structure and integrity only (every file hashed, no values read). The run's
    scope (process.resources) owns what its readers hold, let go when it returns; inside a run
    already open (upload's check), that run's."""
    with resources.run_scope():
        return _verify(Path(out_dir), source, workers, progress_factory, data_checks)


RunTasks = Callable[[list[FileTask], Path, int, "ProgressFactory | None"], dict[str, FileResult]]


def verify_with(
    root: Path,
    source: str | Path | None,
    run_tasks: RunTasks,
    *,
    label: str,
    workers: int = 1,
    progress_factory: ProgressFactory | None = None,
) -> VerifyReport:
    """Every check of `verify` on `root`, the data pass run by `run_tasks(tasks, root, workers,
    progress_factory)` (each file's result, by path) instead of runners.run_files: for a directory
    whose files are brought in and taken away as the pass goes (verification.remote streams a Hub
    repo's through one). `label`: what the report says was checked."""
    with resources.run_scope():
        return _verify(root, source, workers, progress_factory, True, run_tasks, label)


def _verify(
    root: Path,
    source: str | Path | None,
    workers: int,
    progress_factory: ProgressFactory | None,
    data_checks: bool,
    run_tasks: RunTasks = run_files,
    label: str | None = None,
) -> VerifyReport:
    t0 = time.perf_counter()
    if workers < 1:
        raise VerificationError(f"--workers {workers}: must be at least 1")
    manifest = _read_conversion_manifest(root)
    check_not_sent_away(root, manifest)
    options = _recorded_options(root, manifest)
    src = _open_source(source) if source is not None else None
    fingerprint = str(manifest.get("source_fingerprint"))
    if src is not None:
        check_is_its_source(root, src, source, options, fingerprint)
    plan = make_plan(src, options) if src is not None else None

    tally = Tally()
    if src is not None:
        check_source_identity(root, src, plan, fingerprint, manifest, tally)
    structure = check_structure(root, options.format, fingerprint, plan, tally)
    check_card(root, manifest, tally)
    tasks = file_tasks(root, structure, manifest, options, src)
    if not data_checks:
        tasks = [dataclasses.replace(t, header=None, tensors={}, mla=None) for t in tasks]  # hashed only
    # The data pass works from the tasks: what only the header pass and the task building read (the
    # source's headers, its plan, each tensor's expectation) is let go before it, rather than held
    # through it (at DeepSeek-R1's size, with --source, about half of what the structures take).
    source_root = None if src is None else str(src.root)
    del src, plan
    structure = structure.after_tasks()
    # Chosen here for the report, and before the file threads need them (probed with torch only
    # where no pass is remembered on this machine); worker processes find the same record.
    readers = reader_backend() if data_checks else None
    collecting = gc.isenabled()
    gc.disable()  # the data pass makes few objects: collections would only walk the headers' many, again and again
    try:
        results = run_tasks(tasks, root, workers, progress_factory)
    finally:
        if collecting:
            gc.enable()
    for r in results.values():
        tally.merge(r.tally)
    check_integrity(root, manifest, structure, results, tally)

    skipped = {} if source_root is not None else {SOURCE: "no --source given"}
    if not data_checks:
        skipped |= dict.fromkeys((VALUES, SOURCE, MLA), "structure and integrity only")
    info = {
        "dir": label or str(root),
        "source": source_root,
        "format": options.format,
        "target": options.target,
        "fp8_max": options.fp8_max,
        "files": len(results),
        "tensors": sum(len(h.tensors) for h in structure.headers.values()),
        "mla_layers": len(structure.mla_headers),
        "workers": workers,
        "readers": readers.name if readers else "none",
        "readers_reason": readers.reason if readers else "no tensor values read",
        "tolerances": TOLERANCES,
    }
    return dataclasses.replace(as_report(tally, skipped, info), seconds=round(time.perf_counter() - t0, 3))


def _read_conversion_manifest(root: Path) -> dict:
    if not root.exists():
        raise VerificationError(f"{root}: no such directory")
    if not root.is_dir():
        raise VerificationError(f"{root}: not a directory")
    path = root / MANIFEST_NAME
    if not path.exists():
        hint = ""
        try:
            qc = json.loads((root / CONFIG_NAME).read_text()).get("quantization_config") or {}
            if qc.get("quant_method") == "fp8":
                hint = " (it looks like a block-FP8 source checkpoint: pass it as --source of its conversion)"
        except (OSError, ValueError, AttributeError):
            pass
        raise VerificationError(f"{root}: not an mla-convert output: no {MANIFEST_NAME}{hint}")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise VerificationError(f"{path}: unreadable conversion manifest ({e})") from e
    problem = manifest_problem(manifest)
    if problem:
        raise VerificationError(f"{path}: not an mla-convert manifest ({problem})")
    return manifest


def _recorded_options(root: Path, manifest: dict) -> Options:
    """The conversion's options, as its manifest records them."""
    try:
        return Options(
            **{k: manifest["options"][k] for k in ("format", "target")},
            ignore=tuple(manifest["options"].get("ignore") or ()),
        )
    except (ConvertError, KeyError, TypeError) as e:
        raise VerificationError(f"{root / MANIFEST_NAME}: unusable options {manifest.get('options')!r} ({e})") from e


def check_is_its_source(root: Path, src: SourceCheckpoint, given: str | Path, options: Options, recorded: str) -> None:
    """VerificationError unless `src` is the source `root` was converted from (its fingerprint,
    over config, index and shard headers, is the one the manifest records): another source's
    comparisons would all fail, and say nothing of the output."""
    fingerprint = src.fingerprint()
    if fingerprint == recorded:
        return
    raise VerificationError(
        f"--source {given}: this is not the source this directory was converted from: recorded {recorded}, given "
        f"{fingerprint}{_config_difference(root, src, options)}; without --source, verify checks the directory alone"
    )


def _config_difference(root: Path, src: SourceCheckpoint, options: Options) -> str:
    """Where the config `src` implies differs from the directory's (config keys), as a clause;
    empty when it does not (the index or a shard header differs) or it cannot be told."""
    try:
        plan = make_plan(src, options)
        config = json.loads((root / plan.config_name).read_text())
    except (ConvertError, OSError, ValueError):
        return ""
    if not isinstance(config, dict):
        return ""
    keys = sorted(k for k in set(config) | set(plan.config) if config.get(k) != plan.config.get(k))
    return f"; its config differs in {keys}" if keys else ""


def _open_source(source: str | Path) -> SourceCheckpoint:
    try:
        return open_source(resolve_source(str(source)))
    except ConvertError as e:
        raise VerificationError(f"--source: {e}") from e
