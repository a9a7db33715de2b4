"""`mla-convert verify`: prove a converted directory is complete, intact and numerically right.

    report = verify("/data/R1-channel-fp8", source="/data/DeepSeek-R1", workers=4)
    report["exit_code"]   # 0: every check passed, 1: a check failed

Raises VerificationError (exit code 2) when verification cannot run: the directory is not an
mla-convert output, its manifest is unreadable, or --source cannot be opened.

Five check groups (see report.GROUP_TITLES). The header pass (structure) runs first
in this process; then every file is read once, front to back, by stream (two files at a
time on threads, or in worker processes with workers > 1), which hashes it and checks each tensor
from the same buffer; the per-file hashes are then compared with the conversion manifest.
Tolerances: bounds.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import threading
import time
from pathlib import Path

from mla_convert.constants import (
    CHANNEL_SCALE_SUFFIX,
    COMPLETE,
    CONFIG_NAME,
    FLOAT_WEIGHT_DTYPES,
    MANIFEST_NAME,
    MLA_DIR_NAME,
    SIGNED_ZERO,
    TOOL_NAME,
)
from mla_convert.errors import ConvertError, VerificationError
from mla_convert.plan.ops import CHANNEL_FP8_OPS, FP8_SCALE, TO_BF16, TO_FP8
from mla_convert.plan.planner import Plan, make_plan
from mla_convert.process.workers import process_pool
from mla_convert.process.workers import stop as stop_workers
from mla_convert.settings import Options, ProgressFactory
from mla_convert.source.checkpoint import SourceCheckpoint, open_source
from mla_convert.source.resolve import resolve_source
from mla_convert.verification.bounds import TOLERANCES
from mla_convert.verification.order import FILE_THREADS, largest_first
from mla_convert.verification.readers import fp8_readers
from mla_convert.verification.report import INTEGRITY, MLA, SOURCE, Tally, as_report
from mla_convert.verification.rows import Ref
from mla_convert.verification.stream import run_file_task
from mla_convert.verification.structure import Structure, check_structure
from mla_convert.verification.tasks import FileResult, FileTask, MlaJob, TensorJob
from mla_runtime.format import MlaManifest, kv_b_name, layer_file_name


def verify(
    out_dir: str | Path,
    source: str | Path | None = None,
    *,
    workers: int = 1,
    progress_factory: ProgressFactory | None = None,
) -> dict:
    """Verify `out_dir` (an mla-convert output), optionally against its `source`. Returns the report."""
    t0 = time.perf_counter()
    if workers < 1:
        raise VerificationError(f"--workers {workers}: must be at least 1")
    root = Path(out_dir)
    manifest = _read_conversion_manifest(root)
    options = _recorded_options(root, manifest)
    src = _open_source(source) if source is not None else None
    plan = make_plan(src, options) if src is not None else None

    tally = Tally()
    fingerprint = str(manifest.get("source_fingerprint"))
    if src is not None:
        _check_source_identity(root, src, plan, fingerprint, manifest, tally)
    layout = check_structure(root, options.format, fingerprint, plan, tally)
    tasks = _file_tasks(root, layout, manifest, options, src)
    # Probed here for the report, and before the file threads need them; worker processes probe
    # the same library on the same CPU.
    readers = fp8_readers()
    results = _run(tasks, root, workers, progress_factory)
    for r in results.values():
        tally.merge(r.tally)
    _check_integrity(root, manifest, layout, results, tally)

    skipped = {} if src is not None else {SOURCE: "no --source given"}
    info = {
        "dir": str(root),
        "source": None if src is None else str(src.root),
        "format": options.format,
        "target": options.target,
        "fp8_max": options.fp8_max,
        "files": len(results),
        "tensors": sum(len(h.tensors) for h in layout.headers.values()),
        "mla_layers": len(layout.mla_headers),
        "workers": workers,
        "readers": readers.name,
        "readers_reason": readers.reason,
        "tolerances": TOLERANCES,
    }
    report = as_report(tally, skipped, info)
    report["seconds"] = round(time.perf_counter() - t0, 3)
    return report


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
    if (
        not isinstance(manifest, dict)
        or manifest.get("tool") != TOOL_NAME
        or not isinstance(manifest.get("files"), dict)
    ):
        raise VerificationError(f"{path}: not an mla-convert manifest (no tool/files entries)")
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


def _open_source(source: str | Path) -> SourceCheckpoint:
    try:
        return open_source(resolve_source(str(source)))
    except ConvertError as e:
        raise VerificationError(f"--source: {e}") from e


def _check_source_identity(
    root: Path, src: SourceCheckpoint, plan: Plan, fingerprint: str, manifest: dict, tally: Tally
):
    """The output was converted from this source, and its config.json is what the source implies."""
    tally.expect(
        src.fingerprint() == fingerprint,
        SOURCE,
        "fingerprint",
        MANIFEST_NAME,
        expected=f"{src.fingerprint()} (fingerprint of --source)",
        found=fingerprint,
    )
    try:
        config = json.loads((root / CONFIG_NAME).read_text())
    except (OSError, ValueError):
        return  # reported by the structure checks
    keys = sorted(k for k in set(config) | set(plan.config) if config.get(k) != plan.config.get(k))
    tally.expect(
        not keys,
        SOURCE,
        "config",
        CONFIG_NAME,
        expected="the source's config with the conversion's quantization_config",
        found=f"differs in {keys}",
    )
    for rel in src.side_files:
        tally.expect(
            rel in manifest["files"] and (root / rel).is_file(),
            INTEGRITY,
            "side-file",
            rel,
            expected="copied from the source",
            found="missing",
        )


def _file_tasks(
    root: Path, lay: Structure, manifest: dict, options: Options, src: SourceCheckpoint | None
) -> list[FileTask]:
    common = {
        "root": str(root),
        "fp8_max": options.fp8_max,
        "signed_zero": SIGNED_ZERO[options.target],
        "block": src.block if src else None,
        "dims": lay.dims,
        "rope_dim": int((lay.config or {}).get("qk_rope_head_dim") or 0),
    }
    mla_files = {f"{MLA_DIR_NAME}/{layer_file_name(i)}": i for i in lay.mla_headers}
    rels = set(manifest["files"]) | set(lay.weight_map.values()) | set(mla_files)
    tasks = []
    for rel in sorted(rels):
        if rel in lay.headers:
            jobs = {n: j for n, info in lay.headers[rel].tensors.items() if (j := _tensor_job(n, info, lay, src))}
            tasks.append(FileTask(rel=rel, header=lay.headers[rel], tensors=jobs, **common))
        elif rel in mla_files:
            layer = mla_files[rel]
            tasks.append(FileTask(rel=rel, header=lay.mla_headers[layer], mla=_mla_job(layer, lay, src), **common))
        else:
            tasks.append(FileTask(rel=rel, header=None, **common))
    return tasks


def _matches(lay: Structure, name: str, info) -> bool:
    """The header agrees with the expectation (else the structure check failed already)."""
    exp = lay.expects.get(name)
    if exp is None or info is None or info.shape != exp.shape:
        return False
    return info.dtype == exp.dtype or (exp.dtype is None and info.dtype in FLOAT_WEIGHT_DTYPES)


def _tensor_job(name: str, info, lay: Structure, src: SourceCheckpoint | None) -> TensorJob | None:
    """What to check for a tensor beyond its values; None for one that does not match its
    expectation (only its values are checked)."""
    if not _matches(lay, name, info):
        return None
    exp = lay.expects[name]
    scale_name = name.rsplit(".", 1)[0] + CHANNEL_SCALE_SUFFIX if exp.op in CHANNEL_FP8_OPS else None
    source = source_scale = None
    if src is not None and exp.source is not None and exp.op != FP8_SCALE:
        source = _src_ref(src, exp.source)
        if exp.op in (TO_FP8, TO_BF16):
            source_scale = _src_ref(src, src.fp8[exp.source].scale.name)
    return TensorJob(exp.op, _out_ref(lay, scale_name) if scale_name else None, scale_name, source, source_scale)


def _mla_job(layer: int, lay: Structure, src: SourceCheckpoint | None) -> MlaJob:
    kv_b = kv_b_name(layer)
    source = source_scale = None
    if src is not None and kv_b in src.fp8:
        source, source_scale = _src_ref(src, kv_b), _src_ref(src, src.fp8[kv_b].scale.name)
    elif src is not None and kv_b in src.weight_map:  # a 16-bit source kv_b_proj
        source = _src_ref(src, kv_b)
    return MlaJob(layer, _out_ref(lay, kv_b), _out_ref(lay, f"{kv_b}_scale"), source, source_scale)


def _out_ref(lay: Structure, name: str) -> Ref | None:
    """Where an output tensor lies, if its header matches what it should be."""
    hd = lay.headers.get(lay.weight_map.get(name, ""))
    if hd is None or not _matches(lay, name, hd.tensors.get(name)):
        return None
    return Ref.of(hd.path, hd, name)


def _src_ref(src: SourceCheckpoint, name: str) -> Ref:
    rel = src.weight_map[name]
    return Ref.of(src.root / rel, src.headers[rel], name)


def _run(
    tasks: list[FileTask], root: Path, workers: int, progress_factory: ProgressFactory | None
) -> dict[str, FileResult]:
    sizes = {t.rel: _size(root / t.rel) for t in tasks}
    advance = progress_factory(sum(sizes.values())) if progress_factory else None
    results: dict[str, FileResult] = {}
    if workers <= 1 or len(tasks) <= 1:
        return _run_in_threads(tasks, sizes, advance)
    with process_pool(workers) as pool:
        try:
            futures = {pool.submit(run_file_task, t): t for t in _largest_first(tasks, sizes)}
            for fut in cf.as_completed(futures):
                task = futures[fut]
                results[task.rel] = fut.result()
                if advance:
                    advance(sizes[task.rel])
        except BaseException:  # Ctrl-C: the workers only read, so they are stopped where they are
            stop_workers(pool)
            raise
    return results


FILE_THREADS_NAME = "verify-file"


class _Stopped(Exception):
    """Raised in a file thread, between two tensors, once verify was interrupted."""


def _run_in_threads(tasks: list[FileTask], sizes: dict[str, int], advance) -> dict[str, FileResult]:
    """FILE_THREADS files at a time in this process, biggest first: the heavy parts (reads,
    sha256, the C and torch checks) release the GIL, so one file's hash overlaps another's checks.

    Interrupted (Ctrl-C in the main thread), it raises at once: the files not started are dropped,
    and each thread stops after the tensor it is checking (its memory is its own, nothing here
    waits for it)."""
    lock = threading.Lock()
    stop = threading.Event()

    def run_one(task: FileTask) -> FileResult:
        done = 0

        def step(n: int) -> None:
            nonlocal done
            if stop.is_set():
                raise _Stopped
            done += n
            if advance:
                with lock:
                    advance(n)

        result = run_file_task(task, step)
        if advance:
            with lock:
                advance(max(0, sizes[task.rel] - done))
        return result

    order = _largest_first(tasks, sizes)
    pool = cf.ThreadPoolExecutor(min(FILE_THREADS, len(order)) or 1, thread_name_prefix=FILE_THREADS_NAME)
    try:
        results = {t.rel: r for t, r in zip(order, pool.map(run_one, order), strict=True)}
    except BaseException:
        stop.set()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    return {t.rel: results[t.rel] for t in tasks}


def _largest_first(tasks: list[FileTask], sizes: dict[str, int]) -> list[FileTask]:
    by_rel = {t.rel: t for t in tasks}
    return [by_rel[rel] for rel in largest_first(sizes)]


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _check_integrity(root: Path, manifest: dict, lay: Structure, results: dict[str, FileResult], tally: Tally) -> None:
    """Every file's size and sha256 as the manifests record them; no file missing or unlisted."""
    status = manifest.get("status")
    if not tally.expect(
        status == COMPLETE,
        INTEGRITY,
        "status",
        MANIFEST_NAME,
        expected=f"status {COMPLETE!r}",
        found=f"status {status!r}: the conversion did not finish",
    ):
        return
    files: dict = manifest["files"]
    _check_listed_files(files, results, tally)
    _check_unlisted_files(root, files, tally)
    if lay.mla_manifest is not None:
        _check_against_mla_manifest(lay.mla_manifest, results, tally)
    for i in sorted(set(lay.mla_layers) - set(lay.mla_headers)):
        tally.fail(
            MLA,
            "artifact",
            f"{MLA_DIR_NAME}/{layer_file_name(i)}",
            f"layer {i}",
            expected="W_UK_T and W_UV of this layer",
            found="no readable artifact file",
        )


def _check_listed_files(files: dict, results: dict[str, FileResult], tally: Tally) -> None:
    """Each file the conversion manifest lists is there, with the recorded size and sha256."""
    for rel in sorted(files):
        meta, r = files[rel], results.get(rel)
        if r is None or r.size is None:
            tally.fail(INTEGRITY, "missing-file", rel, expected=f"{meta.get('size')} bytes", found="missing")
        elif r.sha256 is not None:
            tally.expect(r.size == meta.get("size"), INTEGRITY, "size", rel, expected=meta.get("size"), found=r.size)
            tally.expect(
                r.sha256 == meta.get("sha256"), INTEGRITY, "sha256", rel, expected=meta.get("sha256"), found=r.sha256
            )


def _check_unlisted_files(root: Path, files: dict, tally: Tally) -> None:
    """No file on disk that the conversion manifest does not list."""
    for rel in _files_on_disk(root):
        if rel != MANIFEST_NAME:
            tally.expect(
                rel in files,
                INTEGRITY,
                "unlisted-file",
                rel,
                expected="only files the manifest lists",
                found="a file the conversion did not write",
            )


def _check_against_mla_manifest(mla_manifest: MlaManifest, results: dict[str, FileResult], tally: Tally) -> None:
    """Each artifact file read has the size and sha256 the MLA manifest records."""
    for e in mla_manifest.layers:
        rel = f"{MLA_DIR_NAME}/{e.file}"
        r = results.get(rel)
        if r is not None and r.sha256 is not None:
            tally.expect(
                (r.size, r.sha256) == (e.size, e.sha256),
                INTEGRITY,
                "mla-manifest",
                rel,
                expected=f"{e.size} bytes, sha256 {e.sha256} (mla/manifest.json)",
                found=f"{r.size} bytes, sha256 {r.sha256}",
            )


def _files_on_disk(root: Path) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        out += [os.path.relpath(os.path.join(dirpath, f), root) for f in filenames if not f.startswith(".")]
    return sorted(out)
