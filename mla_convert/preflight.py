"""Before the first byte of a conversion: can --out be written, what does --resume keep or
--overwrite replace, and do the filesystems have room for what the plan writes (and, for a Hub
source, downloads). A refusal here leaves every disk as it was.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mla_runtime.format import CONFIG_NAME, MLA_DIR_NAME
from mla_runtime.format import MANIFEST_NAME as MLA_MANIFEST_NAME

from . import out_dir as out
from .checkpoint import INDEX_NAME
from .errors import OutputError
from .manifest import COMPLETE, MANIFEST_NAME, readable_manifest
from .plan import Plan, mla_file_rel
from .resume import completed_jobs
from .settings import RunSettings

Kept = dict[str, list[tuple[str, int, str]]]  # job file -> its files (relative path, size, sha256)


def job_outputs(plan: Plan) -> dict[str, list[str]]:
    """Each shard job's files: its shard and the MLA layer files of the kv_b_proj it holds."""
    return {job.file: [job.file, *map(mla_file_rel, job.mla_layers)] for job in plan.shards}


def plan_writes(plan: Plan) -> set[str]:
    """Every file the conversion writes, relative to --out."""
    files = {rel for rels in job_outputs(plan).values() for rel in rels}
    return files | set(plan.source.side_files) | {CONFIG_NAME, INDEX_NAME, f"{MLA_DIR_NAME}/{MLA_MANIFEST_NAME}"}


@dataclass(frozen=True)
class OutputState:
    """What is in --out before the run, and what happens to it."""

    kept: Kept  # --resume: the jobs whose files are there and intact
    earlier: out.Earlier | None = None  # --overwrite: the earlier output's files, deleted before the run

    @property
    def kept_bytes(self) -> int:
        return sum(size for files in self.kept.values() for _, size, _ in files)


def inspect_output(
    plan: Plan, out_dir: Path, settings: RunSettings, fingerprint: str, src_root: Path | None
) -> OutputState:
    """Refuse an --out that cannot be used, before anything is written; `src_root`: the local
    source's directory (None while only its headers are here, fetched from the Hub)."""
    out.check_writable(out_dir)
    if src_root is not None:
        out.check_location(out_dir, src_root)
    if settings.resume and (out_dir / MANIFEST_NAME).exists():
        if settings.status:
            settings.status(f"checking the files already in {out_dir} (--resume)")
        return OutputState(completed_jobs(out_dir, plan.options.as_dict(), fingerprint, job_outputs(plan)))
    if out.is_empty(out_dir) or (settings.resume and _only_staging(out_dir)):
        return OutputState({})
    if not settings.overwrite:
        if not out.is_earlier_output(out_dir):
            raise OutputError(
                f"{out_dir}: directory is not empty (it holds {out.some(out.files_under(out_dir))}); pick another "
                "--out (--overwrite replaces only an earlier mla-convert output)"
            )
        if (readable_manifest(out_dir) or {}).get("status") != COMPLETE:
            raise OutputError(f"{out_dir}: holds an unfinished conversion; pass --resume to finish it, or --overwrite")
        raise OutputError(
            f"{out_dir}: directory is not empty: it holds an earlier conversion; pass --overwrite to replace it"
        )
    return OutputState({}, out.earlier_output(out_dir, plan_writes(plan)))


def _only_staging(out_dir: Path) -> bool:
    """A --stream run stopped before its manifest: only its downloads are there, kept for the resume."""
    return all(p.name == out.STAGING_DIR_NAME for p in out_dir.iterdir())


def prepare(out_dir: Path, state: OutputState) -> None:
    """--out as the run starts: created, or the earlier output in it deleted (--overwrite)."""
    if state.earlier is not None:
        state.earlier.delete()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"{out_dir}: cannot create the output directory ({e.strerror or e})") from None


def space(
    summary: dict, out_dir: Path, settings: RunSettings, state: OutputState, download: int | None, cache: Path | None
) -> dict:
    """The free-space numbers of this run (summary entries): `disk_required` of `disk_free` on
    --out's filesystem (what --resume keeps is not needed again; with --stream, the source shards
    in flight count; a download to a Hub cache on the same filesystem counts), what --overwrite
    frees there first, and a download's own numbers when the cache is elsewhere. `download`: the
    bytes of a Hub source not yet in the cache `cache` (None: nothing is downloaded up front)."""
    needed = summary["disk_needed_stream"] if settings.stream else summary["disk_needed"]
    numbers = {"disk_required": max(0, needed - state.kept_bytes), "disk_free": out.disk_free(out_dir)}
    if state.earlier is not None:
        numbers["disk_freed_by_overwrite"] = state.earlier.nbytes
    if download is not None and cache is not None:
        if out.same_filesystem(cache, out_dir):
            numbers["disk_required"] += download
        else:
            numbers |= {"cache_dir": str(cache), "cache_required": download, "cache_free": out.disk_free(cache)}
    return numbers


def check_room(numbers: dict, out_dir: Path, settings: RunSettings) -> None:
    """Refuse a run the filesystems have no room for, unless told to ignore what they report."""
    if settings.ignore_free_space:
        return
    freed = numbers.get("disk_freed_by_overwrite", 0)
    available = numbers["disk_free"] + freed
    if numbers["disk_required"] > available:
        freed = f" (with the {out.gb(freed)} that --overwrite frees)" if freed else ""
        raise OutputError(
            f"{out_dir}: not enough free space: the conversion needs {out.gb(numbers['disk_required'])} there, "
            f"its filesystem has {out.gb(available)} free{freed}; free some space or pick another --out "
            "(--ignore-free-space skips this check where a filesystem misreports its free space)"
        )
    if numbers.get("cache_required", 0) > numbers.get("cache_free", 0):
        raise OutputError(
            f"{numbers['cache_dir']}: not enough free space to download the source: it needs "
            f"{out.gb(numbers['cache_required'])}, the filesystem has {out.gb(numbers['cache_free'])} free; "
            "free some space, set HF_HUB_CACHE to another disk, or use --stream "
            "(--ignore-free-space skips this check where a filesystem misreports its free space)"
        )


def plan_line(summary: dict, out_dir: Path, stream: bool) -> str:
    """One line for the log before a Hub source is downloaded: its size, and needed against free
    (the summary's `space` numbers)."""
    head = f"{summary['source']}: {summary['shards']} shards, {out.gb(summary['download_bytes'])}"
    room = f"{out.gb(summary['disk_required'])} needed in {out_dir} ({out.gb(summary['disk_free'])} free)"
    if stream:
        return f"{head}, streamed: {room}, with the shards in flight"
    if "cache_dir" in summary:
        cache = f"{out.gb(summary['cache_required'])} to download to {summary['cache_dir']}"
        return f"{head}: {cache} ({out.gb(summary['cache_free'])} free); {room}"
    return f"{head}: {room}, with the download to the Hub cache"
