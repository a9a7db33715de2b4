"""Before the first byte of a conversion: can --out be written, what does --resume keep or
--overwrite replace, and do the filesystems have room for what the plan writes (and, for a Hub
source, downloads). A refusal here leaves every disk as it was.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mla_convert.constants import COMPLETE, LOCK_NAME, MANIFEST_NAME, STAGING_DIR_NAME
from mla_convert.errors import OutputError
from mla_convert.output import out_dir as out
from mla_convert.output.journal import Held, JobFiles, check_resumable, remove_partials, resumable_jobs
from mla_convert.output.manifest import readable_manifest
from mla_convert.settings import RunSettings
from mla_convert.units import gb

Kept = dict[str, JobFiles]  # job file -> its files (relative path, size, sha256)


@dataclass(frozen=True)
class OutputState:
    """What is in --out before the run, and what happens to it."""

    kept: Kept  # --resume: the jobs whose files are there and intact
    earlier: out.Earlier | None = None  # --overwrite: the earlier output's files, deleted before the run

    @property
    def kept_bytes(self) -> int:
        return sum(size for files in self.kept.values() for _, size, _ in files)


@dataclass(frozen=True)
class Conversion:
    """What preflight needs to know of the conversion (from its plan): its recorded options, its
    source's fingerprint and directory (None while only the headers of a Hub source are here),
    each shard job's files, and every file it writes."""

    options: dict
    fingerprint: str
    src_root: Path | None
    job_outputs: dict[str, list[str]]
    writes: set[str]


def inspect_output(
    conversion: Conversion, out_dir: Path, settings: RunSettings, held: Held | None = None
) -> OutputState:
    """Refuse an --out that cannot be used, before anything is written (a --resume only removes
    the partial files an interrupted run left). A dry run refuses the same, and changes nothing:
    a --resume's partial files stay, and its journaled files are counted by size, not re-hashed.
    `held`: what the Hub's branch holds (path -> size, sha256), where the run uploads: a journaled
    file there at its recorded size and sha256 is kept though gone from --out."""
    out.check_writable(out_dir)
    if conversion.src_root is not None:
        out.check_location(out_dir, conversion.src_root)
    if settings.resume and (out_dir / MANIFEST_NAME).exists():
        if settings.status:
            settings.status(f"checking the files already in {out_dir} (--resume)")
        manifest = check_resumable(out_dir, conversion.options, conversion.fingerprint)
        if not settings.dry_run:
            remove_partials(out_dir)
        kept = resumable_jobs(out_dir, manifest, conversion.job_outputs, rehash=not settings.dry_run, held=held)
        return OutputState(kept)
    if out.is_empty(out_dir) or (settings.resume and _only_staging(out_dir)):
        return OutputState({})
    if not settings.overwrite:
        if not out.is_earlier_output(out_dir):
            raise OutputError(
                f"{out_dir}: directory is not empty (it holds {out.first_and_others(out.files_under(out_dir))}); pick another "
                "--out (--overwrite replaces only an earlier mla-convert output)"
            )
        if (readable_manifest(out_dir) or {}).get("status") != COMPLETE:
            raise OutputError(f"{out_dir}: holds an unfinished conversion; pass --resume to finish it, or --overwrite")
        raise OutputError(
            f"{out_dir}: directory is not empty: it holds an earlier conversion; pass --overwrite to replace it"
        )
    return OutputState({}, out.earlier_output(out_dir, conversion.writes))


def _only_staging(out_dir: Path) -> bool:
    """A --stream run stopped before its manifest: only its downloads are there, kept for the resume."""
    return all(p.name in (STAGING_DIR_NAME, LOCK_NAME) for p in out_dir.iterdir())


def prepare(out_dir: Path, state: OutputState) -> None:
    """--out as the run starts: created, or the earlier output in it deleted (--overwrite)."""
    if state.earlier is not None:
        state.earlier.delete()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"{out_dir}: cannot create the output directory ({e.strerror or e})") from e


def space(
    summary: dict,
    out_dir: Path,
    settings: RunSettings,
    state: OutputState,
    download: int | None,
    cache: Path | None,
    budget: int | None = None,
) -> dict:
    """The free-space numbers of this run (summary entries): `disk_required` of `disk_free` on
    --out's filesystem (what --resume keeps is not needed again; with --stream, the source shards
    in flight count; a download to a Hub cache on the same filesystem counts), what --overwrite
    frees there first, and a download's own numbers when the cache is elsewhere. `download`: the
    bytes of a Hub source not yet in the cache `cache` (None: nothing is downloaded up front).
    `budget`: the most a `convert --upload` run holds there (what it keeps included)."""
    needed = summary["disk_required_stream"] if settings.stream else summary["bytes_out"]
    needed = max(0, needed - state.kept_bytes) if budget is None else budget
    numbers = {"disk_required": needed, "disk_free": out.disk_free(out_dir)}
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
    if numbers["disk_required"] > available and numbers.get("disk_budget") is not None:
        raise OutputError(
            f"{out_dir}: --max-disk {gb(numbers['disk_budget'])} is more than its filesystem has free "
            f"({gb(available)}); give a smaller --max-disk (this conversion needs at least "
            f"{gb(numbers['disk_budget_min'])}), or free some space"
        )
    if numbers["disk_required"] > available:
        freed = f" (with the {gb(freed)} that --overwrite frees)" if freed else ""
        raise OutputError(
            f"{out_dir}: not enough free space: the conversion needs {gb(numbers['disk_required'])} there, "
            f"its filesystem has {gb(available)} free{freed}; free some space or pick another --out "
            "(--ignore-free-space skips this check where a filesystem misreports its free space)"
        )
    if numbers.get("cache_required", 0) > numbers.get("cache_free", 0):
        raise OutputError(
            f"{numbers['cache_dir']}: not enough free space to download the source: it needs "
            f"{gb(numbers['cache_required'])}, the filesystem has {gb(numbers['cache_free'])} free; "
            "free some space, set HF_HUB_CACHE to another disk, or use --stream "
            "(--ignore-free-space skips this check where a filesystem misreports its free space)"
        )


def plan_line(summary: dict, out_dir: Path, stream: bool) -> str:
    """One line for the log before a Hub source is downloaded: its size, and needed against free
    (the summary's `space` numbers)."""
    head = f"{summary['source']}: {summary['shards']} shards, {gb(summary['download_bytes'])}"
    room = f"{gb(summary['disk_required'])} needed in {out_dir} ({gb(summary['disk_free'])} free)"
    if stream:
        return f"{head}, streamed: {room}, with the shards in flight"
    if "cache_dir" in summary:
        cache = f"{gb(summary['cache_required'])} to download to {summary['cache_dir']}"
        return f"{head}: {cache} ({gb(summary['cache_free'])} free); {room}"
    return f"{head}: {room}, with the download to the Hub cache"
